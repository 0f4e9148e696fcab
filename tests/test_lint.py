"""The linter: no undefined name, unused import or variable, or redefinition anywhere in the repository's
Python (pyproject's [tool.ruff.lint]). An undefined name in a rarely run branch (verl's trainer mode
crashed on one at its first update) fails here, before any user runs it."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    assert Path(ruff).exists(), "ruff is in the test extra: pip install '.[test]'"
    res = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
