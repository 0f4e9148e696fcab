"""Shared fixtures."""

import shutil

import pytest


@pytest.fixture(params=["native", "eager"])
def row_pass(request, monkeypatch):
    """Runs a test under both CPU row passes of stats._forward: the native C loop
    (entropylens/rl/native.py, opted in with ENTROPYLENS_NATIVE=1) and the eager torch chunks (the default)."""
    from entropylens.rl import native

    if request.param == "eager":
        monkeypatch.setenv("ENTROPYLENS_NATIVE", "0")
    else:
        monkeypatch.setenv("ENTROPYLENS_NATIVE", "1")
        if native.library() is None:
            if shutil.which("cc") is None and shutil.which("gcc") is None:
                pytest.skip("no C compiler on this machine: the native row pass cannot be built")
            pytest.fail(f"a C compiler is here but the native row pass did not build: {native.status()}")
    return request.param


@pytest.fixture(scope="module")
def s3():
    """moto's real S3 server on loopback (helpers/s3_server.py), started for the module that asks, with the
    environment pointing at it; yields a function that makes a fresh bucket and returns its runs URL."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))
    from s3_server import s3_environment

    from entropylens import storage

    with s3_environment():
        n = [0]

        def bucket() -> str:
            n[0] += 1
            name = f"bucket{n[0]}"
            storage.filesystem("s3").mkdir(name)
            return f"s3://{name}/runs"

        yield bucket


@pytest.fixture(autouse=True)
def _no_inherited_terminal_size(monkeypatch):
    """No test sees the launching shell's COLUMNS / LINES: pytest-xdist's workers inherit COLUMNS=80 LINES=24,
    which the CLI (cli/main.py: `show` prints at the terminal's width when COLUMNS is set, else 120) would
    take for a terminal. A test that wants a width passes its own env."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
