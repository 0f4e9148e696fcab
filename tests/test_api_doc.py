"""docs/api.md is the public API's own signatures and docstrings (entropylens/api_doc.py), and those docstrings
say what every parameter is: each entry's ``Args:`` names exactly its parameters, in order (a new parameter
without its line fails here), and a function that returns something says what (``Returns:``)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from entropylens.api_doc import ENTRIES, api_markdown, documented

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m entropylens.api_doc > docs/api.md"
ENTRY = re.compile(r"    (\*{0,2}[A-Za-z_]\w*): \S")  # "    name: text" (continuation lines: 8 spaces)


def _section(doc: str, title: str) -> list[str] | None:
    """The lines under ``title`` ("Args:", ...) up to the next line that is not indented; None without it."""
    lines = doc.splitlines()
    if title not in lines:
        return None
    out = []
    for line in lines[lines.index(title) + 1 :]:
        if line.strip() and not line.startswith("    "):
            break
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return out


def _arg_names(doc: str) -> list[str] | None:
    """The names the ``Args:`` section documents, in order; each line is an entry or a continuation."""
    lines = _section(doc, "Args:")
    if lines is None:
        return None
    names = []
    for line in lines:
        m = ENTRY.match(line)
        if m:
            names.append(m.group(1))
        else:
            assert line.startswith(" " * 8) and line.strip(), f"Args: neither an entry nor a continuation: {line!r}"
    return names


def test_api_page_is_generated_from_the_docstrings():
    page = (ROOT / "docs" / "api.md").read_text()
    assert page == api_markdown(), f"docs/api.md is stale: regenerate it with `{COMMAND}`"


def test_the_page_names_its_command_and_test():
    head = api_markdown().split("\n## ", 1)[0]
    assert COMMAND in head and "tests/test_api_doc.py" in head


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.qualname)
def test_args_name_every_parameter_in_order(entry):
    d = documented(entry)
    params = [p.documented_name for p in d.params]
    names = _arg_names(d.doc)
    if not params:
        assert names is None, f"{d.name} takes no parameter but documents {names}"
        return
    assert names is not None, f"{d.name}: no Args: section for {params}"
    assert names == params, f"{d.name}: Args: documents {names}, the signature has {params}"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.qualname)
def test_what_a_function_returns_and_raises_is_said(entry):
    d = documented(entry)
    returns = _section(d.doc, "Returns:")
    if d.returns_something:
        assert returns, f"{d.name} returns {d.returns or 'a value'}: its docstring has no Returns: section"
    else:
        assert returns is None, f"{d.name} returns nothing but has a Returns: section"
    raises = _section(d.doc, "Raises:")
    for line in raises or []:
        assert re.match(r"    [A-Za-z_][\w.]*: \S", line) or line.startswith(" " * 8), f"{d.name}: Raises: {line!r}"


def test_the_docstrings_fit_in_120_columns():
    long = [
        f"{d.name}: {line!r}" for d in map(documented, ENTRIES) for line in d.doc.splitlines() if len(line) > 112
    ]  # a docstring line is indented 4 or 8 more in its file
    assert not long, long


def test_a_new_parameter_without_its_line_fails():
    d = documented(ENTRIES[0])
    doc = d.doc.replace("\n    run: ", "\n    run_id: ", 1)
    assert _arg_names(doc) != [p.documented_name for p in d.params]


def test_the_page_imports_neither_trl_nor_verl():
    """The TRL and verl entry points are read from their source files: rendering imports neither."""
    code = "import sys, entropylens.api_doc as a; a.api_markdown(); print(sorted({'trl', 'verl'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
