"""docs/PROTOCOL.md is the contract in prose: its message table must say what ``protocol.SCHEMAS`` enforces."""

import re
from pathlib import Path

from sparkbus.wire.protocol import OPTIONAL, SCHEMAS, Kind

DOC = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"
ROW = re.compile(r"^\| (\d+) \| `(\w+)` \| [^|]+ \| ([^|]+) \|")
FIELD = re.compile(r"`(\w+)`: (\w+)")
OPTIONAL_FIELD = re.compile(r"`(\w+)`\?: (\w+)")


def message_table() -> dict[int, tuple[str, dict[str, str]]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        match = ROW.match(line)
        if match:
            number, name, fields = match.groups()
            rows[int(number)] = (name, dict(FIELD.findall(fields)), dict(OPTIONAL_FIELD.findall(fields)))
    return rows


def test_every_kind_is_in_the_table_with_its_number_and_name():
    table = message_table()
    assert {n: row[0] for n, row in table.items()} == {int(k): k.name for k in Kind}


def test_each_kinds_fields_and_types_match_the_schema():
    table = message_table()
    for kind, schema in SCHEMAS.items():
        _, required, optional = table[int(kind)]
        assert required == {name: t.__name__ for name, t in schema.items()}, kind.name
        assert optional == {name: t.__name__ for name, t in OPTIONAL.get(kind, {}).items()}, kind.name


def test_the_table_parser_sees_a_wrong_field():
    # The check above must be able to fail: a row with a field the schema lacks is told apart.
    line = "| 9 | `CREDIT` | rank → broker (ranks) | `credit`: int, `extra`: str | |"
    number, name, fields = ROW.match(line).groups()
    assert dict(FIELD.findall(fields)) != {n: t.__name__ for n, t in SCHEMAS[Kind.CREDIT].items()}
