"""The example outputs of docs/analyses.md come from scripts/readme_examples.py, run on the committed demo.

The script writes the same console blocks between the `<!-- cli-examples -->` markers of
docs/analyses.md and into reports/demo/cli-examples.md, next to the report it copies; these tests fail
when the page drifts from the committed report. (The file names are historical: the examples lived in
README.md until README became a front page.)
"""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("readme_examples", ROOT / "scripts" / "readme_examples.py")
rex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rex)


def examples_block() -> str:
    text = rex.DOC.read_text()
    assert rex.START in text and rex.END in text, f"{rex.DOC.name} lacks the cli-examples markers"
    return text.split(rex.START, 1)[1].split(rex.END, 1)[0].strip("\n")


def test_the_script_writes_the_examples_into_docs_analyses():
    assert rex.DOC == ROOT / "docs" / "analyses.md"
    assert rex.START not in (ROOT / "README.md").read_text()  # one copy of the outputs, on the page


def test_page_examples_equal_the_committed_report_examples():
    committed = rex.EXAMPLES_MD.read_text()
    assert examples_block() + "\n" in committed  # byte for byte what the script wrote beside the report
    shown = re.findall(r"^\$ (.*)$", examples_block(), flags=re.M)
    assert shown == list(rex.EXAMPLES)  # exactly the script's commands, none hand-edited


def _summary_rows(md: str) -> dict[str, dict[str, str]]:
    lines = [x for x in md.splitlines() if x.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return {
        r[0]: dict(zip(head, r))
        for r in ([c.strip() for c in x.strip("|").split("|")] for x in lines[2:])
        if len(r) == len(head)
    }


def test_page_runs_output_matches_the_committed_report_summary():
    report = _summary_rows((rex.REPORT / "report.md").read_text().split("## ", 2)[1])
    block = examples_block().split("```")[1]  # the first console block: `entropylens runs`
    lines = block.strip().splitlines()[1:]  # drop "console"
    assert lines[0] == f"$ {rex.EXAMPLES[0]}"
    head = lines[1].split()
    rows = [dict(zip(head, x.split())) for x in lines[2:]]
    assert {r["run"] for r in rows} == set(report)
    for r in rows:
        want = report[r["run"]]
        assert r["method"] == want["method"] and r["status"] == want["status"]
        assert int(r["steps"]) == int(want["steps"]) and int(r["tokens"]) == int(want["tokens"])
        for col in ("final_entropy", "final_reward"):
            assert float(r[col]) == pytest.approx(float(want[col]), rel=1e-3), (r["run"], col)


def test_splice_replaces_only_the_marked_region():
    text = f"intro\n{rex.START}\nold\n{rex.END}\noutro\n"
    assert rex.splice(text, "new\n") == f"intro\n{rex.START}\nnew\n{rex.END}\noutro\n"
    with pytest.raises(SystemExit, match="lacks the markers"):
        rex.splice("no markers", "x")
