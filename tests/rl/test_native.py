"""The native row pass (entropylens/rl/_row_sums.c via entropylens/rl/native.py) against the eager chunked
pass and float64: the same per-row sums to float32 rounding, at block edges, in bfloat16, at
temperatures, on strided rows, on NaN / inf rows, whatever the thread count; and the eager pass when
it is switched off or cannot be built."""

import shutil

import pytest
import torch

from entropylens.rl import native, stats

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="no C compiler on this machine: the native row pass cannot be built",
)


@pytest.fixture(autouse=True)
def _native_on(monkeypatch):
    """The native row pass is opt-in (ENTROPYLENS_NATIVE=1): these tests test it, so they opt in."""
    monkeypatch.setenv("ENTROPYLENS_NATIVE", "1")


def _sums(flat, tok, t, *, split, want_sens, eager, want_dot=True):
    n = flat.shape[0]
    sums = torch.full((7 if want_sens else 5 if split else 4, n), -1.0)
    if eager:
        stats._chunk_sums(flat, tok, t, 3, sums, want_dot, split, want_sens)
    else:
        assert native.usable(flat), native.status()
        native.row_sums(flat, tok, t, sums, want_dot=want_dot, split=split, want_sens=want_sens)
    return sums


def _float64_sums(flat, tok, t, split):
    """m, u_a, S, D, e_a, R, Q in float64 from the float32 values: u = max(z/T - m, -87), e = exp(u)."""
    u = flat.float().div(t).double()
    m = u.amax(-1)
    u = u - m[:, None]
    ua = u.gather(1, tok[:, None]).squeeze(1)
    u = u.clamp(min=-87.0)
    e = u.exp()
    ea = e.gather(1, tok[:, None]).squeeze(1)
    if split:
        e = e.scatter(1, tok[:, None], 0.0)
    return [m, ua, e.sum(-1), (e * u).sum(-1), ea, (e * e * u).sum(-1), (e * e).sum(-1)]


@pytest.mark.parametrize("v", [1, 7, 511, 512, 513, 1100, 32000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1.0, 0.7, 1.3])
def test_native_sums_equal_eager_and_float64(v, dtype, t):
    g = torch.Generator().manual_seed(v)
    n = 9
    flat = (torch.randn(n, v, generator=g) * 4).to(dtype)
    # sampled tokens at the 512-element block edges, the first and last entry, and random ones
    tok = torch.tensor(
        [0, v - 1, min(511, v - 1), min(512, v - 1), min(513, v - 1)] + torch.randint(0, v, (4,), generator=g).tolist()
    )
    for split, sens in [(False, False), (True, False), (True, True)]:
        nat = _sums(flat, tok, t, split=split, want_sens=sens, eager=False)
        eag = _sums(flat, tok, t, split=split, want_sens=sens, eager=True)
        ref = _float64_sums(flat, tok, t, split)
        assert torch.equal(nat[0], eag[0])  # the shift m: the same float32 ops, the same bits
        assert torch.equal(nat[1], eag[1])  # u_a before the floor
        for k in range(2, nat.shape[0]):
            if k == 4 and not split:
                continue
            torch.testing.assert_close(nat[k].double(), ref[k], rtol=2e-6, atol=1e-30)
            torch.testing.assert_close(nat[k], eag[k], rtol=2e-5, atol=1e-30)


def test_the_exp_is_accurate_over_its_whole_range():
    """A row whose shifted values sweep [-87, 0]: S against float64 (each term's exp within ~2 ulp)."""
    u = torch.linspace(-87.0, 0.0, 200_001)
    flat = u[None, :].contiguous()
    tok = torch.tensor([100_000])
    nat = _sums(flat, tok, 1.0, split=False, want_sens=True, eager=False)
    e = u.double().exp()
    torch.testing.assert_close(nat[2].double(), e.sum()[None], rtol=1e-6, atol=0)
    torch.testing.assert_close(nat[3].double(), (e * u.double()).sum()[None], rtol=1e-6, atol=0)
    # one term at a time: each row holds the max (0) and one value x; S - 1 = exp(x)
    xs = torch.linspace(-80.0, -0.01, 4001)
    rows = torch.stack([torch.zeros_like(xs), xs], 1)
    s = _sums(rows, torch.zeros(len(xs), dtype=torch.long), 1.0, split=True, want_sens=False, eager=False)[2]
    rel = (s.double() - xs.double().exp()).abs() / xs.double().exp()
    assert rel.max() < 3e-7  # <= ~2.5 ulp of float32


def test_thread_count_does_not_change_a_bit(monkeypatch):
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(64, 4096, generator=g) * 3
    tok = torch.randint(0, 4096, (64,), generator=g)
    before = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out.append(_sums(flat, tok, 0.9, split=True, want_sens=True, eager=False))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], out[2])


def test_strided_rows_and_nonfinite_rows():
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(6, 1300, generator=g)
    view = wide[:, :1000]  # rows 1300 apart: a view, not copied
    assert view.stride() == (1300, 1) and native.usable(view)
    view[1, 5] = float("nan")
    view[2, 9] = float("inf")
    view[3] = float("-inf")
    view[4, :500] = float("-inf")  # half the vocabulary banned: finite row
    tok = torch.tensor([3, 4, 5, 6, 600, 999])
    nat = _sums(view, tok, 1.0, split=True, want_sens=True, eager=False)
    eag = _sums(view.contiguous(), tok, 1.0, split=True, want_sens=True, eager=True)
    for r in (1, 2, 3):  # NaN, +inf and all -inf rows have no distribution: NaN sums, as the eager pass
        sums = [2, 3, 5, 6]  # S, D, R, Q (e_a alone may be finite in the eager pass: its clamp)
        assert torch.isnan(nat[sums, r]).all() and torch.isnan(eag[sums, r]).all()
    for r in (0, 4, 5):
        torch.testing.assert_close(nat[:, r], eag[:, r], rtol=2e-5, atol=1e-30)
    lp, h = stats.logprobs_and_entropy(view, tok)
    assert torch.isnan(lp[1:4]).all() and torch.isnan(h[1:4]).all() and torch.isfinite(lp[[0, 4, 5]]).all()


def test_logprobs_and_entropy_same_with_native_off(monkeypatch):
    """The public functions give the same values (to float32 rounding) whichever pass runs, and the
    switch really switches: with ENTROPYLENS_NATIVE=0 (or unset: the default) the eager exps over [c, V] run."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(4, 5, 3000, generator=g) * 3
    tok = torch.randint(0, 3000, (4, 5), generator=g)
    on = stats.logprobs_and_entropy(z, tok, temperature=0.8, sensitivity=True, one_hot_distance=True)
    calls = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.exp and args[0].dim() == 2 and args[0].shape[-1] == 3000:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        stats.logprobs_and_entropy(z, tok, temperature=0.8, sensitivity=True)
    assert calls == []  # native: no torch exp over the vocabulary
    monkeypatch.setenv("ENTROPYLENS_NATIVE", "0")
    assert native.status().startswith("eager") and not native.usable(z.reshape(-1, 3000))
    with Spy():
        off = stats.logprobs_and_entropy(z, tok, temperature=0.8, sensitivity=True, one_hot_distance=True)
    assert calls  # eager: the chunked torch exps ran
    for a, b in zip(on, off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_without_a_compiler_the_eager_pass_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing built there
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is None
    assert "native unavailable" in native.status()
    z = torch.randn(3, 100)
    tok = torch.tensor([1, 2, 3])
    lp, h = stats.logprobs_and_entropy(z, tok)
    ref = torch.log_softmax(z.double(), -1)
    torch.testing.assert_close(lp.double(), ref.gather(1, tok[:, None]).squeeze(1), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(native, "_tried", False)  # (monkeypatch restores the loaded library after)


def test_build_lands_in_the_cache_once(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is not None
    built = list((tmp_path / "entropylens" / "native").glob("row_sums-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    assert list((tmp_path / "entropylens" / "native").iterdir()) == built  # no temporary left


def test_a_damaged_cached_library_is_built_anew(monkeypatch, tmp_path):
    """A damaged file under the cache's name (what a full disk could leave) is built anew, in a fresh
    process (this one has the library loaded already: dlopen would hand back the loaded one)."""
    import os
    import subprocess
    import sys

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is not None
    (built,) = (tmp_path / "entropylens" / "native").glob("row_sums-*.so")
    built.unlink()  # (a new file: overwriting the loaded one in place would fault this process)
    built.write_bytes(b"\x7fELF truncated")
    probe = (
        "import torch; from entropylens.rl import native, stats; z = torch.randn(2, 700); "
        "print(native.status(), float((stats.logsumexp_f32(z) - torch.logsumexp(z, -1)).abs().max()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    ).stdout.split()
    assert out[0] == "native" and float(out[1]) < 1e-5
    assert built.stat().st_size > 1000  # the rebuilt library


def test_an_unwritable_cache_builds_under_the_temporary_directory(monkeypatch, tmp_path):
    import tempfile

    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file: NotADirectoryError
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is not None
    assert len(list((tmp_path / "tmp").glob("entropylens-native-*/row_sums-*.so"))) == 1


def test_cc_with_arguments_and_a_refusing_compiler(monkeypatch, tmp_path):
    """$CC may carry arguments (ccache gcc, gcc -O2); a compiler that refuses says so once per flag set."""
    cc = shutil.which("cc") or shutil.which("gcc")
    for n, (value, ok) in enumerate([(f"{cc} -O2", True), ("false", False)]):
        monkeypatch.setenv("CC", value)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / str(n)))
        monkeypatch.setattr(native, "_lib", None)
        monkeypatch.setattr(native, "_tried", False)
        assert (native.library() is not None) == ok
    assert native.status().count("false") == 2  # -march=native, then without it; no second folder


def test_tensor_subclasses_take_the_eager_pass():
    """A FakeTensor (torch.compile's tracing) has no memory for C to read: the eager pass traces."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    z = torch.randn(3, 700)
    assert native.usable(z)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(z)
        assert not native.usable(fake)
        h = stats.entropy_from_logits(fake)  # (no tokens: their range check would read values)
        assert h.shape == (3,)


def test_a_folder_others_may_write_is_refused(monkeypatch, tmp_path):
    """Code loaded from the build folder runs in this process: a folder others may write to (the
    shared temporary directory, say) is not built in."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(native, "_cache_dirs", lambda: [shared])
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_tried", False)
    assert native.library() is None and "not private" in native.status()
    assert list(shared.iterdir()) == []
