"""OpenRLHF 0.11.2 drop-in (entropylens.integrations.openrlhf): OpenRLHF's own PolicyLoss is the reference.

OpenRLHF is installed ``pip install --no-deps openrlhf==0.11.2`` (the [test] install does it, docs/development.md);
its loss module is loaded without deepspeed (openrlhf_load). Where the package cannot be had, these tests skip."""

import itertools

import numpy as np
import pytest
import torch

try:
    from entropylens.integrations import openrlhf as el_openrlhf
    from entropylens.integrations.openrlhf_load import load_loss_module, openrlhf_version
except ImportError as err:  # the package is absent
    pytest.skip(f"OpenRLHF cannot be had here: {err}", allow_module_level=True)
if not (openrlhf_version() or "").startswith("0.11."):
    pytest.skip(f"these tests pin OpenRLHF 0.11.2's loss (installed: {openrlhf_version()})", allow_module_level=True)

from entropylens.read.query import connect
from entropylens.record.recorder import Recorder
from entropylens.rl.losses import policy_loss

REF = load_loss_module().PolicyLoss

# (is_correction_level, mode, gating, threshold): every IS correction 0.11.2 accepts
IS_VARIANTS = [
    ("off", "mask", "ratio", (0.5, 5.0)),
    ("token", "clip", "ratio", (0.5, 2.0)),  # TIS: the token IS weight clamped
    ("token", "mask", "ratio", (0.5, 2.0)),  # ICEPOP: tokens outside the band dropped
    ("seq", "mask", "ratio", (0.5, 2.0)),  # seq-mask-tis: sequences dropped by the geometric-mean ratio
    ("token", "mask", "binary_kl", (0.0, 0.05)),
    ("seq", "mask", "binary_kl", (0.0, 0.05)),
    ("token", "mask", "tv", (0.0, 0.2)),
    ("seq", "mask", "tv", (0.0, 0.2)),
]
CONFIGS = [
    dict(
        policy_loss_type=t,
        dual_clip=d,
        token_level_loss=tl,
        is_correction_level=lv,
        is_correction_mode=mo,
        is_correction_gating=ga,
        is_correction_threshold=th,
    )
    for t, d, tl, (lv, mo, ga, th) in itertools.product(("ppo", "gspo"), (None, 3.0), (True, False), IS_VARIANTS)
]


def _batch(seed, b=6, t=9, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    old = torch.log(torch.rand(b, t, generator=g, dtype=dtype) * 0.9 + 0.05)  # [B, T] old policy's log-probs
    lp = old + 0.4 * torch.randn(b, t, generator=g, dtype=dtype)  # ratios well outside [0.8, 1.2] for some
    lp = torch.minimum(lp, torch.zeros((), dtype=dtype))
    rollout = old + 0.2 * torch.randn(b, t, generator=g, dtype=dtype)
    rollout = torch.minimum(rollout, torch.zeros((), dtype=dtype))
    adv = torch.randn(b, 1, generator=g, dtype=dtype).expand(b, t).contiguous()  # [B, T] as OpenRLHF hands them
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[0] = False  # a fully masked sequence (sample-level mode leaves it out)
    return lp, old, rollout, adv, mask


def _run(loss_fn, lp, old, rollout, adv, mask, **kw):
    x = lp.clone().requires_grad_(True)
    out = loss_fn(x, old, adv, action_mask=mask, rollout_log_probs=rollout, **kw)
    out[0].backward()
    return out, x.grad


def _rel(a, b):
    if a is None and b is None:
        return 0.0
    a, b = (torch.as_tensor(x.detach() if isinstance(x, torch.Tensor) else x, dtype=torch.float64) for x in (a, b))
    return float(((a - b).abs() / b.abs().clamp(min=1e-12)).max()) if a.numel() else 0.0


def test_same_loss_gradient_and_metrics_as_openrlhf_with_the_hook_on(tmp_path):
    rec = Recorder(tmp_path, run="openrlhf")
    worst = {}
    for i, cfg in enumerate(CONFIGS):
        lp, old, rollout, adv, mask = _batch(i)
        extra = dict(dp_size=2, batch_num_tokens=40.0, global_batch_size=8.0) if i % 3 == 0 else {}
        ref_out, ref_grad = _run(REF(0.2, 0.28, **cfg), lp, old, rollout, adv, mask, **extra)
        ours = el_openrlhf.PolicyLoss(0.2, 0.28, **cfg, recorder=rec, on_error="raise")
        ours.step = i
        out, grad = _run(ours, lp, old, rollout, adv, mask, **extra)
        name = ", ".join(f"{k}={v}" for k, v in cfg.items())
        rel = max(
            _rel(out[0], ref_out[0]),
            _rel(grad, ref_grad),
            _rel(out[1], ref_out[1]),
            *(_rel(a, b) for a, b in zip(out[2:], ref_out[2:])),
        )
        worst[name] = rel
        assert rel <= 1e-6, name
        # bit for bit, in fact: the hook is a tensor hook that returns None
        assert torch.equal(out[0], ref_out[0]) and torch.equal(grad, ref_grad), name
    rec.close()
    t = connect(rec.dir).execute("SELECT step, grad_coef, clipped, ratio FROM tokens ORDER BY step, seq, pos").df()
    for i, cfg in enumerate(CONFIGS):
        lp, old, rollout, adv, mask = _batch(i)
        extra = dict(dp_size=2, batch_num_tokens=40.0, global_batch_size=8.0) if i % 3 == 0 else {}
        _, ref_grad = _run(REF(0.2, 0.28, **cfg), lp, old, rollout, adv, mask, **extra)
        rows = t[t.step == i]
        assert len(rows) == int(mask.sum())
        # grad_coef is OpenRLHF's own d loss / d log pi (stored float32)
        np.testing.assert_allclose(rows["grad_coef"].to_numpy(), ref_grad[mask].numpy(), rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(rows["ratio"].to_numpy(), (lp - old).exp()[mask].numpy(), rtol=1e-6)
    print("max relative difference per configuration:", max(worst.values()))


def test_clipped_column_is_openrlhfs_clip_ratio_for_ppo_and_gspo(tmp_path):
    rec = Recorder(tmp_path, run="clip")
    for i, kind in enumerate(("ppo", "gspo")):
        lp, old, rollout, adv, mask = _batch(100 + i)
        loss = el_openrlhf.PolicyLoss(0.2, 0.28, policy_loss_type=kind, recorder=rec, on_error="raise")
        loss.step = i
        out, _ = _run(loss, lp, old, rollout, adv, mask)
        loss.hook.flush()
    rec.close()
    t = connect(rec.dir).execute("SELECT step, avg(clipped::INT) AS c FROM tokens GROUP BY step ORDER BY step").df()
    for i, kind in enumerate(("ppo", "gspo")):
        lp, old, rollout, adv, mask = _batch(100 + i)
        ref = REF(0.2, 0.28, policy_loss_type=kind)(lp, old, adv, action_mask=mask, rollout_log_probs=rollout)
        # OpenRLHF's clip_ratio = masked mean of lt(surr2, surr1), float32
        assert t.c[i] == pytest.approx(float(ref[1]), rel=1e-6), kind


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_entropylens_types_run_with_openrlhfs_aggregation(token_level_loss):
    lp, old, rollout, adv, mask = _batch(7)
    h = torch.rand(lp.shape, dtype=lp.dtype) + 0.5
    h_old = h * (1 + 0.3 * torch.randn(lp.shape, dtype=lp.dtype).clamp(-1, 1))
    agg = "token-mean" if token_level_loss else "seq-mean-token-mean"
    ref_ppo = REF(0.2, 0.28, token_level_loss=token_level_loss)(lp, old, adv, action_mask=mask)
    for kind, kw in (("gppo", {}), ("ce_gppo", dict(beta1=0.5, beta2=1.0)), ("erc", {})):
        loss = el_openrlhf.PolicyLoss(0.2, 0.28, token_level_loss=token_level_loss, policy_loss_type=kind, **kw)
        if kind == "erc":
            loss.entropy, loss.old_entropy = h, h_old
        out, grad = _run(loss, lp, old, None, adv, mask)
        method = "grpo" if kind == "erc" else kind
        extra = dict(erc=(0.8, 1.2), entropy=h, old_entropy=h_old) if kind == "erc" else kw
        x = lp.clone().requires_grad_(True)
        want = policy_loss(x, old, adv, mask, method=method, eps_low=0.2, eps_high=0.28, agg=agg, **extra)
        want.loss.backward()
        # OpenRLHF's sample mode divides by L_i + 1e-8 (relative 1e-8 / L_i from entropylens' 1 / L_i), and
        # entropylens' own agg weights are float32
        assert _rel(out[0], want.loss) <= 1e-6 and _rel(grad[mask], x.grad[mask]) <= 1e-6, kind
        # GPPO's and ERC's forward value is PPO-clip's (they change the gradient only; CE-GPPO's value is its
        # slope, losses.py), and OpenRLHF's metrics (clip_ratio, ppo_kl) are its own for every type
        assert kind == "ce_gppo" or _rel(out[0], ref_ppo[0]) <= 1e-6, kind
        assert torch.equal(out[1], ref_ppo[1]) and torch.equal(out[2], ref_ppo[2]), kind
    with pytest.raises(ValueError, match="IS correction applies to ppo and gspo only"):
        el_openrlhf.PolicyLoss(policy_loss_type="gppo", is_correction_level="token")
    with pytest.raises(ValueError, match="needs the entropy and the old policy's entropy"):
        _run(el_openrlhf.PolicyLoss(policy_loss_type="erc"), lp, old, None, adv, mask)


def test_patch_actor_hands_step_update_and_entropy():
    """The wiring only, on a stand-in with ActorPPOTrainer's call shape (the real one needs deepspeed and ray)."""
    lp, old, rollout, adv, mask = _batch(9)
    seen = []

    class Actor(torch.nn.Module):
        def forward(self, sequences, action_mask, **kw):
            return lp.clone().requires_grad_(True), {"entropy": torch.ones(lp.shape[0], lp.shape[1] + 3)}

    class Trainer:
        def __init__(self):
            self.actor, self.actor_loss_fn = Actor(), el_openrlhf.PolicyLoss()

        def ppo_train(self, kl_ctl=0.0):
            for _ in range(2):
                x, output = self.actor(None, mask)
                seen.append(
                    (self.actor_loss_fn.step, self.actor_loss_fn.update, tuple(self.actor_loss_fn.entropy.shape))
                )
                self.actor_loss_fn(x, old, adv, action_mask=mask)

    tr = Trainer()
    el_openrlhf.patch_actor(tr)
    tr.ppo_train()
    tr.ppo_train()
    assert seen == [(0, 0, lp.shape), (0, 1, lp.shape), (1, 0, lp.shape), (1, 1, lp.shape)]


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_dual_clip_columns_against_openrlhfs_definitions(tmp_path, kind):
    """With dual clip acting on several tokens: OpenRLHF's clip_ratio counts lt(surr2, surr1) only, the tokens
    its dual clip caps (A < 0, c A > min(surr1, surr2): loss -c A, no gradient) are recorded in dual_clipped,
    and the hook's clipped is clip_ratio's indicator alone (the schema keeps the two apart): avg(clipped) = clip_ratio."""
    c = 3.0
    lp, old, rollout, adv, mask = _batch(21, b=8, t=10)
    sign = torch.tensor([1.0, -1.0] * 4, dtype=lp.dtype).unsqueeze(1)
    adv = (adv.abs() + 0.1) * sign  # [B, T]: sequences +, -, +, -, ...
    old, lp = old.clone(), lp.clone()
    old[1::2, :3], lp[1::2, :3], mask[1::2, :3] = np.log(0.1), np.log(0.5), True  # token ratio 5 > c, A < 0
    old[3], lp[3], mask[3] = np.log(0.2), np.log(0.8), True  # sequence 3 whole at ratio 4 (GSPO's too)
    old[4], lp[4], mask[4] = np.log(0.3), np.log(0.6), True  # ratio 2, A > 0: PPO-clipped high
    rec = Recorder(tmp_path, run="dual")
    ours = el_openrlhf.PolicyLoss(0.2, 0.28, dual_clip=c, policy_loss_type=kind, recorder=rec, on_error="raise")
    out, grad = _run(ours, lp, old, rollout, adv, mask)
    rec.close()
    ref_loss = REF(0.2, 0.28, dual_clip=c, policy_loss_type=kind)
    ref_out, ref_grad = _run(ref_loss, lp, old, rollout, adv, mask)
    assert torch.equal(out[0], ref_out[0]) and torch.equal(grad, ref_grad) and torch.equal(out[1], ref_out[1])
    # OpenRLHF's own definitions, from its forward: the ratio it clips, surr1 / surr2, dual clip's clip2
    log_r = lp - old
    if kind == "gspo":  # the sequence's exp(mean_t log r), broadcast
        log_r = ((log_r * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)).expand_as(lp)
    ratio = log_r.clamp(-20.0, 20.0).exp()
    surr1, surr2 = ratio * adv, ratio.clamp(0.8, 1.28) * adv
    ppo_clipped = surr2 < surr1  # clip_ratio's indicator
    dual = (adv < 0) & (c * adv > torch.min(surr1, surr2))  # where max(clip1, c A) takes c A
    assert int(dual[mask].sum()) >= 10 and (ref_grad[dual & mask] == 0).all()
    assert float(ref_out[1]) == pytest.approx(float(ppo_clipped[mask].double().mean()), rel=1e-6)
    t = connect(rec.dir).execute("SELECT clipped, dual_clipped, clip FROM tokens ORDER BY seq, pos").df()
    clipped, dual_clipped = t["clipped"].to_numpy().astype(bool), t["dual_clipped"].to_numpy().astype(bool)
    assert len(t) == int(mask.sum())
    assert (dual_clipped == dual[mask].numpy()).all()
    assert (clipped == ppo_clipped[mask].numpy()).all() and not (clipped & dual_clipped).any()
    assert clipped.mean() == pytest.approx(float(ref_out[1]), rel=1e-6)  # avg(clipped) is OpenRLHF's clip_ratio
    assert (t["clip"].to_numpy()[dual_clipped] == 1).all()  # the dual-clipped sit in the high region
    print(
        f"{kind}: clip_ratio {float(ref_out[1]):.6f}, avg(clipped) {clipped.mean():.6f}, "
        f"avg(dual_clipped) {dual_clipped.mean():.6f} ({dual_clipped.sum()} of {len(t)} tokens)"
    )
