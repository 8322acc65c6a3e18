"""One scenario the guarantees share (``killed_inside_a_pack``). The real pieces the integration tests start come
from the harness (tests/harness/): Spark in local mode (``spark``, one session for the run), the broker through its
CLI (``start_broker_process``), mpiexec ranks or a consumer (``start_ranks``) and ranks without MPI
(``start_group``)."""

from __future__ import annotations

import threading

import pytest

from harness import Ranks, wait_for


@pytest.fixture
def killed_inside_a_pack(start_ranks):
    """``killed_inside_a_pack(broker, stream, make_frame, *flags)``: two independent consumers of ``stream`` (rank_main
    ``flags`` each); once both have joined, ``make_frame()`` is fed in batches of 100 (packs of 64) and the victim,
    which stops after five batches (its progress in the pack, four batches, told the broker), is SIGKILLed; the
    survivor (5 ms a batch) trains on to the end. Returns ``(victim, survivor)``, both finished."""

    def run(broker, stream: str, make_frame, *flags: str) -> tuple[Ranks, Ranks]:
        from sparkbus.feeder import feed

        victim = start_ranks(0, broker.ranks, "--stream", stream, "--stop-after", "5", *flags)
        survivor = start_ranks(0, broker.ranks, "--stream", stream, *flags, "--slow-rank", "0",
                               "--slow-seconds", "0.005")
        # both joined before the feed: packs are few, and a consumer alone could take them all in its window
        wait_for(lambda: len(broker.stats()["streams"].get(stream, {}).get("ranks", [])) == 2, 60, "both consumers")
        feeding = threading.Thread(target=feed, args=(make_frame(), broker.feed),
                                   kwargs=dict(stream=stream, batch_size=100, timeout=60))
        feeding.start()
        wait_for(lambda: victim.stopped(victim.name), 60, "the victim to stop after five batches")
        # its progress in the pack (the first four batches, a batch window) has reached the broker
        wait_for(lambda: any(r["acked"] >= 4 for r in broker.stats()["streams"][stream]["ranks"]), 10,
                 "the victim's progress in its pack")
        victim.kill()
        feeding.join(90)
        survivor.wait()
        return victim, survivor

    return run
