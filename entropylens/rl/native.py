"""The native row pass of :func:`entropylens.rl.stats._forward` on CPU (``_row_sums.c``).

The eager pass makes ~13 passes over each float32 [chunk, V] buffer for the log-probabilities and
entropies, and ~10 more for the entropy sensitivity's two extra reductions. The C loop reads each row
twice (its max, then one streaming loop of exp and four sums), vectorised, so the sensitivity costs a
few multiply-adds per element beside the exp (benchmarks/entropy.py section 5).

Built at first use with the system C compiler (``$CC`` or ``cc``; plain C, no torch headers)
into ``$XDG_CACHE_HOME/entropylens/native/`` (default ``~/.cache``; where that cannot be written,
is full or cannot be run from, a fresh ``mkdtemp`` folder for this process), keyed by the source, the
flags and the CPU; symbolic links and folders others own or may write to are refused, and a library
is loaded only if its SHA-256 is the one recorded when it was built (docs/native.md), with ctypes (which releases the GIL during the call). It runs only with
``ENTROPYLENS_NATIVE=1`` (opt-in: its bits depend on the compiler and the CPU, so a CPU training run
would depend on the machine that built it); by default, or without a compiler, the eager pass runs
(same values to float32 rounding). Only CPU float32 and
bfloat16 logits with contiguous rows use it; accelerators keep the eager pass.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("entropylens")

_SOURCE = Path(__file__).with_name("_row_sums.c")
# -fno-trapping-math: lets the compiler vectorise the floor's compare-and-select (no value changes);
# -fopenmp-simd: the `omp simd` reductions only (no OpenMP runtime is linked).
_FLAGS = ["-O3", "-fopenmp-simd", "-fno-trapping-math", "-fPIC", "-shared"]
_ARCH_FLAGS: tuple[list[str], ...] = (["-march=native"], [])  # the second: a compiler without -march=native
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_PARALLEL_MIN = 1 << 16  # elements per thread at least: fewer cost less than starting the thread

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""


def enabled() -> bool:
    """True only with ``ENTROPYLENS_NATIVE=1`` (read at every call, so tests and users can switch).

    Off by default: the native and eager passes agree to float32 rounding, not bit for bit, and the
    native build's bits depend on the compiler and the CPU (``-march=native``). Everything that feeds
    training (the old-policy and training passes of ``logprobs_and_entropy``, the toy trainer,
    ``policy_update``) therefore runs torch's own eager kernels unless a user opts in (docs/native.md)."""
    return os.environ.get("ENTROPYLENS_NATIVE", "0") == "1"


def _cpu_key() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


_FRESH = "a fresh private folder under the temporary directory"  # the fallback of _cache_dirs
# a compiler failing for one of these reasons failed on the folder, not on the source: try the next folder
_FOLDER_TROUBLE = (
    "No space left on device",
    "Disk quota exceeded",
    "Read-only file system",
    "Permission denied",
    "cannot open output file",
)


def _cache_dirs() -> list:
    """Where the built library goes: the user's cache (reused by later processes), else (read-only,
    full or noexec home) :data:`_FRESH`: a new folder made by ``mkdtemp`` (0700, unpredictable name)
    for this process only, never one found there (a predictable name under the shared temporary
    directory could be a symlink to a folder holding a planted library)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(base) / "entropylens" / "native", _FRESH]


def _private_folder(folder: Path) -> None:
    """Create ``folder`` (0700) and refuse a symbolic link, and a folder that another user owns or may
    write to: code loaded from it runs in this process. ``lstat``, so a link is seen as a link."""
    import stat

    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{folder} is a symbolic link or not a folder: not building there")
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise PermissionError(f"{folder} is not private to this user: not building there")


def _fresh_folder() -> Path:
    import atexit
    import shutil

    folder = Path(tempfile.mkdtemp(prefix="entropylens-native-"))
    atexit.register(shutil.rmtree, folder, True)  # the library stays mapped; the folder goes at exit
    _FRESH_DIRS.add(folder)
    _private_folder(folder)
    return folder


def _digest_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
    return h.hexdigest()


_FRESH_DIRS: set[Path] = set()


def _sidecar(out: Path) -> Path:
    """Where the SHA-256 of a built library is kept: beside it in a fresh folder; for the cache, in
    the private sibling folder ``native-hashes/`` (the cache folder holds the libraries only)."""
    if out.parent in _FRESH_DIRS:
        return out.with_name(out.name + ".sha256")
    return out.parent.with_name(out.parent.name + "-hashes") / (out.name + ".sha256")


def _compile(cc: list[str], flags: list[str], out: Path) -> str | None:
    """Compile the source to ``out`` (atomically: concurrent ranks each install a whole file) and write
    its SHA-256 beside it (``out.sha256``, which :func:`_load` checks); returns the compiler's
    complaint, or None when built."""
    _private_folder(out.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [*cc, *flags, "-o", tmp, str(_SOURCE), "-lpthread", "-lm"], capture_output=True, text=True, timeout=120
        )
        if proc.returncode != 0:
            complaint = proc.stderr.strip()[-300:] or f"exit status {proc.returncode}"
            if any(t in complaint for t in _FOLDER_TROUBLE):  # a full disk is an unwritable folder
                raise OSError(f"cannot build in {out.parent}: {complaint.splitlines()[-1]}")
            return complaint
        fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            digest = _digest_fd(fd)
        finally:
            os.close(fd)
        final = _sidecar(out)
        _private_folder(final.parent)
        side = final.with_name(Path(tmp).name + ".sha256")
        side.write_text(digest)
        os.replace(side, final)  # the hash first: a library without its hash is never loaded
        os.replace(tmp, out)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(out: Path) -> ctypes.CDLL:
    """Load ``out`` if it is the library this module built: opened without following a symbolic link,
    its SHA-256 equal to the one written when it was built (``out.sha256``), and the very file hashed
    is the one loaded (``/proc/self/fd``, where there is one). OSError otherwise (built anew)."""
    fd = os.open(out, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        try:
            want = _sidecar(out).read_text().strip()
        except OSError:
            raise OSError(f"{out}: no record of its hash (not built by this module)") from None
        if _digest_fd(fd) != want:
            raise OSError(f"{out}: not the library that was built (hash differs)")
        by_fd = f"/proc/self/fd/{fd}"
        lib = ctypes.CDLL(by_fd if os.path.exists(by_fd) else str(out))
    finally:
        os.close(fd)
    fn = lib.el_row_sums
    p, i, n = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [p, i, n, n, n, p, ctypes.c_float, i, i, i, p, p, p, p, p, p, p, i]
    fn.restype = ctypes.c_int
    return lib


def _build() -> ctypes.CDLL:
    """Load the cached library or build it: ``-march=native`` first, then without it (a compiler
    that lacks it); in the user's cache, then the temporary directory (an unwritable or noexec
    cache). A file that will not load (damaged) is built anew once. ``$CC`` may carry arguments
    (``ccache gcc``)."""
    cc = shlex.split(os.environ.get("CC", "")) or ["cc"]
    src = _SOURCE.read_bytes()
    failure: OSError | subprocess.SubprocessError | None = None
    for folder in _cache_dirs():
        complaints: list[str] = []
        try:
            if folder is _FRESH:
                folder = _fresh_folder()
            for arch in _ARCH_FLAGS:
                flags = _FLAGS + arch
                key = hashlib.sha256(src + repr((cc, flags, platform.machine(), _cpu_key())).encode()).hexdigest()[:16]
                out = folder / f"row_sums-{key}.so"
                _private_folder(folder)
                if not out.exists():
                    complaint = _compile(cc, flags, out)
                    if complaint is not None:
                        complaints.append(f"{' '.join(cc)} {' '.join(arch) or '(no -march)'}: {complaint}")
                        continue
                try:
                    return _load(out)
                except (
                    OSError
                ):  # damaged (a full disk), or not ours: built anew once; noexec fails again -> next folder
                    out.unlink(missing_ok=True)
                    _sidecar(out).unlink(missing_ok=True)
                    if _compile(cc, flags, out) is None:
                        return _load(out)
                    raise
        except FileNotFoundError as exc:
            if exc.filename == cc[0]:
                raise  # no compiler: no folder will help
            failure = exc
            continue
        except (OSError, subprocess.SubprocessError) as exc:  # unwritable, noexec: the next folder
            failure = exc
            continue
        raise RuntimeError("; ".join(complaints))  # the compiler refused the source: another folder won't help
    raise failure or RuntimeError("no folder to build in")


def library() -> ctypes.CDLL | None:
    """The loaded kernel, building it on first use; None (once logged) when it cannot be built."""
    global _lib, _tried, _why_not
    if _tried:
        return _lib
    with _lock:
        if not _tried:
            try:
                _lib = _build()
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _why_not = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.info("entropylens: the native row pass is unavailable (%s); using the eager pass", _why_not)
            _tried = True
    return _lib


def status() -> str:
    """One line for benchmarks and bug reports: which pass runs on CPU, and why."""
    if not enabled():
        return "eager (the default; ENTROPYLENS_NATIVE=1 opts into the native row pass)"
    return "native" if library() is not None else f"eager (native unavailable: {_why_not})"


_FUNCTORCH_WRAPPED = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)


def _plain(t: torch.Tensor) -> bool:
    """A tensor with its own memory: not a subclass (FakeTensor while torch.compile traces, DTensor)
    nor a functorch wrapper (vmap / grad transforms), whose data pointer C cannot read."""
    return type(t) is torch.Tensor and not (_FUNCTORCH_WRAPPED is not None and _FUNCTORCH_WRAPPED(t))


def usable(flat: torch.Tensor) -> bool:
    """Whether :func:`row_sums` takes these [N, V] logits: a plain CPU tensor, float32 / bfloat16,
    contiguous rows."""
    return (
        flat.device.type == "cpu"
        and flat.dtype in _DTYPES
        and flat.dim() == 2
        and (flat.stride(1) == 1 or flat.shape[1] == 1)
        and _plain(flat)
        and enabled()
        and library() is not None
    )


def row_sums(
    flat: torch.Tensor,
    tokens: torch.Tensor | None,
    temperature: float,
    sums: torch.Tensor,
    *,
    want_dot: bool,
    split: bool,
    want_sens: bool,
) -> None:
    """Fill ``sums`` ([4 | 5 | 7, N] float32, rows as in ``stats._forward``: m, u_a, S, D, e_a, R, Q)
    from logits ``flat`` [N, V] (see :func:`usable`) and ``tokens`` [N] int64 or None. With ``split``
    the sums run over j != a and e_a = exp(max(u_a, floor)) is row 4; with ``want_sens`` rows 5-6 are
    R = sum e_j^2 u_j and Q = sum e_j^2."""
    n, v = flat.shape
    if n == 0:
        return
    tok = None if tokens is None else tokens.contiguous()
    rows = [sums[k].data_ptr() for k in range(sums.shape[0])] + [None] * (7 - sums.shape[0])
    threads = max(1, min(torch.get_num_threads(), n * v // _PARALLEL_MIN))  # >= 64k elements per thread
    lib = library()
    assert lib is not None  # callers check usable() first, which loaded it
    rc = lib.el_row_sums(
        flat.data_ptr(),
        _DTYPES[flat.dtype],
        n,
        v,
        flat.stride(0),
        None if tok is None else tok.data_ptr(),
        float(temperature),
        int(want_dot),
        int(split),
        int(want_sens),
        *rows,
        threads,
    )
    if rc != 0:
        log.debug("entropylens: a native row-pass thread did not start; its rows ran on the calling thread")
