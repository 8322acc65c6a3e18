"""The typed headers of ``wire.requests`` (what a broker reads) say what ``wire.protocol`` checks: for each kind sent
to a broker, the required fields of its schema (and ``v``, ``kind``) and the optional fields it may carry."""

import typing

import pytest

from sparkbus.wire import protocol, requests
from sparkbus.wire.protocol import Kind

TYPED = {
    Kind.HELLO: requests.HelloHeader,
    Kind.EPOCH_OPEN: requests.EpochOpenHeader,
    Kind.EPOCH_CLOSE: requests.EpochCloseHeader,
    Kind.EPOCH_RECOVER: requests.EpochRecoverHeader,
    Kind.EPOCH_QUERY: requests.EpochQueryHeader,
    Kind.PARTITION_END: requests.PartitionEndHeader,
    Kind.PARTITION_CLAIM: requests.PartitionClaimHeader,
    Kind.PARTITION_COMMIT: requests.PartitionCommitHeader,
    Kind.STATS_REQUEST: requests.StatsRequestHeader,
    Kind.CREDIT: requests.CreditHeader,
    Kind.ACK: requests.AckHeader,
    Kind.RETURN: requests.ReturnHeader,
    Kind.RECLAIM: requests.ReclaimHeader,
    Kind.BYE: requests.ByeHeader,
}


@pytest.mark.parametrize("kind", list(TYPED), ids=lambda kind: kind.name)
def test_a_typed_request_has_its_kinds_fields(kind):
    typed = TYPED[kind]
    assert typed.__required_keys__ == {"v", "kind", *protocol.SCHEMAS[kind]}
    assert typed.__optional_keys__ == set(protocol.OPTIONAL.get(kind, {}))
    assert typing.get_type_hints(typed)["kind"] == typing.Literal[kind]


def test_every_kind_a_broker_reads_is_typed():
    assert set(typing.get_args(requests.ToBroker)) == set(TYPED.values())
    # the rest of the kinds are the broker's replies, or BATCH and HEARTBEAT (typed in wire.headers, both ways)
    replies = {Kind.PARTITION_COMMITTED, Kind.OK, Kind.WELCOME, Kind.EPOCH_END, Kind.ERROR, Kind.STATS_REPLY,
               Kind.STEPS, Kind.RELEASE, Kind.LOST, Kind.PARTITION_RECEIVED}
    assert set(Kind) == set(TYPED) | replies | {Kind.BATCH, Kind.HEARTBEAT}


def test_a_request_as_received_is_its_typed_header():
    raw = protocol.pack_header(Kind.EPOCH_CLOSE, req=3, stream="s", epoch=1, partitions=4, expected=2)
    header = protocol.unpack_header(raw)
    typed = requests.EpochCloseHeader
    assert typed.__required_keys__ <= header.keys() <= typed.__required_keys__ | typed.__optional_keys__
