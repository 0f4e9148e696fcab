"""Old-policy pass cost: TRL's two passes (selective_log_softmax, then entropy_from_logits) against
entropylens' single chunked `logprobs_and_entropy`. Prints tables; asserts nothing about time.

  python benchmarks/entropy.py [--repeats 5] [--quick]

1. no grad: time ratio (ours / TRL, medians, alternating in this process) and extra peak memory
   (each measured in a fresh child process: peak RSS during the call minus RSS before it).
2. with grad (the training pass): forward + backward peak memory of our logprobs against
   log_softmax + gather, beyond the [N, V] gradient both must produce.
3. float64 error at V = 151936 with logit offsets 0..40.
5. entropy attribution: the fused pass with the entropy sensitivity (two more reductions per row,
   logprobs_and_entropy(..., sensitivity=True)) against the same pass without it (target <= 1.15x), with no
   grad and in the training pass (forward + backward: where the recorder's s_t is computed), under the
   native CPU row pass (entropylens/rl/native.py, opted in here) and the eager chunks (the default), and the
   recorder's whole training pass with attribution (s_t, and the logit-gradient norm from the same
   sums) against the pass before attribution (a hook reading the gradient's row norms); 5b. the same
   in head_stats from hidden states (TRL attribution=True, policy_update(hidden=, head=)), training pass.
6. far tails: the pass on logits whose shifted values reach below -87.3 (1% -inf entries; sd 8 at
   T = 0.6) against the same pass on logits without such a tail, and a bare torch.exp of the
   unfloored values (the slow path every vocabulary-wide exp's floor avoids).
Last lines: tail_ratio=<the largest pass ratio of section 6>, sensitivity_ratio=<time ratio with / without at the first shape> and
ratio_vs_trl=<no-grad time ratio at [8192,32000] fp32> extra_gb=<its extra memory>
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

try:  # TRL's own functions when installed
    from trl.trainer.utils import entropy_from_logits as trl_entropy
    from trl.trainer.utils import selective_log_softmax as trl_selective_log_softmax

    TRL_SOURCE = "imported from trl"
except Exception:  # pragma: no cover - reproduced faithfully (TRL 0.2x / 1.x, trl/trainer/utils.py)
    TRL_SOURCE = "reproduced from trl/trainer/utils.py"

    def trl_selective_log_softmax(logits, index):
        if logits.dtype in (torch.float32, torch.float64):
            selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
            lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])  # row loop: less memory
            return selected - lse
        out = []
        for row_logits, row_labels in zip(logits, index):
            row = F.log_softmax(row_logits, dim=-1)
            out.append(row.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
        return torch.stack(out)

    def trl_entropy(logits, chunk_size=128):
        flat = logits.reshape(-1, logits.shape[-1])
        ents = []
        for chunk in flat.split(chunk_size, dim=0):
            logps = F.log_softmax(chunk, dim=-1)
            ents.append(-(torch.exp(logps) * logps).sum(-1))
        return torch.cat(ents).reshape(logits.shape[:-1])


os.environ.setdefault("ENTROPYLENS_NATIVE", "1")  # the native pass is opt-in; this benchmark measures it
from entropylens.rl import native  # noqa: E402
from entropylens.rl.stats import logprobs_and_entropy  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def trl_two_passes(logits, tokens):
    return trl_selective_log_softmax(logits, tokens), trl_entropy(logits)


def ours(logits, tokens):
    return logprobs_and_entropy(logits, tokens)


def make(n, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    b = 8 if n >= 8 else 1
    logits = torch.empty(b, n // b, v, dtype=dtype).normal_(0.0, 3.0, generator=g)  # no temporaries
    tokens = torch.randint(0, v, (b, n // b), generator=g)
    return logits, tokens


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(kind: str, n: int, v: int, dtype: str, grad: bool) -> None:
    """Runs in a fresh process: peak RSS of one call minus RSS before it (and before the gradient)."""
    logits, tokens = make(n, v, DTYPES[dtype])
    if grad:
        logits.requires_grad_(True)
    w = torch.randn(tokens.shape)
    # warm-up on a tiny input (loads kernels) without touching the big tensor's peak
    s_logits, s_tokens = make(16, 64, DTYPES[dtype], seed=1)
    if grad:
        s_logits.requires_grad_(True)
    base = rss_bytes()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if kind == "trl":
        lp, _ = trl_two_passes(logits, tokens)
    elif kind == "plain":  # log_softmax + gather, what autograd keeps for backward
        lp = torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    else:
        lp, _ = ours(logits, tokens)
    if grad:
        (lp * w).sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # the high-water mark before the call must not hide the call's own peak
    assert peak_before - base < 0.05e9, "setup left a high-water mark above the baseline"
    extra = peak - base
    if grad:  # the [N, V] gradient itself is the output both paths must produce: not "extra"
        extra -= logits.numel() * logits.element_size()
    print(json.dumps({"extra_gb": max(extra, 0) / 1e9}))


def measure_memory(kind, n, v, dtype, grad) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(n), str(v), dtype, str(int(grad))],
        capture_output=True,
        text=True,
        # fixed mmap threshold: every large tensor is its own mapping, so RSS follows allocations
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"},
    )
    if out.returncode:
        raise RuntimeError(f"memory child failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["extra_gb"]


def _chunk_body(z, a):
    """lse-shared log-prob and entropy of one [c, V] float32 chunk (what stats._forward does)."""
    u = z - z.amax(-1, keepdim=True)
    e = u.exp()
    s = e.sum(-1)
    ls = s.log()
    return u.gather(1, a.unsqueeze(1)).squeeze(1) - ls, ls - (e * u).sum(-1) / s


def compiled_vs_ours(n: int, v: int, repeats: int) -> tuple[float, float, float]:
    body = torch.compile(_chunk_body, dynamic=False)
    logits, tokens = make(n, v, torch.float32)
    flat, ft = logits.reshape(-1, v), tokens.reshape(-1)
    rows = 512

    def compiled():
        outs = [body(flat[s : s + rows], ft[s : s + rows]) for s in range(0, n, rows)]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    with torch.no_grad():
        t0 = time.perf_counter()
        compiled()
        first = time.perf_counter() - t0
        c = statistics.median(median_ms(compiled, (), 1) for _ in range(repeats))
        o = statistics.median(median_ms(ours, (logits, tokens), 1) for _ in range(repeats))
    return c, o, first


def median_ms(fn, args, repeats) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def paired(fn, repeats: int) -> tuple[float, float, float]:
    """fn(False) and fn(True) timed in ``repeats`` pairs after one warm-up each, the order swapped
    every pair (ABBA: neither variant always runs second, on a machine whose speed drifts within
    seconds): (median ms without, median ms with, median of the per-pair ratios with / without)."""
    fn(False), fn(True)  # warm-up
    t0, t1, ratios = [], [], []
    for i in range(repeats):
        if i % 2 == 0:
            a_ms = median_ms(fn, (False,), 1)
            b_ms = median_ms(fn, (True,), 1)
        else:
            b_ms = median_ms(fn, (True,), 1)
            a_ms = median_ms(fn, (False,), 1)
        t0.append(a_ms), t1.append(b_ms), ratios.append(b_ms / a_ms)
    return statistics.median(t0), statistics.median(t1), statistics.median(ratios)


def sensitivity_section(shapes, repeats: int) -> float:
    """Section 5: the fused pass with and without the entropy sensitivity (two more reductions per
    row), no grad, and the training pass (forward + custom backward) with and without it; then the
    recorder's training pass with attribution (s_t and d_t from the same sums, the logit-gradient norm
    in closed form) against the same pass before it (no s_t, a hook reading the gradient's row
    norms); medians of the per-pair time ratios over ``repeats`` alternating pairs. Each under the
    CPU row pass that runs by default (native: entropylens/rl/native.py, when it builds) and under the
    eager chunked pass (ENTROPYLENS_NATIVE=0), then the native pass with the sensitivity against the
    eager pass without it. Returns the no-grad ratio at the first shape under the default pass."""
    passes = ["native", "eager"] if native.status() == "native" else ["eager"]
    print(
        f"\n5. entropy sensitivity (two more reductions per row): fp32, medians over {repeats} alternating pairs; "
        f"CPU row pass: {native.status()}"
    )
    print(f"{'shape':>16} {'pass':>22} {'without ms':>11} {'with ms':>9} {'ratio':>6}")
    first = None
    for n, v in shapes:
        logits, tokens = make(n, v, torch.float32)
        train_z = logits.clone().requires_grad_(True)

        def fwd(sens):
            with torch.no_grad():
                return logprobs_and_entropy(logits, tokens, sensitivity=sens)

        def train(sens):
            lp = logprobs_and_entropy(train_z, tokens, sensitivity=sens)[0]
            lp.sum().backward()
            train_z.grad = None

        def recorded(attribution):
            """The recorder's training pass (policy_update's logits path): with attribution, s_t and
            d_t = ||e_a - p|| from the same sums (logit_grad_norm = |g|/T * d_t, no hook); before it, no
            s_t and a hook reading ||dLoss/dz_t|| off the [N, V] gradient (Recorder.watch_logits)."""
            if attribution:
                lp = logprobs_and_entropy(train_z, tokens, sensitivity=True, one_hot_distance=True)[0]
            else:
                handle = train_z.register_hook(
                    lambda g: norms.append(torch.linalg.vector_norm(g, dim=-1, dtype=torch.float32))
                )
                lp = logprobs_and_entropy(train_z, tokens)[0]
            lp.sum().backward()
            if not attribution:
                handle.remove()
                norms.clear()
            train_z.grad = None

        def native_vs_eager(native_on):
            """the no-grad pass: eager without the sensitivity (False) against native with it (True)"""
            with _row_pass("native" if native_on else "eager"):
                return fwd(native_on)

        norms = []
        for row_pass in passes:
            with _row_pass(row_pass):
                for label, fn in (("no grad", fwd), ("fwd + bwd", train), ("recorder's", recorded)):
                    without, with_, r = paired(fn, repeats)
                    print(f"{str([n, v]):>16} {row_pass + ' ' + label:>22} {without:11.1f} {with_:9.1f} {r:6.2f}")
                    first = first or r
        if len(passes) == 2:
            without, with_, r = paired(native_vs_eager, repeats)
            print(
                f"{str([n, v]):>16} {'no grad: eager -> native':>22} {without:11.1f} {with_:9.1f} {r:6.2f}"
                "  (eager without s, native with it)"
            )
        del logits, tokens, train_z
    return first


@contextlib.contextmanager
def _row_pass(name: str):
    """ENTROPYLENS_NATIVE set for the block: "eager" switches the native row pass off."""
    before = os.environ.get("ENTROPYLENS_NATIVE")
    os.environ["ENTROPYLENS_NATIVE"] = "0" if name == "eager" else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ENTROPYLENS_NATIVE")
        else:
            os.environ["ENTROPYLENS_NATIVE"] = before


def head_sensitivity_section(shapes, hidden_size: int, repeats: int) -> float:
    """Section 5b: the same two extra reductions in ``head_stats`` (hidden states through the LM head in
    tiles: the pass of TRL ``attribution=True`` and of ``policy_update(hidden=, head=)``), forward +
    backward (s_t is computed only in a training pass), with and without ``sensitivity``; medians of
    per-pair ratios. Returns the ratio at the first shape."""
    from entropylens.rl.stats import head_stats

    print(
        f"\n5b. the same in head_stats (hidden {hidden_size} -> V through the LM head, fp32, forward + backward), "
        f"medians over {repeats} alternating pairs"
    )
    print(f"{'shape':>16} {'without ms':>11} {'with ms':>9} {'ratio':>6}")
    first = None
    for n, v in shapes:
        g = torch.Generator().manual_seed(0)
        h = (torch.randn(n, hidden_size, generator=g)).requires_grad_(True)
        w = (torch.randn(v, hidden_size, generator=g) * hidden_size**-0.5 * 3).requires_grad_(True)
        tok = torch.randint(0, v, (n,), generator=g)

        def train(sens):
            lp = head_stats(h, w, tok, sensitivity=sens)[0]
            lp.sum().backward()
            h.grad = w.grad = None

        without, with_, r = paired(train, repeats)
        print(f"{str([n, v]):>16} {without:11.1f} {with_:9.1f} {r:6.2f}")
        first = first or r
    return first


def tails_section(n: int, v: int, repeats: int) -> float:
    """Section 6: logits whose shifted values reach below -87.3, where exp's float32 result is no longer
    a normal number: -inf entries (banned tokens, 1% of the vocabulary, scattered) and the far tail of a
    wide distribution (sd 8) at temperature 0.6. torch's CPU exp leaves its vector path there (5-25x
    slower per such element); entropylens floors every vocabulary-wide exp argument at -87 (stats
    module docstring). Each row: the pass on the tail logits against the same pass on logits without
    a tail (randn * 3, same shape and temperature); medians of per-pair ratios. The last row times a
    bare torch.exp of the unfloored shifted logits the same way: what the floor avoids. Returns the
    largest pass ratio."""
    print(
        f"\n6. far tails at {[n, v]} fp32: the pass on logits with a tail / the same pass without one, "
        f"medians over {repeats} alternating pairs"
    )
    print(f"{'logits':>30} {'pass':>12} {'no tail ms':>11} {'tail ms':>8} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    plain = torch.randn(n, v, generator=g) * 3
    tokens = torch.randint(0, v, (n,), generator=g)
    banned = plain.clone()
    banned[:, torch.randperm(v, generator=g)[: v // 100]] = float("-inf")
    wide = torch.randn(n, v, generator=g) * 8
    worst = 0.0
    for label, tail, t in (("1% -inf (banned), T=1", banned, 1.0), ("sd 8, T=0.6", wide, 0.6)):
        shifted = tail / t
        shifted -= shifted.amax(-1, keepdim=True)
        frac = float((shifted < -87.3).float().mean())
        pick = {False: plain, True: tail}
        grad_z = {k: z.clone().requires_grad_(True) for k, z in pick.items()}

        def nograd(k):
            with torch.no_grad():
                logprobs_and_entropy(pick[k], tokens, temperature=t)

        def train(k):
            lp, h = logprobs_and_entropy(grad_z[k], tokens, temperature=t, entropy_grad=True)
            (lp.sum() + h.sum()).backward()
            grad_z[k].grad = None

        base_shifted = plain / t
        base_shifted -= base_shifted.amax(-1, keepdim=True)
        rows = 3 * 2**20 // (4 * v) or 1  # one chunk's rows, as the pass takes them
        raw = {False: base_shifted[:rows].contiguous(), True: shifted[:rows].contiguous()}

        def bare_exp(k):
            for _ in range(8):
                torch.exp(raw[k])

        for name, fn in (("no grad", nograd), ("fwd + bwd", train), ("bare exp", bare_exp)):
            without, with_, r = paired(fn, repeats)
            print(f"{label + f' ({frac:.1%} < -87.3)':>30} {name:>12} {without:11.1f} {with_:8.1f} {r:6.2f}")
            if name != "bare exp":
                worst = max(worst, r)
        del grad_z, shifted, base_shifted
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--child", nargs=5)
    ap.add_argument("--sensitivity-only", action="store_true", help="section 5 only (the attribution's cost)")
    ap.add_argument("--head-hidden", type=int, default=896, help="hidden size for section 5b (896: Qwen2.5-0.5B)")
    ap.add_argument("--tails-only", action="store_true", help="section 6 only (logits with a far tail)")
    a = ap.parse_args()
    if a.child:
        kind, n, v, dtype, grad = a.child
        child(kind, int(n), int(v), dtype, bool(int(grad)))
        return

    shapes = [(512, 4096), (128, 16384)] if a.quick else [(8192, 32000), (2048, 151936)]
    tail_shape = (shapes[1][0] // 4, shapes[1][1])
    if a.tails_only:
        print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
        print(f"tail_ratio={tails_section(*tail_shape, a.repeats):.3f}")
        return
    if a.sensitivity_only:
        print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
        ratio = sensitivity_section(shapes, a.repeats)
        head_shapes = [(n // 8, v) for n, v in shapes]  # the head's matmuls: 8x fewer positions keep it short
        head = head_sensitivity_section(head_shapes, a.head_hidden, a.repeats)
        print(f"head_sensitivity_ratio={head:.3f}")
        print(f"sensitivity_ratio={ratio:.3f}")
        return
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, TRL functions {TRL_SOURCE}")
    # Memory first, from children forked while this process is still small (Linux keeps the
    # parent's RSS high-water mark in a forked child, so a big parent would hide the child's peak).
    mem = {(n, v, d, k): measure_memory(k, n, v, d, False) for n, v in shapes for d in DTYPES for k in ("trl", "ours")}
    n0, v0 = shapes[0]
    gb_plain = measure_memory("plain", n0, v0, "fp32", True)
    gb_ours_grad = measure_memory("ours", n0, v0, "fp32", True)

    print("\n1. no grad (old-policy pass): medians over", a.repeats, "alternating runs")
    print(f"{'shape':>16} {'dtype':>5} {'trl ms':>9} {'ours ms':>9} {'ratio':>6} {'trl +GB':>8} {'ours +GB':>9}")
    headline = None
    with torch.no_grad():
        for n, v in shapes:
            for dname, dtype in DTYPES.items():
                logits, tokens = make(n, v, dtype)
                ours(logits, tokens), trl_two_passes(logits, tokens)  # warm-up
                t_trl, t_ours = [], []
                for _ in range(a.repeats):  # alternate so drift hits both equally
                    t_trl.append(median_ms(trl_two_passes, (logits, tokens), 1))
                    t_ours.append(median_ms(ours, (logits, tokens), 1))
                mt, mo = statistics.median(t_trl), statistics.median(t_ours)
                gb_trl, gb_ours = mem[(n, v, dname, "trl")], mem[(n, v, dname, "ours")]
                print(f"{str([n, v]):>16} {dname:>5} {mt:9.1f} {mo:9.1f} {mo / mt:6.2f} {gb_trl:8.3f} {gb_ours:9.3f}")
                if headline is None and dname == "fp32":
                    headline = (mo / mt, gb_ours)
                del logits, tokens

    print(f"\n2. with grad (training pass) at {[n0, v0]} fp32: peak memory beyond the [N, V] gradient")
    print(f"   log_softmax + gather: +{gb_plain:.3f} GB    ours: +{gb_ours_grad:.3f} GB")

    print("\n3. float64 error, V = 151936, 16 positions")
    print(f"{'offset':>7} {'max |dlogp|':>12} {'max |dH|':>10}")
    g = torch.Generator().manual_seed(0)
    for off in (0.0, 10.0, 20.0, 40.0):
        logits = torch.randn(16, 151936, generator=g) * 3 + off
        tokens = torch.randint(0, 151936, (16,), generator=g)
        lp, h = ours(logits, tokens)
        z = logits.double()
        la = torch.log_softmax(z, -1)
        rlp = la.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        rh = -(la.exp() * la).sum(-1)
        print(f"{off:7.0f} {(lp.double() - rlp).abs().max().item():12.2e} {(h.double() - rh).abs().max().item():10.2e}")

    print(f"\n4. does torch.compile help? the chunk body compiled (inductor), no grad, {[n0, v0]} fp32")
    try:
        c_ms, o_ms, first_s = compiled_vs_ours(n0, v0, a.repeats)
        print(
            f"   ours {o_ms:.1f} ms; compiled chunk loop {c_ms:.1f} ms (x{c_ms / o_ms:.2f}); first call {first_s:.1f} s"
        )
    except Exception as e:  # no compiler toolchain: say so
        print(f"   torch.compile unavailable here: {type(e).__name__}: {str(e).splitlines()[0][:120]}")

    sens_ratio = sensitivity_section(shapes, a.repeats)
    head = head_sensitivity_section([(n // 8, v) for n, v in shapes], a.head_hidden, a.repeats)
    tail = tails_section(*tail_shape, a.repeats)
    print(f"tail_ratio={tail:.3f}")
    print(f"head_sensitivity_ratio={head:.3f}")
    print(f"sensitivity_ratio={sens_ratio:.3f}")
    print(f"ratio_vs_trl={headline[0]:.3f} extra_gb={headline[1]:.3f}")


if __name__ == "__main__":
    main()
