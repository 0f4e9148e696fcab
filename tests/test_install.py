"""Both a regular and an editable install expose entropylens.cli and entropylens.analyses, and
nothing named `cli` or `analyses` lands in site-packages. Bare venvs, no dependencies installed:
only the package layout is under test (entropylens/__init__ imports nothing heavy)."""

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib.util, json, site, os, sys
out = {}
for name in ("entropylens", "entropylens.cli", "entropylens.cli.main", "entropylens.analyses", "cli", "analyses"):
    spec = importlib.util.find_spec(name)
    out[name] = spec.origin if spec else None
import importlib.resources as r
out["sql"] = sorted(p.name for p in r.files("entropylens.analyses").iterdir() if p.name.endswith(".sql"))
out["native_src"] = r.files("entropylens.rl").joinpath("_row_sums.c").is_file()
out["viewer_assets"] = all(r.files("entropylens.report").joinpath(n).is_file() for n in ("viewer.js", "viewer.css"))
out["stages"] = [bool(importlib.util.find_spec(f"entropylens.{s}")) for s in ("rl", "record", "read", "report", "demo",
                                                                               "demo.toy", "integrations.verl")]
sp = site.getsitepackages()[0]
out["site"] = sorted(os.listdir(sp))
print(json.dumps(out))
"""


@pytest.mark.slow
# both installs build from this checkout (setuptools writes build/ and entropylens.egg-info in it): README's
# slow pass (`--dist loadfile`) runs them one after the other on one worker
@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_install_layout(tmp_path, editable):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    py = env_dir / "bin" / "python"
    args = [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps"]
    args += ["-e", str(ROOT)] if editable else [str(ROOT)]
    subprocess.run(args, check=True, cwd=tmp_path, capture_output=True)
    res = subprocess.run([str(py), "-c", PROBE], check=True, cwd=tmp_path, capture_output=True, text=True)
    out = json.loads(res.stdout)
    assert out["entropylens.cli"] and out["entropylens.cli"].endswith("cli/__init__.py")
    assert out["entropylens.cli.main"].endswith("cli/main.py")
    assert out["entropylens.analyses"].endswith("analyses/__init__.py")
    assert out["cli"] is None and out["analyses"] is None
    assert "cli" not in out["site"] and "analyses" not in out["site"]
    sql = sorted(p.name for p in (ROOT / "analyses").glob("*.sql"))
    assert out["sql"] == sql
    assert out["native_src"]  # the native row pass's C source ships with the package
    assert out["viewer_assets"] and all(out["stages"])  # the token viewer's script and style; every subpackage
    if not editable:
        assert "/site-packages/entropylens/cli/" in out["entropylens.cli"]


def test_python_started_in_the_repository_root_has_the_cli_and_the_analyses():
    """`python` in the repository root (where the README's install leaves you) imports the checkout's
    entropylens/ folder, and pyproject maps the top-level cli/ and analyses/ into the package only in an
    install: the checkout's own folders serve entropylens.cli and entropylens.analyses (its SQL files
    included) there too."""
    probe = PROBE.replace('sp = site.getsitepackages()[0]\nout["site"] = sorted(os.listdir(sp))\n', "")
    probe = probe.replace(
        "print(json.dumps(out))\n", "import entropylens\nprint(json.dumps({**out, 'file': entropylens.__file__}))\n"
    )
    # -S: no site-packages, so no install (an editable one has a finder of its own) can answer for the checkout
    res = subprocess.run([sys.executable, "-S", "-c", probe], check=True, cwd=ROOT, capture_output=True, text=True)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["file"] == str(ROOT / "entropylens" / "__init__.py")  # the checkout, not an install
    assert out["entropylens.cli.main"] == str(ROOT / "cli" / "main.py")
    assert out["entropylens.analyses"] == str(ROOT / "analyses" / "__init__.py")
    assert out["sql"] == sorted(p.name for p in (ROOT / "analyses").glob("*.sql"))
    assert out["cli"] is not None  # (the repository root is on sys.path, so its own cli/ is importable as such)


def test_every_runtime_dependency_is_imported():
    """Each entry of [project].dependencies is imported by the package's own sources (no dependency is
    installed for every user that nothing imports)."""
    import ast
    import re

    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}
    imported = set()
    for folder in ("entropylens", "cli"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
    assert names and sorted(names - imported) == []
