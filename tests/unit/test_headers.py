"""The typed headers of ``wire.headers`` say what ``wire.protocol`` checks: for each kind, the required fields of its
schema (and ``v``, ``kind``), the optional fields it may carry, and the fields the rank adds itself, named here."""

import typing

import pytest

from sparkbus.wire import headers, protocol
from sparkbus.wire.protocol import Kind

TYPED = {
    Kind.BATCH: headers.BatchHeader,
    Kind.STEPS: headers.StepsHeader,
    Kind.RELEASE: headers.ReleaseHeader,
    Kind.EPOCH_END: headers.EpochEndHeader,
    Kind.LOST: headers.LostHeader,
    Kind.WELCOME: headers.WelcomeHeader,
    Kind.HEARTBEAT: headers.HeartbeatHeader,
    Kind.ERROR: headers.ErrorHeader,
}
# fields a rank sets on a header it holds, never sent by a broker
RANK_ONLY = {Kind.BATCH: {"index", "nbytes", "arrived"}, Kind.LOST: {"restarted"}}


@pytest.mark.parametrize("kind", list(TYPED), ids=lambda kind: kind.name)
def test_a_typed_header_has_its_kinds_fields(kind):
    typed = TYPED[kind]
    assert typed.__required_keys__ == {"v", "kind", *protocol.SCHEMAS[kind]}
    assert typed.__optional_keys__ == {*protocol.OPTIONAL.get(kind, {}), *RANK_ONLY.get(kind, set())}
    hints = typing.get_type_hints(typed)
    assert hints["kind"] == typing.Literal[kind]


def test_what_the_rank_reads_is_typed():
    assert set(typing.get_args(headers.FromBroker)) == set(TYPED.values())
    assert set(typing.get_args(headers.ToIntake)) == {TYPED[k] for k in
                                                      (Kind.BATCH, Kind.STEPS, Kind.RELEASE, Kind.EPOCH_END, Kind.LOST)}


def test_a_batch_as_received_is_a_batch_header():
    frames = protocol.pack_header(Kind.BATCH, stream="s", epoch=0, part=1, seq=2, attempt=0, rows=3, cols=[],
                                  checksum=9, splits=[1, 2])
    header = protocol.unpack_header(frames)
    assert set(headers.BatchHeader.__required_keys__) <= header.keys()
    assert header.keys() - headers.BatchHeader.__required_keys__ <= headers.BatchHeader.__optional_keys__
