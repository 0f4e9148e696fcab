"""The loss-level hook (entropylens.integrations.loss_hook): it changes nothing the trainer computes, it
records the columns policy_update records on the same batch, and bad input is named by the trainer's name."""

import warnings

import numpy as np
import pytest
import torch

from entropylens.integrations.loss_hook import LossHook, clip_columns
from entropylens.integrations.torch import policy_update
from entropylens.read.query import connect
from entropylens.record.recorder import Recorder
from entropylens.rl.losses import policy_loss
from entropylens.rl.stats import logprobs_and_entropy


def _batch(seed=0, b=4, t=6, v=11, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g, dtype=dtype)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    adv = torch.randn(b, generator=g, dtype=dtype)
    old_logits = logits + 0.3 * torch.randn(b, t, v, generator=g, dtype=dtype)
    old_lp, old_h = logprobs_and_entropy(old_logits, tokens)
    return logits, tokens, mask, adv, old_lp, old_h


def _tokens(run_dir):
    return connect(run_dir).execute("SELECT * FROM tokens ORDER BY seq, pos").df()


def _openrlhf_like_loss(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs=None):
    """A trainer's own PPO-clip loss (token mean), written as trainers write it."""
    ratio = (log_probs - old_log_probs).exp()
    surr1, surr2 = ratio * advantages, ratio.clamp(0.8, 1.2) * advantages
    loss = -torch.min(surr1, surr2)
    return (loss * action_mask).sum() / action_mask.sum()


def test_hook_changes_nothing_bit_for_bit(tmp_path):
    logits, tokens, mask, adv, old_lp, _ = _batch()
    a = adv.unsqueeze(1).expand(mask.shape)
    grads, losses = [], []
    for hooked in (False, True):
        z = logits.clone().requires_grad_(True)
        lp, _ = logprobs_and_entropy(z, tokens)
        fn = _openrlhf_like_loss
        if hooked:
            rec = Recorder(tmp_path, run="hooked")
            fn = LossHook(rec, names="openrlhf", eps_low=0.2, eps_high=0.2, on_error="raise").wrap(fn)
            loss = fn(lp, old_lp, a, mask.float(), step=0, update=0)
        else:
            loss = fn(lp, old_lp, a, mask.float())
        loss.backward()
        losses.append(loss.detach())
        grads.append(z.grad)
    rec.close()
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    t = _tokens(rec.dir)
    assert len(t) == int(mask.sum()) and t["grad_coef"].notna().all()


def test_cross_path_policy_update_and_hook_record_the_same_rows(tmp_path):
    logits, tokens, mask, adv, old_lp, old_h = _batch(1)
    kw = dict(method="grpo", eps_low=0.2, eps_high=0.28)
    rec_a = Recorder(tmp_path, run="torch")
    za = logits.clone().requires_grad_(True)
    out = policy_update(rec_a, 0, 0, za, tokens, mask, adv, old_lp, old_entropy=old_h, **kw)
    out.loss.backward()
    rec_a.close()
    rec_b = Recorder(tmp_path, run="hook")
    hook = LossHook(rec_b, eps_low=0.2, eps_high=0.28, on_error="raise")
    zb = logits.clone().requires_grad_(True)
    lp, h = logprobs_and_entropy(zb, tokens)
    hook.watch(
        0,
        0,
        logprobs=lp,
        old_logprobs=old_lp,
        advantages=adv,
        mask=mask,
        entropy=h,
        old_entropy=old_h,
        logits=zb,
        tokens=tokens,
    )
    policy_loss(lp, old_lp, adv, mask, **kw).loss.backward()
    rec_b.close()
    assert torch.equal(za.grad, zb.grad)
    ta, tb = _tokens(rec_a.dir), _tokens(rec_b.dir)
    assert len(ta) == len(tb) == int(mask.sum())
    both = [
        "token_id",
        "logprob",
        "old_logprob",
        "prob",
        "advantage",
        "quadrant",
        "ratio",
        "clip",
        "clipped",
        "grad_coef",
        "entropy",
        "old_entropy",
        "entropy_ratio",
        "logit_grad_norm",
    ]
    for c in both:
        x, y = ta[c].to_numpy(), tb[c].to_numpy()
        if x.dtype.kind == "f":
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7, err_msg=c)
        else:
            assert (x == y).all(), c
    assert tb["logit_grad_norm"].notna().all() and tb["grad_coef"].notna().all()


def test_sum_pi_squared_gives_logit_grad_norm(tmp_path):
    logits, tokens, mask, adv, old_lp, _ = _batch(2)
    z = logits.clone().requires_grad_(True)
    lp, _ = logprobs_and_entropy(z, tokens)
    sum_p2 = torch.softmax(logits, -1).square().sum(-1)  # [B, T]
    rec = Recorder(tmp_path, run="p2")
    hook = LossHook(rec, names="openrlhf", eps_low=0.2, eps_high=0.2, on_error="raise")
    hook.watch(0, 0, log_probs=lp, old_log_probs=old_lp, advantages=adv, action_mask=mask, sum_pi_squared=sum_p2)
    loss = _openrlhf_like_loss(lp, old_lp, adv.unsqueeze(1), mask.float())
    loss.backward()
    rec.close()
    t = _tokens(rec.dir)
    # the exact norm of d loss / d z (the logits' own gradient), per masked-in token
    want = torch.linalg.vector_norm(z.grad, dim=-1)[mask].double().numpy()
    np.testing.assert_allclose(t["logit_grad_norm"].to_numpy(), want, rtol=1e-5, atol=1e-9)
    assert t["entropy"].isna().all() and t["entropy_ratio"].isna().all()  # not handed: NULL


def test_clip_mask_from_the_loss_sets_clipped_and_side():
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.25, 1.0, 0.5]]))  # r = 2, 0.5, 1
    cm = torch.tensor([[True, True, False]])
    cols = clip_columns(
        lp, old, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool), eps_low=None, eps_high=None, clip_mask=cm
    )
    assert cols["clip"].tolist() == [[1, -1, 0]] and cols["clipped"].tolist() == [[True, True, False]]
    # dual clip: A < 0 and r = 4 > c = 3 -> dual_clipped, not clipped (PPO-clip gates A < 0 only below 1 - eps);
    # r = 2 with A < 0: region +1, neither
    cols = clip_columns(
        lp,
        torch.log(torch.tensor([[0.125, 0.25, 0.5]])),
        torch.tensor([-1.0]),
        torch.ones(1, 3, dtype=torch.bool),
        eps_low=0.2,
        eps_high=0.2,
        dual_clip=3.0,
    )
    assert cols["clip"].tolist() == [[1, 1, 0]]
    assert cols["clipped"].tolist() == [[False, False, False]] and cols["dual_clipped"].tolist() == [
        [True, False, False]
    ]


@pytest.mark.parametrize(
    "case, msg",
    [
        ("shape", "'old_log_probs' (the old_logprobs role) has shape (4, 5)"),
        ("mask_dtype", "'action_mask' (the mask role) must be bool, integer or float 0/1, got torch.complex64"),
        ("mask_values", "'action_mask' (the mask role) must hold only 0 and 1"),
        ("missing", "missing required tensor 'old_log_probs' (the old_logprobs role)"),
        ("nan", "logprobs (the trainer's 'log_probs') contains NaN"),
    ],
)
def test_bad_input_is_named_by_the_trainers_name(tmp_path, case, msg):
    logits, tokens, mask, adv, old_lp, _ = _batch(3)
    lp, _ = logprobs_and_entropy(logits, tokens)
    kw = dict(log_probs=lp, old_log_probs=old_lp, advantages=adv, action_mask=mask)
    if case == "shape":
        kw["old_log_probs"] = old_lp[:, :5]
    elif case == "mask_dtype":
        kw["action_mask"] = mask.to(torch.complex64)
    elif case == "mask_values":
        kw["action_mask"] = mask.float() * 0.5
    elif case == "missing":
        del kw["old_log_probs"]
    else:
        lp = lp.clone()
        lp[mask.nonzero()[0].tolist()[0], mask.nonzero()[0].tolist()[1]] = float("nan")
        kw["log_probs"] = lp
    rec = Recorder(tmp_path, run=case)
    with pytest.raises(ValueError) as e:
        LossHook(rec, names="openrlhf", eps_low=0.2, eps_high=0.2, on_error="raise").watch(0, 0, **kw)
    assert msg in str(e.value) and "\n" not in str(e.value)
    rec.close()


def test_recorder_failure_never_stops_the_trainer(tmp_path):
    logits, tokens, mask, adv, old_lp, _ = _batch(4)
    rec = Recorder(tmp_path, run="warn")
    fn = LossHook(rec, names="openrlhf", eps_low=0.2, eps_high=0.2).wrap(_openrlhf_like_loss)  # on_error="warn"
    z = logits.clone().requires_grad_(True)
    lp, _ = logprobs_and_entropy(z, tokens)
    weights = mask.float() * 0.5  # a trainer's weighted mask: the loss runs, the hook refuses it (warns once)
    with pytest.warns(UserWarning, match="recording stopped, training goes on: .* must hold only 0 and 1"):
        loss = fn(
            log_probs=lp, old_log_probs=old_lp, advantages=adv.unsqueeze(1), action_mask=weights, step=0, update=0
        )
    assert torch.equal(loss, _openrlhf_like_loss(lp, old_lp, adv.unsqueeze(1), weights))
    # a recorder that fails inside the backward: the backward still runs and the gradient is the same
    rec2 = Recorder(tmp_path, run="warn2")
    hook = LossHook(rec2, names="openrlhf", eps_low=0.2, eps_high=0.2)
    rec2.record_update = None  # broken recorder: calling it raises TypeError inside the grad hook
    z2 = logits.clone().requires_grad_(True)
    lp2, _ = logprobs_and_entropy(z2, tokens)
    hook.watch(0, 0, log_probs=lp2, old_log_probs=old_lp, advantages=adv.unsqueeze(1), action_mask=mask.float())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _openrlhf_like_loss(lp2, old_lp, adv.unsqueeze(1), mask.float()).backward()
    assert any("recording stopped" in str(x.message) for x in w) and hook.failed
    z3 = logits.clone().requires_grad_(True)
    lp3, _ = logprobs_and_entropy(z3, tokens)
    _openrlhf_like_loss(lp3, old_lp, adv.unsqueeze(1), mask.float()).backward()
    assert torch.equal(z2.grad, z3.grad)
    rec.close()
    del rec2.record_update
    rec2.close()


def test_an_update_with_nan_is_skipped_and_recording_goes_on(tmp_path):
    """A NaN in one update's log-probs (a trainer's bf16 overflow) drops that update only: one warning naming
    the trainer's argument, LossHook.skipped lists it, and the updates before and after are recorded."""
    logits, tokens, mask, adv, old_lp, _ = _batch(5)
    rec = Recorder(tmp_path, run="nan")
    hook = LossHook(rec, names="openrlhf", eps_low=0.2, eps_high=0.2)  # on_error="warn"
    fn = hook.wrap(_openrlhf_like_loss)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(4):  # one update a step
            z = logits.clone().requires_grad_(True)
            lp, _ = logprobs_and_entropy(z, tokens)
            if step in (1, 2):  # masked-in NaN: the loss is NaN too, the trainer goes on
                lp = torch.where(mask & (torch.arange(mask.shape[1]) == step), torch.nan, lp)
            fn(
                log_probs=lp,
                old_log_probs=old_lp,
                advantages=adv.unsqueeze(1),
                action_mask=mask.float(),
                step=step,
                update=0,
            ).backward()
    hook.flush()
    rec.close()
    said = [str(x.message) for x in w if "loss hook" in str(x.message)]
    assert len(said) == 1 and "logprobs (the trainer's 'log_probs') contains NaN" in said[0], said
    assert hook.failed is None and hook.skipped == [(1, 0, "logprobs"), (2, 0, "logprobs")]
    got = connect(tmp_path / "nan").execute("SELECT DISTINCT step FROM tokens ORDER BY step").fetchall()
    assert got == [(0,), (3,)]
    # on_error="raise": the same update raises, naming the trainer's argument
    rec2 = Recorder(tmp_path, run="nan-raise")
    hook2 = LossHook(rec2, names="openrlhf", eps_low=0.2, eps_high=0.2, on_error="raise")
    z = logits.clone().requires_grad_(True)
    lp, _ = logprobs_and_entropy(z, tokens)
    lp = torch.where(mask, torch.nan, lp)
    hook2.watch(0, 0, log_probs=lp, old_log_probs=old_lp, advantages=adv.unsqueeze(1), action_mask=mask.float())
    with pytest.raises(ValueError, match="^logprobs \\(the trainer's 'log_probs'\\) contains NaN"):
        _openrlhf_like_loss(lp, old_lp, adv.unsqueeze(1), mask.float()).backward()
    rec2.close()


def test_packed_one_dimensional_tensors_are_one_row(tmp_path):
    """slime concatenates a micro-batch's responses: [N] tensors, recorded as one row [1, N]."""
    logits, tokens, mask, adv, old_lp, _ = _batch(5)
    z = logits.clone().requires_grad_(True)
    lp, _ = logprobs_and_entropy(z, tokens)
    m = mask.reshape(-1)
    flat_lp, flat_old = lp.reshape(-1), old_lp.reshape(-1)  # [N]
    flat_adv = adv.unsqueeze(1).expand(mask.shape).reshape(-1)
    rec = Recorder(tmp_path, run="packed")
    hook = LossHook(rec, names="slime", eps_low=0.2, eps_high=0.2, on_error="raise")
    hook.watch(0, 0, log_probs=flat_lp, old_log_probs=flat_old, advantages=flat_adv, loss_mask=m)
    loss = _openrlhf_like_loss(flat_lp, flat_old, flat_adv, m.float())
    x = flat_lp.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(_openrlhf_like_loss(x, flat_old, flat_adv, m.float()), x)
    loss.backward()
    rec.close()
    t = _tokens(rec.dir)
    assert len(t) == int(m.sum())
    np.testing.assert_allclose(t["grad_coef"].to_numpy(), g[m].numpy(), rtol=1e-6)


def test_rollout_log_probs_become_the_sampler_column(tmp_path):
    """OpenRLHF's rollout_log_probs, handed to the wrapped loss, are recorded as tokens.sampler_logprob
    (Recorder.record_update(sampler_logprobs=)): the mismatch old - sampler of every masked-in token, by hand."""
    logits, tokens, mask, adv, old_lp, _ = _batch(seed=3)
    a = adv.unsqueeze(1).expand(mask.shape)
    rollout = old_lp - 0.05 * torch.arange(mask.shape[1], dtype=old_lp.dtype)  # [B, T]: delta = 0.05 t
    z = logits.clone().requires_grad_(True)
    lp, _ = logprobs_and_entropy(z, tokens)
    with Recorder(tmp_path, run="samp") as rec:
        fn = LossHook(rec, names="openrlhf", eps_low=0.2, eps_high=0.2, on_error="raise").wrap(_openrlhf_like_loss)
        fn(lp, old_lp, a, mask.float(), rollout_log_probs=rollout, step=0, update=0).backward()
    t = _tokens(rec.dir)
    assert len(t) == int(mask.sum()) and t["sampler_logprob"].notna().all()
    np.testing.assert_allclose(t["old_logprob"] - t["sampler_logprob"], 0.05 * t["pos"], atol=1e-6)


def test_a_run_through_the_hook_reports_as_one_through_policy_update(tmp_path):
    """Three steps of two updates each, recorded once through policy_update and once through the hook around
    the same loss: every report figure's analysis gives the same numbers, but for the figures of columns the
    hook cannot know at the loss level (the entropy attribution: entropy_effect is NULL there, said so)."""
    from entropylens.read.query import run_analysis
    from entropylens.report.figures import FIGURES

    kw = dict(method="grpo", eps_low=0.2, eps_high=0.28)
    for run in ("torch", "hook"):
        g = torch.Generator().manual_seed(5)
        with Recorder(tmp_path / run, run=run, config={"method": "grpo"}) as rec:
            hook = LossHook(rec, eps_low=0.2, eps_high=0.28, on_error="raise")
            for step in range(3):
                logits, tokens, mask, adv, old_lp, old_h = _batch(seed=int(torch.randint(0, 999, (1,), generator=g)))
                for u in range(2):
                    z = (logits + 0.2 * u).clone().requires_grad_(True)
                    if run == "torch":
                        out = policy_update(
                            rec,
                            step,
                            u,
                            z,
                            tokens,
                            mask,
                            adv,
                            old_lp,
                            old_entropy=old_h,
                            seq_ids=torch.arange(len(adv)),
                            **kw,
                        )
                        out.loss.backward()
                    else:
                        lp, h = logprobs_and_entropy(z, tokens)
                        hook.watch(
                            step,
                            u,
                            logprobs=lp,
                            old_logprobs=old_lp,
                            advantages=adv,
                            mask=mask,
                            entropy=h,
                            old_entropy=old_h,
                            logits=z,
                            tokens=tokens,
                            seq_ids=torch.arange(len(adv)),
                        )
                        policy_loss(lp, old_lp, adv, mask, **kw).loss.backward()
                hook.flush()
                rec.end_step(step)
    attribution = {"entropy_budget_by_step", "clipping_removed", "entropy_change_by_quadrant"}
    compared = 0
    for f in FIGURES:
        if f.optional or f.analysis in attribution:
            continue
        a = run_analysis(connect(tmp_path / "torch"), f.analysis).drop(columns=["run"], errors="ignore")
        b = run_analysis(connect(tmp_path / "hook"), f.analysis).drop(columns=["run"], errors="ignore")
        assert list(a.columns) == list(b.columns) and len(a) == len(b), f.analysis
        for c in a.columns:
            if a[c].dtype.kind == "f":
                np.testing.assert_allclose(
                    b[c].to_numpy(float), a[c].to_numpy(float), rtol=2e-5, atol=1e-7, err_msg=f"{f.analysis}.{c}"
                )
            else:
                assert (a[c].astype(str) == b[c].astype(str)).all(), f"{f.analysis}.{c}"
        compared += 1
    assert compared >= 10
    assert connect(tmp_path / "hook").execute("SELECT count(entropy_effect) FROM tokens").fetchone()[0] == 0


def test_wrap_keeps_the_hooks_own_tensors_from_the_loss(tmp_path):
    """wrap(loss_fn)(..., entropy=h, seq_ids=ids): tensors only the hook reads never reach a loss_fn that does
    not take them (a new user's TypeError from a loss without **kwargs); the hook records them."""
    logits, tokens, mask, adv, old_lp, old_h = _batch(seed=4)
    z = logits.clone().requires_grad_(True)
    lp, h = logprobs_and_entropy(z, tokens)
    with Recorder(tmp_path, run="w") as rec:
        fn = LossHook(rec, names="openrlhf", eps_low=0.2, eps_high=0.2, on_error="raise").wrap(_openrlhf_like_loss)
        fn(
            log_probs=lp,
            old_log_probs=old_lp,
            advantages=adv.unsqueeze(1).expand(mask.shape),
            action_mask=mask.float(),
            entropy=h,
            old_entropy=old_h,
            seq_ids=torch.arange(len(adv)),
            step=0,
            update=0,
        ).backward()
    t = _tokens(rec.dir)
    assert len(t) == int(mask.sum()) and t["entropy"].notna().all() and t["entropy_ratio"].notna().all()
