"""The 80/20 forking-token mask and the adaptive entropy coefficient (entropylens.rl.forking): equal to TRL
1.16's own code, in the plain loop with gradients region by region against float64 autograd, recorded."""

import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from entropylens.rl.forking import AdaptiveEntropyCoef, bonus_weights, gather_valid, top_entropy_mask

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def _trl_mask(h, m, q):
    """TRL's own GRPOTrainer.get_high_entropy_mask (a real single-process Accelerator pads and gathers)."""
    from accelerate import Accelerator
    from trl import GRPOTrainer

    return GRPOTrainer.get_high_entropy_mask(SimpleNamespace(accelerator=Accelerator(cpu=True)), h, m, 1 - q)


def test_mask_hand_worked():
    # valid entropies 0.1, 0.5, 0.5, 0.9, 0.3 (the 7.0 is padding); q = 0.5: torch.quantile(., 0.5) of the
    # sorted [0.1, 0.3, 0.5, 0.5, 0.9] is 0.5 -> the two tied 0.5s and the 0.9 are kept (ties kept: >=)
    h = torch.tensor([[0.1, 0.5, 0.5], [0.9, 0.3, 7.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    keep = top_entropy_mask(h, m, 0.5)
    assert keep.tolist() == [[False, True, True], [True, False, False]]
    # q = 0.2: quantile 0.8 = 0.5 + 0.2 * (0.9 - 0.5) = 0.58 (position 0.8 * 4 = 3.2) -> only the 0.9
    assert top_entropy_mask(h, m, 0.2).tolist() == [[False, False, False], [True, False, False]]
    assert not top_entropy_mask(h, torch.zeros_like(m), 0.2).any()  # no valid token: none kept
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        top_entropy_mask(h, m, 1.5)


@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_mask_equals_trls_get_high_entropy_mask(q):
    g = torch.Generator().manual_seed(3)
    h = torch.rand(6, 9, generator=g) * 3
    h[1, :4] = h[0, 2]  # ties, at and around the threshold
    h[2] = torch.round(h[2] * 2) / 2
    m = torch.rand(6, 9, generator=g) > 0.3
    m[5] = False  # a fully padded row
    ours, theirs = top_entropy_mask(h, m, q), _trl_mask(h, m, q)
    assert torch.equal(ours, theirs)
    assert ours.sum() >= 1
    h16 = h.to(torch.bfloat16)  # bf16 entropies: TRL compares h * mask.float() with a float32 quantile
    assert torch.equal(top_entropy_mask(h16, m, q), _trl_mask(h16, m, q))
    assert torch.equal(top_entropy_mask(h, torch.zeros_like(m), q), _trl_mask(h, torch.zeros_like(m), q))


@pytest.mark.slow
def test_mask_over_two_gloo_processes_equals_trls(tmp_path):
    # two ranks with different numbers of valid tokens: TRL pads across processes and gathers; ours
    # gathers the valid entropies (gather_valid); the threshold is global: each rank's mask equals TRL's,
    # and differs from the rank-local quantile's
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(HELPERS / "forking_two_ranks.py"),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    for rank in (0, 1):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(res["ours"], res["trl"]), rank
        assert res["ctrl"] == pytest.approx(res["ctrl_expected"], abs=0, rel=1e-6)
    assert any(
        not torch.equal(torch.load(tmp_path / f"rank{r}.pt")["local"], torch.load(tmp_path / f"rank{r}.pt")["ours"])
        for r in (0, 1)
    )


def test_gather_valid_without_process_group_is_identity():
    t = torch.tensor([1.0, 2.0])
    assert gather_valid(t) is t


def test_adaptive_coef_hand_worked():
    # target 0.5, delta 0.1, clamps [0.05, 0.25], start 0.2
    c = AdaptiveEntropyCoef(0.5, coef=0.2, delta=0.1, coef_min=0.05, coef_max=0.25)
    assert c.applied == 0.0  # no previous step: last entropy inf > target -> gate shut
    m = torch.ones(1, 4)
    # step 1: two micro-batches, (0.2 + 0.4 + 0.6 + 0.8) + (0.1 * 2) over 6 tokens = 2.2 / 6 = 0.3667 <= 0.5
    c.observe(torch.tensor([[0.2, 0.4, 0.6, 0.8]]), m)
    c.observe(torch.tensor([[0.1, 0.1, 9.0, 9.0]]), torch.tensor([[1.0, 1.0, 0.0, 0.0]]))
    assert c.step() == pytest.approx(2.2 / 6)
    assert c.coef == pytest.approx(0.25)  # min(0.2 + 0.1, 0.25): the upper clamp
    assert c.applied == pytest.approx(0.25)  # gate open: 0.3667 <= 0.5
    # step 2: mean 0.9 > 0.5 -> 0.25 - 0.1 = 0.15, gate shut
    c.observe(torch.full((1, 4), 0.9), m)
    assert c.step() == pytest.approx(0.9) and c.coef == pytest.approx(0.15) and c.applied == 0.0
    # step 3: 0.9 again -> max(0.05, 0.05) = 0.05; step 4: max(-0.05, 0.05) = 0.05 (the lower clamp)
    for _ in range(2):
        c.observe(torch.full((1, 4), 0.9), m)
        c.step()
    assert c.coef == pytest.approx(0.05)
    state = c.state_dict()
    d = AdaptiveEntropyCoef(0.5, coef=0.2, delta=0.1, coef_min=0.05, coef_max=0.25)
    d.load_state_dict(state)
    assert (d.coef, d.last_entropy, d.applied) == (c.coef, c.last_entropy, 0.0)
    assert math.isnan(d.step())  # no window: nothing moves
    assert d.coef == c.coef


def _batch(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t, v = 3, 6, 7
    logits = (torch.randn(b, t, v, generator=g) * 1.5).to(dtype)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 5:] = False
    adv = torch.tensor([1.0, -0.5, 0.8], dtype=dtype)
    lp0 = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1).detach()
    old = lp0 + (torch.randn(b, t, generator=g) * 0.15).to(dtype)
    return logits, tokens, mask, adv, old


def _reference_loss(logits, tokens, mask, adv, old, keep, coef, scale):
    """float64 by hand: token-mean of -A r over ALL valid tokens, P = keep; minus coef * mean_kept(H) * scale.
    (old is 0.15-noised: some ratios leave [0.8, 1.2], the PPO clip is applied as max(-A r, -A clip(r))."""
    lp_all = torch.log_softmax(logits, -1)
    lp = lp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    h = -(lp_all.exp() * lp_all).sum(-1)
    r = torch.exp(lp - old)
    a = adv.unsqueeze(1)
    pg = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
    m = mask.double()
    pol = (pg * m * keep.double()).sum() / m.sum()
    e = m * keep.double()
    return scale * pol - coef * scale * (h * e).sum() / e.sum()


def test_plain_loop_forking_and_bonus_gradient_by_region():
    from entropylens.integrations.torch import policy_update

    logits, tokens, mask, adv, old = _batch()
    z = logits.clone().requires_grad_(True)
    out = policy_update(
        None,
        0,
        0,
        z,
        tokens,
        mask,
        adv,
        old,
        method="grpo",
        agg="token-mean",
        top_entropy_quantile=0.2,
        entropy_coef=0.1,
        scale=0.5,
    )
    out.loss.backward()
    keep = out.columns["token_kept"]
    with torch.no_grad():
        h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.equal(keep, _trl_mask(h, mask, 0.2))
    assert 0 < keep.sum() < mask.sum()
    z2 = logits.clone().requires_grad_(True)
    ref = _reference_loss(z2, tokens, mask, adv, old, keep, 0.1, 0.5)
    ref.backward()
    # logprobs_and_entropy works in float32 (its chunked pass): float32 agreement with the float64 reference
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-6)
    for name, region in (("kept", keep), ("dropped", mask & ~keep), ("padding", ~mask)):
        a, b = z.grad[region], z2.grad[region]
        assert region.any(), name
        assert ((a - b).abs().max() / z2.grad.abs().max()).item() < 1e-5, name
    # in float64 throughout (policy_loss on float64 log-probs and entropies with the same mask and bonus
    # weights): equal to the reference to 1e-12, region by region
    from entropylens.rl.losses import policy_loss

    z3 = logits.clone().requires_grad_(True)
    lp_all = torch.log_softmax(z3, -1)
    lp = lp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    h64 = -(lp_all.exp() * lp_all).sum(-1)
    keep64 = top_entropy_mask(h64, mask, 0.2)
    assert torch.equal(keep64, keep)
    out64 = policy_loss(
        lp,
        old,
        adv,
        mask,
        method="grpo",
        agg="token-mean",
        entropy=h64,
        token_mask=keep64,
        entropy_coef=0.1,
        scale=0.5,
        entropy_weights=bonus_weights(mask, keep64, 0.5, torch.float64),
    )
    out64.loss.backward()
    assert out64.loss.item() == pytest.approx(ref.item(), rel=1e-12)
    for name, region in (("kept", keep), ("dropped", mask & ~keep), ("padding", ~mask)):
        assert ((z3.grad[region] - z2.grad[region]).abs().max() / z2.grad.abs().max()).item() < 1e-12, name
    assert z.grad[~mask].abs().max() == 0  # padding gets no gradient
    # dropped tokens get no policy gradient and no bonus: their logits' gradient is 0
    assert z.grad[mask & ~keep].abs().max() == 0


def test_plain_loop_adaptive_coef_gates_and_steps():
    from entropylens.integrations.torch import policy_update

    logits, tokens, mask, adv, old = _batch()
    ctrl = AdaptiveEntropyCoef(target=10.0, coef=0.05, delta=0.02, coef_max=0.08)
    seen = []
    for step in range(3):
        z = logits.clone().requires_grad_(True)
        out = policy_update(
            None,
            step,
            0,
            z,
            tokens,
            mask,
            adv,
            old,
            method="grpo",
            agg="token-mean",
            top_entropy_quantile=0.5,
            entropy_coef=ctrl,
        )
        seen.append((out.config["entropy_coef"], out.config["entropy_coef_adaptive"]))
        out.loss.backward()
        ctrl.step()
    # the entropy ~1.5 nats <= 10: step 0 gate shut (no previous step), then 0.07, then min(0.09, 0.08)
    assert seen == [(0.0, 0.05), (pytest.approx(0.07), pytest.approx(0.07)), (0.08, 0.08)]
    # with the gate open the loss is the static bonus's at the same coefficient
    ctrl2 = AdaptiveEntropyCoef(target=10.0, coef=0.08)
    ctrl2.last_entropy = 1.0
    a = policy_update(
        None, 0, 0, logits, tokens, mask, adv, old, method="grpo", top_entropy_quantile=0.5, entropy_coef=ctrl2
    )
    b = policy_update(
        None, 0, 0, logits, tokens, mask, adv, old, method="grpo", top_entropy_quantile=0.5, entropy_coef=0.08
    )
    assert a.loss.item() == b.loss.item()


def test_bonus_weights_mean_over_kept():
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    k = torch.tensor([[True, False, True], [True, True, False]])
    # kept valid tokens: (0,0), (1,0), (1,1) -> 3; weight scale / 3 each
    w = bonus_weights(m, k, scale=0.5)
    assert w.flatten().tolist() == pytest.approx([0.5 / 3, 0, 0, 0.5 / 3, 0.5 / 3, 0])


def test_plain_loop_records_forking_and_adaptive(tmp_path):
    from entropylens import Recorder
    from entropylens.integrations.torch import old_policy_pass, policy_update
    from entropylens.read.query import connect

    logits, tokens, mask, adv, old = _batch(torch.float32)
    old_lp, old_h = old_policy_pass(logits, tokens)
    ctrl = AdaptiveEntropyCoef(target=10.0, coef=0.05, delta=0.02)
    with Recorder(str(tmp_path), run="r", config={"method": "grpo"}) as rec:
        for step in range(2):
            z = logits.clone().requires_grad_(True)
            out = policy_update(
                rec,
                step,
                0,
                z,
                tokens,
                mask,
                adv,
                old.float(),
                old_entropy=old_h,
                method="grpo",
                top_entropy_quantile=0.2,
                entropy_coef=ctrl,
            )
            out.loss.backward()
            ctrl.step()
            rec.record_step(step)
    con = connect(tmp_path / "r")
    rows = con.execute(
        "SELECT step, entropy_coef, entropy_coef_adaptive, token_masked_frac FROM steps ORDER BY step"
    ).fetchall()
    assert [r[1] for r in rows] == pytest.approx([0.0, 0.07])
    assert [r[2] for r in rows] == pytest.approx([0.05, 0.07])
    n_valid = int(mask.sum())
    kept = con.execute("SELECT step, sum(token_kept::int), count(*) FROM tokens GROUP BY step ORDER BY step").fetchall()
    for (_step, k, n), row in zip(kept, rows):
        assert n == n_valid and 0 < k < n
        assert row[3] == pytest.approx(1 - k / n)


@pytest.mark.parametrize("loss,target", [(None, 3.0), (None, 3.25), ("dapo", 3.25)])
def test_trl_adaptive_coef_sequence_equals_trls_own(tmp_path, loss, target):
    # TRL's own controller (loss=None: TRL's _compute_loss moves its entropy_coef) against ours replayed on
    # the recorded entropies of the kept tokens (the bonus's tokens with top_entropy_quantile 0.5), window =
    # the optimizer step's two micro-batches. The tiny model's kept-token entropy is ~3.21 nats: target 3.0
    # walks the coefficient down to its 0 clamp, 3.25 up to the 0.045 clamp (gate open from step 1)
    sys.path.insert(0, str(HELPERS))
    import trl_tiny

    from entropylens.read.query import connect

    tr = trl_tiny.trainer(
        tmp_path,
        "r",
        max_steps=3,
        use_adaptive_entropy=True,
        entropy_coef=0.02,
        entropy_coef_delta=0.01,
        entropy_coef_max=0.045,
        entropy_target=target,
        top_entropy_quantile=0.5,
        el=dict(loss=loss) if loss else None,
    )
    tr.train()
    logged = [h["entropy_coef"] for h in tr.state.log_history if "loss" in h and "entropy_coef" in h]
    con = connect(tmp_path / "r")
    steps = con.execute(
        "SELECT step, min(entropy_coef), max(entropy_coef), min(entropy_coef_adaptive), "
        "max(entropy_coef_adaptive), count(*) FROM steps GROUP BY step ORDER BY step"
    ).fetchall()
    ent = con.execute(
        "SELECT step, update, list(entropy), list(token_kept) FROM tokens GROUP BY step, update ORDER BY step, update"
    ).fetchall()
    ctrl = AdaptiveEntropyCoef(target, coef=0.02, delta=0.01, coef_max=0.045)
    ours, applied, before = [], [], []
    for _step, update, h, kept in ent:  # each micro-batch's recorded entropies and forking mask
        if update == 0:
            applied.append(ctrl.applied)
            before.append(ctrl.coef)
        ctrl.observe(torch.tensor(h), torch.tensor(kept, dtype=torch.float32))
        if update == 1:  # the optimizer step's last micro-batch
            ctrl.step()
            ours.append(ctrl.coef)
    expected = [0.01, 0.0, 0.0] if target == 3.0 else [0.03, 0.04, 0.045]
    assert ours == pytest.approx(expected) and logged == pytest.approx(ours, abs=1e-12)
    assert len(steps) == 3 and all(s[5] == 2 for s in steps)  # two micro-batches a step, one coefficient each
    assert [s[1] for s in steps] == pytest.approx(applied, abs=1e-7) and [s[2] for s in steps] == [s[1] for s in steps]
    assert [s[3] for s in steps] == pytest.approx(before, abs=1e-7) and [s[4] for s in steps] == [s[3] for s in steps]
    assert 0.4 < con.execute("SELECT avg(token_masked_frac) FROM steps").fetchone()[0] < 0.6


def test_plain_loop_equals_trls_own_loss_and_grad_on_one_batch(tmp_path):
    # TRL's own GRPOTrainer._compute_loss (bnpo, top_entropy_quantile 0.2, entropy_coef 0.05, GA 2) on its
    # first training micro-batch against policy_update on the same model and inputs: TRL's bnpo weights
    # (sum m l / max(sum m, 1), trl_loss_weights with ga 1) and scale 1 / GA; the bonus as TRL's mean over
    # the kept tokens / GA (policy_update's rule with the forking mask). Same loss, same parameter grads.
    sys.path.insert(0, str(HELPERS))
    import trl_tiny
    from trl import GRPOTrainer

    from entropylens.integrations.torch import policy_update
    from entropylens.integrations.trl_loss import trl_loss_weights

    seen = {}

    class Probe(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            if not self.model.training or seen:
                return super()._compute_loss(model, inputs)
            params = [p for p in model.parameters() if p.requires_grad]
            theirs = super()._compute_loss(model, inputs)
            g_theirs = torch.autograd.grad(theirs, params, retain_graph=True)
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            k = inputs["completion_ids"].size(1)
            logits = model(input_ids=ids, attention_mask=attn).logits[:, -k - 1 : -1] / self.temperature
            mask = inputs["completion_mask"].bool()
            ga = self.current_gradient_accumulation_steps
            lp = (
                torch.log_softmax(logits.detach().float(), -1)
                .gather(-1, inputs["completion_ids"].unsqueeze(-1))
                .squeeze(-1)
            )
            out = policy_update(
                None,
                0,
                0,
                logits,
                inputs["completion_ids"],
                mask,
                inputs["advantages"],
                lp,
                method="grpo",
                eps_low=0.2,
                eps_high=0.2,
                top_entropy_quantile=0.2,
                entropy_coef=0.05,
                scale=1.0 / ga,
                weights=trl_loss_weights("bnpo", mask, ga=1),
            )
            g_ours = torch.autograd.grad(out.loss, params)
            seen["loss"] = (out.loss.item(), theirs.item())
            seen["rel"] = max(
                ((a - b).norm() / b.norm().clamp(min=1e-30)).item() for a, b in zip(g_ours, g_theirs) if b.norm() > 0
            )
            seen["kept"] = out.columns["token_kept"].sum().item() / mask.sum().item()
            return theirs

    from datasets import Dataset  # TRL's own GRPOTrainer (no entropylens trainer): trl_tiny's pieces

    tok = trl_tiny.trl_grpo.build_tokenizer()
    tr = Probe(
        model=trl_tiny.trl_grpo.build_model(tok, 0),
        reward_funcs=trl_tiny.trl_grpo.digit_reward,
        args=trl_tiny.config(tmp_path, max_steps=1, loss_type="bnpo", top_entropy_quantile=0.2, entropy_coef=0.05),
        train_dataset=Dataset.from_dict({"prompt": trl_tiny.prompts()}),
        processing_class=tok,
    )
    tr.train()
    ours, theirs = seen["loss"]
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-7)
    assert seen["rel"] < 1e-4, seen["rel"]
    assert 0.1 < seen["kept"] < 0.4
    print("plain loop vs TRL: loss", ours, theirs, "max rel grad diff", seen["rel"])
