"""A mixture of two DataFrames into one stream (``feed_mixture``, docs/MIXTURES.md): a real broker (or two), Spark in
local mode, two ranks under ``mpiexec``. Every assertion is exact: each slot of each epoch delivered once, holding
the (source, row, pass) the plan puts there; every window's counts exact, and every batch a whole window; a
mid-epoch checkpoint resumed delivers exactly the slots the checkpoint had not used, and the next epoch goes on
with the plan (the small source's passes numbered on); a broker killed while the ranks train the mixture costs a
recomputation of the epoch's DataFrame from Spark's lineage, and every slot is still trained once.

The sources' rows are numbered apart (``web`` 0..999, ``code`` 10,000..10,089), and the ranks record each row's
slot in its epoch as ``id`` (``slot_column="id"``): what a rank's checkpoint saves is then the slots it used.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from sparkbus import MixturePlan, feed_mixture

from harness import wait_for

pytestmark = pytest.mark.timeout(300)

WEIGHTS = {"web": 0.7, "code": 0.3}
BASE = {"web": 0, "code": 10_000}
ROWS = 600                    # an epoch: 30 windows of 20 rows, 14 web and 6 code each
BATCH = 20                    # the window (feed_mixture's default: batch_size)
SEED = 11


def sources(spark):
    web = spark.range(1_000, numPartitions=3).selectExpr("id as row", "cast(id as double) as x")
    code = spark.range(BASE["code"], BASE["code"] + 90, numPartitions=2).selectExpr("id as row",
                                                                                    "cast(id as double) as x")
    return {"web": web, "code": code}


def plan() -> MixturePlan:
    return MixturePlan.make({"web": 1_000, "code": 90}, WEIGHTS, BATCH, ROWS, SEED)


def options(stream: str, **more) -> dict:
    return {**dict(weights=WEIGHTS, rows_per_epoch=ROWS, stream=stream, seed=SEED, slot_column="id", batch_size=BATCH,
                   timeout=60), **more}


def assert_the_plan(slots: np.ndarray, rows: np.ndarray, epoch: int, names: list[str] | None = None) -> None:
    """Every slot of ``epoch`` once, each holding the row the plan draws there (its source, its pass)."""
    p = plan()
    order = np.argsort(slots)
    np.testing.assert_array_equal(slots[order], np.arange(ROWS), err_msg="each slot of the epoch once")
    source, k = p.at(epoch, slots)
    base = np.asarray([BASE[name] for name in p.names])[source]
    for s in range(len(p.names)):
        mine = source == s
        np.testing.assert_array_equal(rows[mine] - base[mine], p.rows(s, k[mine]))
    if names is not None:
        assert [p.names[s] for s in source] == names, "the source column names each row's source"
    per_window = np.stack([np.bincount(w, minlength=2) for w in source[order].reshape(-1, BATCH)])
    assert (per_window == np.asarray(p.counts)).all()
    assert p.counts == (6, 14)                  # code, web


def assert_whole_windows(slots: np.ndarray) -> None:
    """A rank's slots in arrival order: batch after batch, each a whole window (20 consecutive slots from a
    multiple of 20), so every step holds 14 web rows and 6 code rows."""
    assert len(slots) % BATCH == 0
    for batch in slots.reshape(-1, BATCH):
        assert batch[0] % BATCH == 0 and (batch == np.arange(batch[0], batch[0] + BATCH)).all(), batch


@pytest.mark.parametrize("brokers", [1, 2])
def test_every_window_holds_the_planned_rows_of_each_source(spark, start_broker_process, start_ranks, brokers):
    every = [start_broker_process() for _ in range(brokers)]
    epochs = 2 if brokers == 1 else 1
    ranks = start_ranks(2, ",".join(b.ranks for b in every), "--stream", "mix", "--epochs", str(epochs), "--values")
    reports = feed_mixture(sources(spark), [b.feed for b in every], epochs=epochs, **options("mix"))
    assert [r.rows for r in reports] == [ROWS] * epochs
    summaries = ranks.wait(150)
    assert [s["epochs"][e]["batches"] for e in range(epochs) for s in summaries] == [15] * 2 * epochs
    seen = {}
    for epoch in range(epochs):
        slots, rows, names = [], [], []
        for r in range(2):
            data = ranks.epoch(r, epoch)
            values = json.loads((ranks.out / f"rank{r}-epoch{epoch}-values.json").read_text())["values"]
            assert_whole_windows(data["id"])
            slots.append(data["id"])
            rows.append(data["row"])
            names.extend(values["source"])
            np.testing.assert_array_equal(data["x"], data["row"].astype(np.float64))
        slots_, rows_ = np.concatenate(slots), np.concatenate(rows)
        assert_the_plan(slots_, rows_, epoch, names)
        seen[epoch] = rows_
    if epochs == 2:             # code: 180 draws an epoch of 90 rows, passes 0-1 then 2-3, each row once a pass
        for rows_ in seen.values():
            code = rows_[rows_ >= BASE["code"]]
            assert len(code) == 180 and (np.bincount(code - BASE["code"]) == 2).all()
        web = np.concatenate([rows_[rows_ < BASE["code"]] for rows_ in seen.values()])
        assert len(web) == 840 and len(np.unique(web)) == 840, "web: without replacement across the epochs"


def test_a_mid_epoch_checkpoint_resumes_the_mixture_exactly(spark, start_broker_process, start_ranks):
    broker = start_broker_process("--heartbeat", "200ms")
    # the ranks checkpoint after 5 steps of epoch 0 and are killed after 9 (holding the 10th); the run after the
    # resume delivers the rest of epoch 0 and epoch 1 whole
    first = start_ranks(2, broker.ranks, "--stream", "mixed", "--epochs", "2", "--checkpoint-at", "5",
                        "--stop-after", "9")
    feed_mixture(sources(spark), broker.feed, epochs=2, **options("mixed", pack_bytes=0))
    first.wait_stopped(["rank0", "rank1"])
    first.kill()
    states = [json.loads((first.out / f"rank{r}-state.json").read_text()) for r in range(2)]
    assert [(s["epoch"], s["steps"]) for s in states] == [(0, 5), (0, 5)], states
    second = start_ranks(2, broker.ranks, "--stream", "mixed", "--epochs", "2", "--resume", str(first.out))
    reports = feed_mixture(sources(spark), broker.feed, epochs=2, resume=states, **options("mixed", pack_bytes=0))
    assert [r.rows for r in reports] == [ROWS, ROWS]
    summaries = second.wait(150)
    before = []
    for r in range(2):
        with np.load(first.out / f"rank{r}-checkpoint.npz") as data:
            before.append(data["id"])
    assert sum(len(b) for b in before) == 2 * 5 * BATCH
    after = [second.epoch(r, 0) for r in range(2)]
    slots = np.concatenate([*before, *[a["id"] for a in after]])
    # the rows of the slots before the checkpoint: the plan's (the resumed feed is the same plan)
    p = plan()
    source, k = p.at(0, np.concatenate(before))
    rows_before = np.asarray([p.rows(s, [kk])[0] + BASE[p.names[s]] for s, kk in zip(source, k)], np.int64)
    assert_the_plan(slots, np.concatenate([rows_before, *[a["row"] for a in after]]), 0)
    assert len({s["epochs"][0]["batches"] for s in summaries}) == 1, "equal steps after the resume"
    assert_the_plan(np.concatenate([second.epoch(r, 1)["id"] for r in range(2)]),
                    np.concatenate([second.epoch(r, 1)["row"] for r in range(2)]), 1)


def test_a_broker_lost_mid_epoch_is_recovered_from_the_mixtures_lineage(spark, start_broker_process, start_ranks):
    """The epoch is fed (the broker holds it all) and the ranks train it slowly; the broker is killed without a
    journal and restarted: ``feed_mixture(wait_delivered=True)`` watches the epoch, recomputes the partitions no
    broker holds from the same plan, and the ranks train every slot once (what they had used is not sent again)."""
    broker = start_broker_process("--heartbeat", "200ms")
    ranks = start_ranks(2, broker.ranks, "--stream", "lineage-mix", "--slow-rank", "0", "--slow-seconds", "0.2")
    result: dict = {}

    def run() -> None:
        try:
            result["reports"] = feed_mixture(sources(spark), broker.feed, wait_delivered=True,
                                             **options("lineage-mix", pack_bytes=0, timeout=10))
        except BaseException as exc:        # raised in the test below
            result["error"] = exc

    feeding = threading.Thread(target=run)
    feeding.start()

    def acked() -> int:
        epochs = broker.stats()["streams"].get("lineage-mix", {}).get("epochs", {})
        return epochs.get("0", {}).get("acked", 0)

    wait_for(lambda: acked() >= 6 or not feeding.is_alive(), 120, "some batches of the mixture trained")
    assert "error" not in result and feeding.is_alive(), result
    broker.proc.kill()                               # kill -9, mid-epoch, no journal: its state is gone
    broker.proc.wait(5)
    broker.restart()
    feeding.join(200)
    assert not feeding.is_alive(), "feed_mixture did not finish"
    if "error" in result:
        raise result["error"]
    summaries = ranks.wait(150)
    assert len({s["epochs"][0]["batches"] for s in summaries}) == 1, "equal steps"
    data = [ranks.epoch(r, 0) for r in range(2)]
    assert_the_plan(np.concatenate([d["id"] for d in data]), np.concatenate([d["row"] for d in data]), 0)
    end = broker.stats()["streams"]["lineage-mix"]["epochs"]["0"]
    assert end["adopted"] >= 6 - 2, end      # what the ranks had trained before the kill was not sent again
