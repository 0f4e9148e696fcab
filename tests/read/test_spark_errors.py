"""The Spark engine's failures are one line, before any JVM starts (no slow marker: no Spark runs)."""

import os
import subprocess
import sys

import pytest
from fixture_runs import build

CLI = [sys.executable, "-m", "entropylens.cli.main"]
# `python -c` puts the working directory first on sys.path: run from tests/, not the repository root,
# whose entropylens/ source folder (without the cli/ mapping) would shadow the installed package.
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return build(tmp_path_factory.mktemp("runs"))


def _run(args, env=None, pre=""):
    code = f"{pre}import sys; from entropylens.cli.main import main; sys.argv = ['entropylens'] + {args!r}; main()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=HERE)


def test_missing_java_is_one_line(root, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(tmp_path)  # no java on it
    res = _run(["analyze", str(root), "kl_by_step", "--engine", "spark"], env=env)
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == "error: the Spark engine needs Java 17+ (no `java` on PATH and no JAVA_HOME)"


def test_missing_pyspark_is_one_line(root):
    res = _run(["report", str(root), "--engine", "spark"], pre="import sys; sys.modules['pyspark'] = None; ")
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip() == "error: the Spark engine needs pyspark: pip install 'entropylens[spark]'"


def test_bad_analysis_and_path_fail_before_spark(root, tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # would fail on Java if it got that far
    env.pop("JAVA_HOME", None)
    res = _run(["analyze", str(root), "nope", "--engine", "spark"], env=env)
    assert res.returncode == 2 and "unknown analysis 'nope'" in res.stderr
    res = _run(["analyze", str(tmp_path / "missing"), "kl_by_step", "--engine", "spark"], env=env)
    assert res.returncode == 2 and "does not exist" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_help_does_not_import_pyspark():
    code = (
        "import sys; from entropylens.cli.main import app; from typer.testing import CliRunner; "
        "r = CliRunner().invoke(app, ['analyze', '--help']); assert '--engine' in r.output, r.output; "
        "print('pyspark' in sys.modules, 'sqlglot' in sys.modules)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=HERE)
    assert res.stdout.strip() == "False False", res.stderr
