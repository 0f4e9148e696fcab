"""Regenerate the committed demo report AND the example outputs of docs/analyses.md from the same demo runs.

    python scripts/readme_examples.py                      # train the default demo (~1 min), then all below
    python scripts/readme_examples.py --demo-dir DIR       # reuse a demo already made with `entropylens demo --out DIR`

1. `entropylens demo --out <tmp>/entropylens-demo` (unless --demo-dir holds one already);
2. its report/ replaces reports/demo/;
3. every command in EXAMPLES runs in the demo's parent directory exactly as docs/analyses.md shows it,
   and its output goes to reports/demo/cli-examples.md and between the `<!-- cli-examples -->` markers
   of docs/analyses.md (DOC).
tests/test_readme_examples.py checks that the page and the committed report agree, so they cannot drift.
(The name is historical: the examples lived in README.md until README became a front page.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "analyses.md"  # the page that shows the example outputs
REPORT = ROOT / "reports" / "demo"
EXAMPLES_MD = REPORT / "cli-examples.md"
START, END = "<!-- cli-examples -->", "<!-- cli-examples:end -->"
RUNS = "entropylens-demo/runs"
EXAMPLES = (
    f"entropylens runs {RUNS}",
    f"entropylens analyze {RUNS} clipped_prob_distribution --run grpo-s0 --param bins=5",
    f'entropylens query {RUNS} "SELECT run, quadrant, count(*) AS tokens, round(avg(clipped::INT), 3) AS '
    "clipped_share FROM tokens WHERE quadrant <> 'ZA' GROUP BY ALL ORDER BY ALL\" --run grpo-s0 --run ce_gppo-s0",
    f"entropylens analyze {RUNS} entropy_ratio_by_step --run erc_dapo-s0 --format csv | head -4",
    f"entropylens report {RUNS} --run grpo-s0 --run ce_gppo-s0 --out grpo-vs-ce",
    f"entropylens analyze {RUNS} drift_by_prob_bin --param bins=0",
    f"entropylens show {RUNS} --run ce_gppo-s0 --step 31 | head -9",
    f"entropylens show {RUNS} --run ce_gppo-s0 --step 31 --seq 0 --color quadrant",
)


def _bin_dir() -> str:
    """The directory of this interpreter's `entropylens` script (the venv running this file)."""
    return str(Path(sys.executable).parent)


def run_example(cmd: str, cwd: Path) -> str:
    env = {**os.environ, "PATH": _bin_dir() + os.pathsep + os.environ.get("PATH", ""), "COLUMNS": "200"}
    res = subprocess.run(["bash", "-c", cmd + " 2>&1"], cwd=cwd, env=env, capture_output=True, text=True)
    return res.stdout


def blocks(cwd: Path) -> str:
    """The page's console blocks, one per example, each `$ command` then its real output."""
    out = []
    for cmd in EXAMPLES:
        text = run_example(cmd, cwd).rstrip("\n")
        out.append(f"```console\n$ {cmd}\n{text}\n```")
    return "\n\n".join(out) + "\n"


def splice(page: str, body: str) -> str:
    if START not in page or END not in page:
        raise SystemExit(f"{DOC.relative_to(ROOT)} lacks the markers {START} ... {END}")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{body}{END}{tail}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--demo-dir",
        type=Path,
        default=None,
        help="a directory made by `entropylens demo --out DIR` to reuse (default: train a new demo)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temporary demo directory (its path is printed)")
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="entropylens-readme-"))
    demo = tmp / "entropylens-demo"
    try:
        if a.demo_dir is not None:
            if not (a.demo_dir / "runs").is_dir() or not (a.demo_dir / "report" / "index.html").is_file():
                raise SystemExit(f"{a.demo_dir} is not an `entropylens demo --out` directory (runs/, report/)")
            demo.symlink_to(a.demo_dir.resolve(), target_is_directory=True)
        else:
            subprocess.run([str(Path(_bin_dir()) / "entropylens"), "demo", "--out", str(demo)], check=True)
        if REPORT.exists():
            shutil.rmtree(REPORT)
        shutil.copytree(demo / "report", REPORT)
        body = blocks(tmp)
        EXAMPLES_MD.write_text(
            "# The example commands of docs/analyses.md, run on this demo\n\n"
            "Written by `python scripts/readme_examples.py` with the report beside it.\n\n" + body
        )
        DOC.write_text(splice(DOC.read_text(), body))
        print(
            f"wrote {REPORT.relative_to(ROOT)}/ and the examples of {DOC.relative_to(ROOT)} ({len(EXAMPLES)} commands)"
        )
    finally:
        if a.keep:
            print(f"demo kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
