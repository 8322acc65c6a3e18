import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))   # tests/helpers.py


def pytest_collection_modifyitems(items):
    import pytest

    for item in items:
        if "integration" in item.path.parts:
            item.add_marker(pytest.mark.integration)
