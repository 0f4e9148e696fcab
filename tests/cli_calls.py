"""The CLI called in-process (typer's CliRunner) the way the tests check it: a command that works,
and one that fails as the CLI promises (exit 2, one line `error: ...`, no traceback)."""

from entropylens.cli.main import app
from typer.testing import CliRunner

runner = CliRunner()


def ok(*args) -> str:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 0, res.output
    return res.stdout


def err(*args) -> str:
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)  # no traceback
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]
