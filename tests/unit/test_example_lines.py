"""What the demo and the examples print: epochs numbered as the API numbers them (from 0, with their place in the
run: ``epoch 0 (1 of 2)``), a resumed run says from which epoch and step, and an epoch's wait for its first batch
(in the first epoch, Spark's start-up) is shown apart as start-up, the data wait and the throughput being over
the time after the first batch."""

import argparse
import json
import sys
from pathlib import Path

import pytest

from sparkbus.progress import EpochTimes, epoch_label, fed_lines, wait_share

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import train_images  # noqa: E402
import train_text  # noqa: E402
import train_torch  # noqa: E402

pytestmark = pytest.mark.timeout(30)


def test_epochs_are_numbered_from_zero_with_their_place_in_the_run():
    assert [epoch_label(e, 3) for e in range(3)] == ["epoch 0 (1 of 3)", "epoch 1 (2 of 3)", "epoch 2 (3 of 3)"]


def test_a_fed_epoch_says_what_was_fed_and_why_training_waited():
    report = argparse.Namespace(rows=100_000, batches=391, seconds=4.25, verdict="compute-bound: rank 1")
    assert fed_lines(1, 3, report, "documents").splitlines() == [
        "fed epoch 1 (2 of 3): 100,000 documents in 391 batches in 4.2 s",
        "why training waited in epoch 1 (2 of 3): compute-bound: rank 1"]


def test_a_resumed_run_says_from_which_epoch_and_step():
    line = train_torch.resumed_line("the ranks (ckpt.pt)", {"epoch": 0, "steps": 16, "used": []}, 2)
    assert line.startswith("the ranks (ckpt.pt) resumed from a checkpoint: epoch 0 (1 of 2), after its step 16")


def test_an_epoch_is_split_at_its_first_batch():
    times = EpochTimes.split(wait_seconds=5.0, first_batch_seconds=4.0, seconds=10.0)
    assert (times.start_up, times.streaming, times.waited) == (4.0, 6.0, 1.0)
    assert times.wait_share == pytest.approx(1 / 6) and times.rate(600) == pytest.approx(100.0)
    none_came = EpochTimes.split(wait_seconds=3.0, first_batch_seconds=-1.0, seconds=3.0)
    assert (none_came.start_up, none_came.streaming, none_came.waited, none_came.wait_share) == (3.0, 0.0, 0.0, 0.0)
    assert wait_share([times, EpochTimes.split(2.0, 1.0, 5.0)]) == pytest.approx((1.0 + 1.0) / (6.0 + 4.0))


def test_torch_epoch_lines_number_epochs_from_zero_and_show_the_start_up_apart():
    result = {"epoch": 0, "steps": 5, "resumed_steps": 16, "rows": 500, "loss": 0.5, "accuracy": 0.9,
              "wait_seconds": [4.5, 4.2], "first_batch_seconds": [4.0, 4.0], "seconds": [10.0, 10.0]}
    line = train_torch.epoch_line(result, 2)
    assert line.startswith("epoch 0 (1 of 2): 5 steps (+16 before the checkpoint)")
    assert line.endswith("| start-up r0 4.00 s, r1 4.00 s | data wait r0 0.50 s of 6.00 s (8%), r1 0.20 s of 6.00 s "
                         "(3%)")
    summary = train_torch.make_summary([result, {**result, "epoch": 1, "first_batch_seconds": [0.5, 1.0]}],
                                       [1.0, 1.0], 2, None, 30.0)
    expected = {"seconds": [0.5 + 4.0, 0.2 + 3.2], "of_seconds": [6.0 + 9.5, 6.0 + 9.0],
                "share": [4.5 / 15.5, 3.4 / 15.0], "start_up_seconds": [4.5, 5.0]}
    assert sorted(summary["data_wait"]) == sorted(expected)
    for key, values in expected.items():
        assert summary["data_wait"][key] == pytest.approx(values), key
    assert "data wait: rank 0 4.50 s of 15.50 s (29%)" in train_torch.summary_lines(summary)


def image_figures():
    """epoch_figures of two ranks' gathered rows (``mine`` in run_ranks): 600 images, rank 1 waited 8 s for its
    first batch and 0.5 s after it, of 12 s."""
    import numpy as np

    rows = [[30.0, 250, 300, 90, 100, 11.0, 7.25, 3, 0, 0.5, 0.1, 1.0, 7.0],
            [28.0, 260, 300, 95, 100, 12.0, 8.5, 3, 0, 0.5, 0.1, 1.0, 8.0]]
    return train_images.epoch_figures(0, 3, np.array(rows))


def test_the_image_figures_take_images_per_second_and_the_data_wait_after_the_first_batch():
    r = image_figures()
    assert (r["seconds"], r["start_up_seconds"], r["streaming_seconds"]) == (12.0, 8.0, 4.0)
    assert r["images_per_second"] == pytest.approx(600 / 4.0)
    assert r["data_wait_share"] == pytest.approx((0.25 + 0.5) / (4.0 + 4.0))
    assert train_images.epoch_line(r, 2).startswith("epoch 0 (1 of 2): 600 images in 12.00 s (start-up 8.00 s, "
                                                    "then 150 images/s)")
    assert "| data wait r0 0.25 s, r1 0.50 s (9%) |" in train_images.epoch_line(r, 2)


def test_the_text_figures_take_rows_per_second_and_the_data_wait_after_the_first_batch():
    r = {"epoch": 1, "bucketed": True, "steps": 10, "rows": 640, "loss": 1.0, "accuracy": 0.5, "val_accuracy": 0.5,
         "padding_share": 0.1, "padded_slots": 1000, "wait_seconds": [0.5, 1.5], "first_batch_seconds": [0.25, 1.0],
         "seconds": [4.25, 5.0]}
    r.update(train_text.time_figures(r))
    assert (r["start_up_seconds"], r["streaming_seconds"], r["waited_seconds"]) == (1.0, 4.0, [0.25, 0.5])
    assert r["rows_per_second"] == 160.0 and r["data_wait_share"] == pytest.approx(0.75 / 8.0)
    line = train_text.epoch_line(r, 3)
    assert line.startswith("epoch 1 (2 of 3) (bucket_by tokens): 10 steps")
    assert line.endswith("| start-up 1.00 s, then 160 rows/s | data wait r0 0.25 s, r1 0.50 s (9%)")


# ---- the demo's tables ------------------------------------------------------------------------------------------

def table_rows(text: str, first: str) -> list[list[str]]:
    """The cells of the rows of a rich table in ``text`` whose first cell starts with ``first``."""
    rows = []
    for line in text.splitlines():
        if not line.lstrip().startswith("│"):           # a row of cells, not a border, the header or a title
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0].startswith(first):
            rows.append(cells)
    return rows


def header(text: str, title: str) -> list[str]:
    """The column names of the rich table titled ``title`` in ``text``."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip() == title)
    return [c.strip() for c in lines[at + 2].strip().strip("┃").split("┃")]


def summarize(kind: str, tmp_path, feed: dict | None, ranks: dict, **args) -> str:
    pytest.importorskip("rich")
    from rich.console import Console

    from sparkbus.demo import run

    if feed is not None:
        (tmp_path / "feed-report.json").write_text(json.dumps(feed))
    (tmp_path / "summary.json").write_text(json.dumps(ranks))
    console = Console(record=True, width=220, color_system=None)
    function = {"default": run.summarize, "images": run.summarize_images, "text": run.summarize_text}[kind]
    function(argparse.Namespace(out=tmp_path, min_accuracy=0.5, **args), console, 60.0)
    return console.export_text()


def test_the_demo_shows_each_epochs_start_up_apart_from_the_data_wait(tmp_path):
    def rank(r, waits):      # two epochs of 500 rows a rank; (wait, first batch, seconds) per epoch
        epochs = [{"batches": 2, "rows": 500, "bytes": 1000, "dropped_batches": 0, "dropped_rows": 0,
                   "wait_seconds": w, "seconds": s, "first_batch_seconds": f} for w, f, s in waits]
        return {"rank": r, "batches": 4, "rows": 1000, "bytes": 2000, "dropped_batches": 0, "dropped_rows": 0,
                "wait_seconds": sum(e[0] for e in waits), "seconds": sum(e[2] for e in waits),
                "first_batch_seconds": waits[0][1], "epochs": epochs}

    feed = {"generate_seconds": 3.0, "epochs": [{"epoch": e, "started": 100.0, "rows": 1000, "batches": 4,
                                                 "bytes": 2000, "seconds": 2.0} for e in range(2)]}
    ranks = {"size": 2, "finished_at": 120.0, "final_accuracy": 0.9, "final_accuracy_kind": "held-out",
             "model_spread_across_ranks": 0.0,
             "epochs": [{"epoch": e, "loss": 0.5, "train_accuracy": 0.8, "holdout_accuracy": 0.9} for e in range(2)],
             "ranks": [rank(0, [(9.0, 8.0, 12.0), (0.5, 0.25, 2.25)]), rank(1, [(10.0, 9.0, 12.0), (0.5, 0.5, 2.5)])]}
    text = summarize("default", tmp_path, feed, ranks, epochs=2, rows=1000, classes=10)
    columns = header(text, "Epochs")
    assert columns[:7] == ["epoch", "rows fed", "feed s", "rows/s", "MB/s", "start-up s", "data wait"]
    rows = table_rows(text, "epoch ")
    assert [r[0] for r in rows] == ["epoch 0 (1 of 2)", "epoch 1 (2 of 2)"]
    # epoch 0: the last rank's first batch at 9 s; after it, 1 s of 4 s and 1 s of 3 s waited
    assert rows[0][5:7] == ["9.0", f"{2 / 7:.0%}"] and rows[1][5:7] == ["0.5", f"{0.25 / 4:.0%}"]
    assert header(text, "Ranks")[5] == "start-up s"


def test_the_image_demo_shows_the_start_up_and_images_per_second_after_it(tmp_path):
    figures = image_figures()
    feed = {"epochs": [{"epoch": 0, "started": 100.0, "images": {"rows": 600, "batches": 6, "bytes": 10**6,
                                                                 "seconds": 5.0}}]}
    ranks = {"size": 32, "epochs": [figures], "param_checksums": [1.0, 1.0],
             "final": {"loss": figures["loss"], "accuracy": figures["accuracy"], "val_accuracy": 0.9}}
    figures.update(val_images=1_000, val_accuracy=0.9)
    text = summarize("images", tmp_path, feed, ranks, epochs=1, stream="images", decode="rank")
    columns = header(text, "Epochs (images 32x32 PNG, decoded on the rank side)")
    assert columns[:8] == ["epoch", "images", "feed s", "MB fed", "train s", "start-up s", "images/s", "data wait"]
    (row,) = table_rows(text, "epoch ")
    assert row[:8] == ["epoch 0 (1 of 1)", "600", "5.0", "1.0", "12.0", "8.0", "150", f"{0.75 / 8:.0%}"]
    assert "images / s to the CNN, after each epoch's start-up" in text


def test_the_text_demo_shows_the_start_up_and_sentences_per_second_after_it(tmp_path):
    r = {"epoch": 0, "bucketed": False, "steps": 10, "rows": 640, "loss": 1.0, "accuracy": 0.5, "val_accuracy": 0.8,
         "val_rows": 1_000, "padding_share": 0.1, "padded_slots": 1000, "wait_seconds": [6.5, 7.5],
         "first_batch_seconds": [6.25, 7.0], "seconds": [10.25, 11.0], "dropped_batches": [0, 1]}
    r.update(train_text.time_figures(r))
    ranks = {"epochs": [r], "param_checksums": [1.0, 1.0], "padding": {"ratio": None},
             "final": {"val_accuracy": 0.8}}
    text = summarize("text", tmp_path, None, ranks, epochs=1)
    columns = header(text, "Epochs (sentences as ragged token ids, padded per batch)")
    assert columns[:8] == ["epoch", "batching", "steps", "sentences", "dropped", "start-up s", "sentences/s",
                           "data wait"]
    (row,) = table_rows(text, "epoch ")
    assert row[:8] == ["epoch 0 (1 of 1)", "plain", "10", "640", "1", "7.0", "160", f"{0.75 / 8:.0%}"]
