"""README's first command, verbatim, in a fresh copy of the repository: it installs into a new venv and runs
`entropylens demo`, which writes the runs and the report. (The second command, the tests, is what .ci/run
runs in a fresh clone.) Slow: a venv, the install and the demo, 3 to 8 minutes on 2 cores."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _fresh_copy(dest: Path) -> None:
    """The files git tracks, and the untracked ones it does not ignore, as they are in the working tree
    (what a clone of this tree would hold): no .venv, no build output."""
    files = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


@pytest.mark.slow
def test_readme_run_command_installs_and_runs_the_demo(tmp_path):
    readme = (ROOT / "README.md").read_text()
    line = readme.split("<!-- run-command -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert line.endswith("entropylens demo"), line
    repo = tmp_path / "entropylens"
    _fresh_copy(repo)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    res = subprocess.run(["bash", "-c", line], cwd=repo, env=env, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    out = repo / "entropylens-demo"
    assert (out / "report" / "index.html").is_file() and (out / "report" / "report.md").is_file()
    runs = sorted(p.parent.name for p in (out / "runs").glob("*/run.json"))
    assert len(runs) == 4, runs  # GRPO, DAPO, CE-GPPO and ERC-DAPO, as README says
    statuses = {json.loads((out / "runs" / r / "run.json").read_text()).get("status") for r in runs}
    assert statuses == {"finished"}, statuses
