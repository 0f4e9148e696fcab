"""The native row pass's build folders: a planted library in a symlinked temporary folder or under the
cache's name is not loaded, a folder another user owns is refused, a full cache disk falls back to the
temporary folder."""

import hashlib
import os
import platform
import shutil
import subprocess

import pytest

from entropylens.rl import native

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler on this machine")

PLANT = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("EL_MARKER"), "w"); if (f) { fputs("ran", f); fclose(f); }
}
int el_row_sums(void) { return 0; }
"""


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    """The native row pass is opt-in (ENTROPYLENS_NATIVE=1): these tests test it, so they opt in."""
    monkeypatch.setenv("ENTROPYLENS_NATIVE", "1")


@pytest.fixture()
def fresh(monkeypatch):
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_why_not", "")


def _unwritable_cache(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))


def test_a_symlinked_temporary_folder_with_a_planted_library_is_not_loaded(monkeypatch, tmp_path, fresh):
    marker = tmp_path / "marker"
    monkeypatch.setenv("EL_MARKER", str(marker))
    monkeypatch.delenv("CC", raising=False)
    _unwritable_cache(monkeypatch, tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(tmp))
    evil = tmp_path / "evil"
    evil.mkdir(mode=0o700)
    src = tmp_path / "plant.c"
    src.write_text(PLANT)
    plant = tmp_path / "plant.so"
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(plant), str(src)], check=True)
    # the library names anyone can predict (source, flags, machine, CPU): a planted copy under each
    source = native._SOURCE.read_bytes()
    for arch in (["-march=native"], []):
        key = hashlib.sha256(
            source + repr((["cc"], native._FLAGS + arch, platform.machine(), native._cpu_key())).encode()
        ).hexdigest()[:16]
        shutil.copy(plant, evil / f"row_sums-{key}.so")
    uid = os.getuid()
    os.symlink(evil, tmp / f"entropylens-native-{uid}")
    lib = native.library()
    assert not marker.exists(), "the planted library ran in this process"
    assert lib is not None and native.status() == "native"  # built in a fresh private folder instead
    (built,) = [p for p in tmp.glob("entropylens-native-*/row_sums-*.so") if not p.parent.is_symlink()]
    assert (built.parent.stat().st_mode & 0o777) == 0o700


def test_a_symlinked_cache_folder_is_refused(monkeypatch, tmp_path, fresh):
    evil = tmp_path / "evil"
    evil.mkdir(mode=0o700)
    (tmp_path / "cache" / "entropylens").mkdir(parents=True)
    os.symlink(evil, tmp_path / "cache" / "entropylens" / "native")
    monkeypatch.setattr(native, "_cache_dirs", lambda: [tmp_path / "cache" / "entropylens" / "native"])
    assert native.library() is None and "symbolic link" in native.status()
    assert list(evil.iterdir()) == []


def test_a_library_that_is_not_the_one_built_is_not_loaded(monkeypatch, tmp_path, fresh):
    """A file under the cache's name whose hash is not the one recorded at build time is built anew."""
    marker = tmp_path / "marker"
    monkeypatch.setenv("EL_MARKER", str(marker))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert native.library() is not None
    (built,) = (tmp_path / "entropylens" / "native").glob("row_sums-*.so")
    src = tmp_path / "plant.c"
    src.write_text(PLANT)
    built.unlink()
    subprocess.run([CC, "-shared", "-fPIC", "-o", str(built), str(src)], check=True)
    probe = "from entropylens.rl import native; print(native.status())"
    out = subprocess.run(
        [os.sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    ).stdout.split()
    assert out == ["native"] and not marker.exists()


def test_a_full_cache_disk_falls_back_to_the_temporary_folder(monkeypatch, tmp_path, fresh):
    """ENOSPC in the cache folder is an unwritable folder: the temporary-folder fallback runs."""
    cache = tmp_path / "cache"
    fake = tmp_path / "cc-full"
    fake.write_text(f"""#!/bin/sh
for a in "$@"; do case "$a" in {cache}/*) echo "{cache}/x.so: No space left on device" >&2; exit 1;; esac; done
exec {CC} "$@"
""")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(tmp))
    assert native.library() is not None, native.status()
    assert list(tmp.glob("entropylens-native-*/row_sums-*.so"))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another user needs root")
def test_a_cache_folder_another_user_owns_is_refused(monkeypatch, tmp_path, fresh):
    """A folder not owned by this user is not built in nor loaded from; the fresh private folder is."""
    cache = tmp_path / "cache" / "entropylens" / "native"
    cache.mkdir(parents=True, mode=0o700)
    os.chown(cache, 54321, 54321)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(tmp))
    with pytest.raises(PermissionError, match="not private"):
        native._private_folder(cache)
    assert native.library() is not None and list(cache.iterdir()) == []
    assert list(tmp.glob("entropylens-native-*/row_sums-*.so"))


def test_the_native_pass_is_off_unless_asked(monkeypatch):
    """By default (ENTROPYLENS_NATIVE unset) every pass, training included, runs torch's eager kernels."""
    import torch

    from entropylens.rl import stats

    monkeypatch.delenv("ENTROPYLENS_NATIVE")
    monkeypatch.setattr(native, "row_sums", lambda *a, **k: pytest.fail("the native row pass ran by default"))
    assert not native.enabled() and native.status().startswith("eager (the default")
    z = torch.randn(2, 3, 50, requires_grad=True)
    lp, h = stats.logprobs_and_entropy(z, torch.randint(0, 50, (2, 3)))
    (lp.sum() + h.sum()).backward()
