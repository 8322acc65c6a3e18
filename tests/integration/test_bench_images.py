"""benchmarks/images.py at a tiny size: both ways run and every image arrives and is decoded once, on both sides.

Counts, sums and the structure of the section's figures: their values are not judged (no timing in tests)."""

import importlib
import math
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
IMAGES, BATCH_SIZE = 300, 32


@pytest.fixture
def images(monkeypatch):
    """The ``benchmarks.images`` module: the package lives at the checkout's root, put on sys.path for the test."""
    monkeypatch.syspath_prepend(str(ROOT))
    return importlib.import_module("benchmarks.images")


def test_measure_decodes_every_image_once_on_both_sides(images, spark, tmp_path):
    result = images.measure(spark, IMAGES, reps=1, batch_size=BATCH_SIZE, work=tmp_path, timeout=90,
                            warm_up=False, log=lambda line: None)

    assert result["images"] == IMAGES and result["frame"]["images"] == IMAGES
    assert result["frame"]["mean_png_bytes"] > 100                       # PNGs, not empty cells
    assert sorted(result["runs"]) == ["sparkbus", "staging"]
    pixel_sums = set()
    for way, runs in result["runs"].items():
        (run,) = runs
        assert run["way"] == way
        assert run["images"] == IMAGES and sum(run["images_per_rank"]) == IMAGES
        assert run["id_sum"] == IMAGES * (IMAGES - 1) // 2                 # ids 0 .. IMAGES - 1, each once
        assert run["batches"] >= math.ceil(IMAGES / BATCH_SIZE)
        assert 0 < run["first"] <= run["last"]
        assert run["decode_seconds"] > 0
        pixel_sums.add(run["pixel_sum"])
    assert len(pixel_sums) == 1 and pixel_sums.pop() > 0                  # both decoded the same pixels
    assert result["checks"]["every_image_once"]
    fed, staged = result["runs"]["sparkbus"][0], result["runs"]["staging"][0]
    assert fed["fed_batches"] >= math.ceil(IMAGES / BATCH_SIZE) and fed["feed_seconds"] > 0
    assert staged["files"] >= 1 and staged["staged_bytes"] > 0 and staged["write_seconds"] > 0
    assert staged["cpu"]["loader_workers"] > 0                            # the DataLoader's workers decoded
    assert set(result["ratios"]) == {"faster", "first"} and all(v > 0 for v in result["ratios"].values())

    # the same figure as a section of the benchmark (benchmarks/bench.py --only images): its figures, each ratio
    # against the staging figure measured in the same run
    section = images.ImagesSection()
    assert section.name == "images" and not section.quick
    figures = {f.name: f for f in section.figures(None, result)}
    assert figures["sparkbus images/s"].anchor == "staging + DataLoader images/s"
    assert figures["sparkbus first image"].anchor == "staging + DataLoader first image"
    assert figures["sparkbus images/s"].ratio == pytest.approx(result["ratios"]["faster"])
    assert figures["sparkbus first image"].ratio == pytest.approx(result["ratios"]["first"])
    assert all(math.isfinite(f.value) and f.value > 0 for f in figures.values())
