"""A broker killed in the middle of a recovery and restarted with its journal (``python -m sparkbus.broker
--journal``) still recovers the epoch as EPOCH_RECOVER said: what it carries, what it holds for matching."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from sparkbus.broker.client import ControlClient
from sparkbus.launch.processes import wait_for
from sparkbus.wire import codec, protocol
from sparkbus.wire.protocol import Kind

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_a_broker_killed_mid_recovery_restarts_with_the_recovery_from_its_journal(tmp_path, start_broker_process,
                                                                                  context, sockets):
    broker = start_broker_process("--journal", str(tmp_path / "journal"))
    with ControlClient(broker.control, 30, context=context) as driver:
        driver.request(Kind.EPOCH_OPEN, stream="s", epoch=0, partitions=3, delivery="stream")
        driver.request(Kind.EPOCH_RECOVER, stream="s", epoch=0, partitions=3, delivery="stream",
                       carries=protocol.pack_ranges([0, 1]), recovered=protocol.pack_ranges([1]), lost=["gone"],
                       reset=False)
    broker.proc.kill()                                   # kill -9 once the EPOCH_RECOVER was answered
    broker.proc.wait(5)
    broker.restart()

    push = sockets(zmq.PUSH, broker.feed)
    for part in (0, 1, 2):                               # carried, recovered (held for the ranks' reclaims), neither
        push.send_multipart(codec.encode_batch("s", 0, part, 0, {"x": np.arange(4, dtype="<i8")}))

    def epoch():
        return broker.stats()["streams"]["s"]["epochs"]["0"]

    wait_for(lambda: epoch()["batches_in"] == 2 and epoch()["unassigned"] == 1, 30, "the three batches read")
    figures = epoch()
    assert (figures["queued"], figures["held"], figures["unassigned"]) == (1, 1, 1), figures
