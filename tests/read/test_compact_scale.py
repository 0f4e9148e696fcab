"""benchmarks/scale.py in its small mode: the real layout is written, the whole report runs before
and after compaction on the same rows, and the figures it prints are there (no time is asserted)."""

import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a benchmark end to end (about a minute): in .ci/run's slow pass
def test_scale_benchmark_small(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "scale.py"),
            "--rows",
            "20000",
            "--ranks",
            "2",
            "--rows-per-file",
            "2048",
            "--workers",
            "1",
            "--dir",
            str(tmp_path),
            "--keep",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    # ceil(20000 / (2 x 2048)) = 5 steps x 2 ranks x 2048 rows: at least the rows asked for
    assert "20,480 token rows: 5 steps x 2 ranks" in text
    run = next(tmp_path.glob("entropylens-scale-*/scale"))
    parts = list((run / "compacted" / "tokens").glob("*.parquet"))
    assert parts and sum(pq.read_metadata(p).num_rows for p in parts) == 20480
    assert not list((run / "tokens").rglob("*.parquet"))  # originals removed by the compaction
    for label in ("original files: whole report", "compacted: whole report"):
        assert label in text
    for name in ("ratio_vs_prob", "entropy_change_by_quadrant", "connect"):
        assert re.search(rf"^  {name} .* s CPU", text, re.M), name
    last = text.strip().splitlines()[-2]  # before "data kept in"
    assert re.fullmatch(
        r"rows=20480 bytes_per_row=[\d.]+ report_s=[\d.]+ compacted_report_s=[\d.]+ "
        r"compacted_report_cpu_s=[\d.]+ speedup_cpu=[\d.]+",
        last,
    ), last
