"""examples/train_images.py without Spark or MPI: the per-epoch jitter, the rank's decode pool, the image ids."""

import io
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("PIL")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_images as ti  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def shifted(image, dx, dy):
    """The reference: ``image`` moved right by dx and down by dy, black where nothing moved in."""
    h, w = image.shape
    padded = np.pad(image, ((abs(dy), abs(dy)), (abs(dx), abs(dx))))
    return padded[abs(dy) - dy:abs(dy) - dy + h, abs(dx) - dx:abs(dx) - dx + w]


def test_jitter_is_a_function_of_seed_epoch_and_id_within_the_shift():
    ids = np.arange(5_000, dtype=np.int64)
    a = ti.epoch_jitter(ids, seed=3, epoch=1, shift=2)
    assert a.shape == (5_000, 2) and a.min() == -2 and a.max() == 2
    np.testing.assert_array_equal(a, ti.epoch_jitter(ids.copy(), seed=3, epoch=1, shift=2))
    np.testing.assert_array_equal(a[100:200], ti.epoch_jitter(ids[100:200], seed=3, epoch=1, shift=2))
    assert (a != ti.epoch_jitter(ids, seed=3, epoch=2, shift=2)).any(axis=1).mean() > 0.9
    counts = np.unique(a[:, 0], return_counts=True)[1]
    assert counts.min() > 0.8 * 1_000 and (a[:, 0] != a[:, 1]).mean() > 0.7     # even, and dx, dy not tied
    assert not ti.epoch_jitter(ids, seed=3, epoch=1, shift=0).any()


def test_jitter_in_place_moves_each_image_by_its_own_shift():
    rng = np.random.default_rng(0)
    images = rng.integers(1, 256, (25, 6, 7), dtype=np.uint8)
    shifts = np.array([(dx, dy) for dx in range(-2, 3) for dy in range(-2, 3)])
    moved = images.copy()
    ti.jitter_in_place(moved, shifts)
    for image, out, (dx, dy) in zip(images, moved, shifts):
        np.testing.assert_array_equal(out, shifted(image, dx, dy))


def test_the_pool_decodes_memoryviews_of_one_buffer_in_chunks():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (37, 16, 16), dtype=np.uint8)
    encoded = [ti.encode_png(image) for image in images]
    values = np.frombuffer(b"".join(encoded), dtype=np.uint8)      # laid out as a RaggedColumn's values
    offsets = np.concatenate([[0], np.cumsum([len(e) for e in encoded])])
    rows = [memoryview(values[offsets[i]:offsets[i + 1]]) for i in range(len(encoded))]
    ids = np.arange(37) + 1_000
    pool = ti.DecodePool(threads=3, size=16)
    try:
        out, futures = pool.submit(rows, np.zeros((37, 2), dtype=np.int64))
        assert len(futures) == 3 and all(f.result() >= 0 for f in futures)
        np.testing.assert_array_equal(out, images)
        shifts = ti.epoch_jitter(ids, seed=1, epoch=0, shift=2)
        out, futures = pool.submit(rows, shifts)
        [f.result() for f in futures]
        for image, got, (dx, dy) in zip(images, out, shifts):
            np.testing.assert_array_equal(got, shifted(image, dx, dy))
    finally:
        pool.close()
    small = ti.DecodePool(1, size=8)
    try:
        _, futures = small.submit(rows[:1], np.zeros((1, 2), dtype=np.int64))
        with pytest.raises(ValueError, match="expected L"):
            futures[0].result()
    finally:
        small.close()


def test_held_out_images_come_from_digits_never_trained_on():
    from PIL import Image

    count = 50
    sources = (np.random.default_rng(2).integers(0, 256, (count, 8, 8), dtype=np.uint8), np.arange(count))
    train = {ti.render(i, 16, 4, sources)[1] for i in range(200)}       # labels = the source digit's index
    held = {ti.render(ti.VAL_BASE + i, 16, 4, sources)[1] for i in range(200)}
    assert len(held) == int(count * ti.HOLDOUT_SHARE) and len(train) == count - len(held)
    assert not train & held
    first, again = ti.render(7, 16, 4, sources)[0], ti.render(7, 16, 4, sources)[0]
    np.testing.assert_array_equal(first, again)                          # an id is always the same image
    assert first.shape == (16, 16) and first.dtype == np.uint8
    cycle = len(ti.source_pools(4, count)[0])
    same_digit = ti.render(7 + cycle, 16, 4, sources)
    assert same_digit[1] == ti.render(7, 16, 4, sources)[1] and not np.array_equal(first, same_digit[0])
    with Image.open(io.BytesIO(ti.encode_png(first))) as picture:
        np.testing.assert_array_equal(np.asarray(picture), first)        # PNG is lossless
