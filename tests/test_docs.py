"""README.md and the pages under docs/ stay true.

- docs/schema.md embeds `entropylens.schema.schema_markdown()` verbatim between its schema markers;
- README holds the two commands, and `.ci/run`'s awk line finds the test command in it;
- README stays a front page (well under 250 lines) that names every CLI command as `entropylens NAME`;
  docs/commands.md names every one too, and docs/analyses.md every analysis in analyses/;
- every relative link or image in README.md and docs/*.md points at a file that exists, and a
  `#fragment` into a Markdown file at one of its headings (GitHub's anchors);
- runnable examples run as written. The convention: a fenced ```python block whose opening fence is on
  the line right after a `<!-- runnable -->` comment, in README.md or any docs/*.md. Each such block
  runs on its own, as a script (`python block.py`), in a fresh temporary working directory, and must
  exit 0 within the timeout. So a runnable block is whole: its own imports, no names left for the
  reader to fill in, CPU only, offline, a few seconds. Blocks without the marker are sketches and are
  not run. README must hold at least one runnable block (its record -> query -> report example).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from entropylens.schema import schema_markdown

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"^(```|~~~)")


def _cli_names() -> list[str]:
    from entropylens.cli.main import app

    names = [c.name or c.callback.__name__ for c in app.registered_commands]
    assert names
    return names


def test_schema_page_column_table_matches_schema():
    text = (ROOT / "docs" / "schema.md").read_text()
    m = re.search(r"<!-- schema:start -->\n(.*)<!-- schema:end -->", text, re.S)
    assert m, "docs/schema.md lacks the schema markers"
    assert m.group(1) == schema_markdown(), "docs/schema.md column table is stale: entropylens schema --markdown"


def test_readme_has_two_commands():
    for marker in ("<!-- run-command -->", "<!-- test-command -->"):
        block = README.split(marker, 1)[1]
        line = block.split("```bash\n", 1)[1].split("\n", 1)[0]
        assert "pip install torch==2.13.0" in line


def test_ci_run_finds_the_test_command_in_readme():
    ci = (ROOT / ".ci" / "run").read_text()
    awk = re.search(r"cmd=\$\(awk '(.*?)' README\.md\)", ci)
    assert awk, ".ci/run no longer reads README with awk: update this test"
    got = subprocess.run(["awk", awk.group(1), "README.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    line = README.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert got.stdout.strip() == line and "pytest" in line


def test_readme_is_a_front_page():
    assert len(README.splitlines()) < 250, "README is the front page: move details into docs/"


def test_readme_says_what_query_can_do_and_which_passes_use_native_code():
    """README's own security paragraph says what
    `query` can and cannot do, and README says which passes may use native code."""
    text = " ".join(README.split())
    para = text.split("**Security of `entropylens query`.**", 1)[1].split("## ", 1)[0]
    for words in (
        "one read-only statement",
        "EXPLAIN",
        "WITH",
        "only the files of the runs",
        "cannot write",
        "attach a database",
        "install or load an extension",
        "network",
        "lock=False",
    ):
        assert words in para, words
    native = text.split("**Native code.**", 1)[1].split("## ", 1)[0]
    assert "ENTROPYLENS_NATIVE=1" in native and "training" in native and "eager" in native


def test_every_cli_command_in_readme():
    for name in _cli_names():
        assert f"entropylens {name}" in README, f"README does not document `entropylens {name}`"


def test_every_cli_command_in_the_commands_page():
    text = (ROOT / "docs" / "commands.md").read_text()
    for name in _cli_names():
        assert f"`entropylens {name}" in text, f"docs/commands.md does not document `entropylens {name}`"


def test_every_analysis_in_the_analyses_page():
    text = (ROOT / "docs" / "analyses.md").read_text()
    names = sorted(p.stem for p in (ROOT / "analyses").glob("*.sql"))
    assert names
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"docs/analyses.md does not name the analyses {missing}"


# ----------------------------------------------------------------------------------------------- links
def _prose(text: str) -> str:
    """The text outside fenced code blocks (links and headings in code are not links)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return "\n".join(out)


def _anchors(md: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(md.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(md: Path):
    prose = re.sub(r"`[^`\n]*`", "", _prose(md.read_text()))  # inline code holds no links
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        yield target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        path, _, frag = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif frag and dest.suffix == ".md" and frag not in _anchors(dest):
            broken.append(f"{target} (no heading #{frag} in {dest.name})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_anchor_rule_matches_github():
    md = ROOT / "docs" / "analyses.md"
    assert {"the-four-quadrants", "sql-entropylens-query", "named-analyses-entropylens-analyze"} <= _anchors(md)


# -------------------------------------------------------------------------------------- runnable examples
def runnable_blocks(md: Path) -> list[str]:
    """The ```python blocks right after a `<!-- runnable -->` line, in order."""
    lines = md.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", (
            f"{md.name}:{i + 1}: {RUNNABLE} must stand on the line just before a ```python fence"
        )
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        blocks.append("\n".join(lines[i + 2 : end]) + "\n")
    return blocks


EXAMPLES = [(p, k) for p in PAGES for k in range(len(runnable_blocks(p)))]


def test_readme_has_a_runnable_example():
    assert runnable_blocks(ROOT / "README.md"), f"README's record -> query -> report example lost its {RUNNABLE} marker"


def test_runnable_marker_finds_the_block():
    md = ROOT / "README.md"
    (code,) = [b for b in runnable_blocks(md) if "write_report" in b]
    assert code.startswith("import ") and "```" not in code


@pytest.mark.parametrize("page, k", EXAMPLES, ids=[f"{p.relative_to(ROOT)}-{k}" for p, k in EXAMPLES])
def test_runnable_example_runs_as_written(page, k, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(runnable_blocks(page)[k])
    res = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert res.returncode == 0, f"{page.relative_to(ROOT)} example {k} failed:\n{res.stdout}\n{res.stderr}"


def test_default_agg_of_every_method_is_on_the_pages():
    """docs/losses.md and docs/recording.md name each method's default agg (losses.DEFAULT_AGG)."""
    from entropylens.rl.losses import DEFAULT_AGG

    for page in ("losses.md", "recording.md"):
        text = " ".join((ROOT / "docs" / page).read_text().split())
        for agg in set(DEFAULT_AGG.values()):
            methods = [m for m, a in DEFAULT_AGG.items() if a == agg]
            # the sentence that gives this agg as a default names every method that has it
            said = [s for s in re.split(r"[;.]", text) if f"`{agg}` for" in s or f"`{agg}` for" in s]
            assert said and all(any(re.search(rf"\b{m}\b", s) for s in said) for m in methods), (page, agg, methods)
