"""The benchmark command at its quick size: it runs and writes its report. Its figures are not asserted."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def test_the_quick_benchmark_runs_and_writes_its_report(tmp_path):
    sparkbus = Path(sys.executable).parent / "sparkbus"
    result = subprocess.run([str(sparkbus), "bench", "--quick", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = (tmp_path / "RESULTS.md").read_text()
    for target in ("sparkbus broker throughput at 1 MiB batches", "sparkbus broker at 1 KiB batches",
                   "end to end from the cached DataFrame", "end to end vs Parquet staging",
                   "broker peak RSS", "data-wait"):
        assert target in report
    assert "not run" not in report                  # every section produced its figure
    assert (tmp_path / "throughput.png").stat().st_size > 10_000
