"""The linter and the formatter over the repository's Python (pyproject's [tool.ruff]): pyflakes, pycodestyle,
isort, pyupgrade and bugbear find nothing, and `ruff format --check` passes. An undefined name in a rarely
run branch (verl's trainer mode crashed on one at its first update) fails here, before any user runs it."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    assert Path(ruff).exists(), "ruff is in the test extra: pip install '.[test]'"
    res = subprocess.run(
        [ruff, "check", "--no-cache", "--output-format", "concise", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_ruff_format_leaves_every_file_as_it_is():
    """`ruff format --check`: the repository is formatted (pyproject's [tool.ruff]; `ruff format .` fixes it)."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    res = subprocess.run(
        [ruff, "format", "--check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


def _package_of(path: Path) -> str:
    """entropylens/rl/stats.py -> 'entropylens.rl'; entropylens/schema.py -> 'entropylens.schema'; cli/x.py -> 'cli'."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:2]) if parts[0] == "entropylens" else parts[0]


def _imported_package(path: Path, node) -> str:
    """The package a `from X import ...` reads from (relative imports resolved against ``path``)."""
    import_path = node.module or ""
    if node.level:
        base = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
        import_path = ".".join([*base, *filter(None, import_path.split("."))])
    parts = import_path.split(".")
    return ".".join(parts[:2]) if parts[0] == "entropylens" else parts[0]


def test_no_private_name_is_imported_across_packages():
    """A name with a leading underscore is its module's own: another package (rl, record, read, report, demo,
    integrations, cli, or a top-level module) imports only public names."""
    import ast

    found = []
    for path in sorted([*(ROOT / "entropylens").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            src = _imported_package(path, node)
            if not (src.startswith("entropylens") or src == "cli") or src == _package_of(path):
                continue
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if private:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {', '.join(private)} from {src}")
    assert not found, "\n".join(found)
