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
