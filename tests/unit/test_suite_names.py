"""The suite's modules have names unique across tests/unit and tests/integration: pytest imports them by basename
(rootdir-relative, no packages), and a second module of one name stops the whole run at collection."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_name_is_unique_across_the_suite():
    names = Counter(path.name for path in TESTS.rglob("test_*.py") if "harness" not in path.parts)
    assert len(names) > 50
    assert [name for name, count in names.items() if count > 1] == []
