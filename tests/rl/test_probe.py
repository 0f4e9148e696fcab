"""The parameter-space probe (entropylens.rl.probe) on a real model, optimizer and policy loss:
its step decomposition against the optimizer's actual update, its predictions against measured
entropy changes (finite steps), and the probes rows through the Recorder."""

import copy

import pytest
import torch

from entropylens.rl import stats
from entropylens.rl.losses import policy_loss
from entropylens.rl.probe import ProbeForward, probe_update


def _setup(seed=0, b=8, t=6, d=12, v=17):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(d, 24), torch.nn.Tanh(), torch.nn.Linear(24, v))
    with torch.no_grad():
        model[2].weight.mul_(10.0)  # peaked enough for HP and LP tokens
    x = torch.randn(b, t, d, generator=g)
    with torch.no_grad():
        old = model(x) + torch.randn(b, t, v, generator=g) * 0.5  # an older policy: some ratios clip
        probs = torch.softmax(old, -1)
        tok = torch.multinomial(probs.reshape(-1, v), 1, generator=g).reshape(b, t)
        old_lp, old_h = stats.logprobs_and_entropy(old, tok)
    adv = torch.tensor([1.0, -1.0, 0.8, -0.6, 1.2, -1.1, 0.0, 0.5])
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 4:] = False
    batch = dict(x=x, tok=tok, old_lp=old_lp, old_h=old_h, adv=adv, mask=mask)
    return model, batch


def loss_fn(model, batch):
    logits = model(batch["x"])  # [B, T, V]
    lp, h = stats.logprobs_and_entropy(logits, batch["tok"], entropy_grad=torch.is_grad_enabled())
    out = policy_loss(
        lp, batch["old_lp"], batch["adv"], batch["mask"], method="grpo", entropy=h.detach(), old_entropy=batch["old_h"]
    )
    return ProbeForward(out.loss, lp, h, batch["mask"], out.columns)


def _mean_h(model, batch):
    with torch.no_grad():
        return float(stats.entropy_from_logits(model(batch["x"]))[batch["mask"]].mean())


def _by_part(rows):
    return {r["part"]: r for r in rows}


def test_probe_sgd_parts_match_finite_steps():
    model, batch = _setup()
    lr = 1e-3
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rows = _by_part(probe_update(model, opt, loss_fn, batch))
    step = rows["step"]
    assert rows["PA&LP"]["tokens"] > 0 and rows["NA&HP"]["tokens"] > 0
    # plain SGD: the parts explain the whole step, nothing is left over
    assert abs(rows["other"]["predicted_dh"]) < 1e-4 * abs(step["predicted_dh"])
    assert rows["momentum"]["predicted_dh"] == 0
    # first order: the predicted change is the measured one at a small step
    assert step["measured_dh"] == pytest.approx(step["predicted_dh"], rel=0.05)
    # a part's prediction against a real finite step along that part's gradient alone (twin model)
    for part in ("PA&HP", "PA&LP", "NA&HP", "NA&LP", "PA&LP dropped"):
        if part not in rows:
            continue
        m2 = copy.deepcopy(twin)
        fwd = loss_fn(m2, batch)
        quad = {"PA&HP": 1, "PA&LP": 2, "NA&HP": 3, "NA&LP": 4}[part.split()[0]]
        coef = fwd.columns["grad_coef"]
        if part.endswith("dropped"):
            coef = torch.where(fwd.columns["grad_changed"], fwd.columns["grad_coef_unclipped"] - coef, 0.0)
        c = torch.where(fwd.columns["quadrant"] == quad, coef, 0.0) * batch["mask"]
        grads = torch.autograd.grad((c * fwd.logprobs).sum(), list(m2.parameters()))
        m3 = copy.deepcopy(twin)
        with torch.no_grad():  # central difference: the step and its mirror cancel the second order
            for p, p3, g in zip(m2.parameters(), m3.parameters(), grads):
                p.sub_(lr * g)
                p3.add_(lr * g)
        measured = (_mean_h(m2, batch) - _mean_h(m3, batch)) / 2
        assert rows[part]["predicted_dh"] == pytest.approx(measured, rel=0.02, abs=1e-9), part


def test_probe_adam_uses_the_optimizer_state_and_clipping():
    model, batch = _setup(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(3):  # some history: non-zero first and second moments
        opt.zero_grad()
        loss_fn(model, batch).loss.backward()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    rows = _by_part(probe_update(model, opt, loss_fn, batch, max_grad_norm=1e-3))  # clipping is active
    step = rows["step"]
    assert step["optimizer"] == "Adam" and step["grad_norm"] == pytest.approx(1e-3, rel=1e-3)
    # the quadrant parts + the momentum explain the real Adam step (preconditioner from the state)
    assert abs(rows["other"]["predicted_dh"]) < 1e-4 * max(abs(step["predicted_dh"]), 1e-12)
    assert rows["momentum"]["predicted_dh"] != 0
    assert step["measured_dh"] == pytest.approx(step["predicted_dh"], rel=0.05)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))  # it stepped once


def test_probe_rejects_unsupported_optimizer_and_no_entropy_grad():
    model, batch = _setup()
    with pytest.raises(ValueError, match="not supported"):
        probe_update(model, torch.optim.RMSprop(model.parameters(), lr=1e-3), loss_fn, batch)

    def no_grad_entropy(m, b):
        f = loss_fn(m, b)
        return ProbeForward(f.loss, f.logprobs, f.entropy.detach(), f.mask, f.columns)

    with pytest.raises(ValueError, match="entropy_grad"):
        probe_update(model, torch.optim.SGD(model.parameters(), lr=1e-3), no_grad_entropy, batch)


def test_recorder_probe_writes_the_probes_table(tmp_path):
    from entropylens import Recorder
    from entropylens.read.query import connect, run_analysis

    model, batch = _setup(seed=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Recorder(tmp_path, run="p", config={"method": "grpo"}) as rec:

        def recorded_loss_fn(m, b):
            f = loss_fn(m, b)
            if torch.is_grad_enabled():  # the probed update is also an ordinary recorded update
                rec.record_update(
                    0,
                    0,
                    mask=b["mask"],
                    advantages=b["adv"],
                    logprobs=f.logprobs,
                    old_logprobs=b["old_lp"],
                    entropy=f.entropy,
                    old_entropy=b["old_h"],
                    tokens=b["tok"],
                    loss=None,
                )
            return f

        rows = rec.probe(0, model, opt, recorded_loss_fn, batch, max_grad_norm=1.0)
    con = connect(tmp_path)
    df = run_analysis(con, "probe_vs_measured")
    assert len(df) == len(rows) and set(df["part"]) == {r["part"] for r in rows}
    step = df[df["part"] == "step"].iloc[0]
    assert step["measured_dh"] == pytest.approx(rows[-1]["measured_dh"])
    assert step["optimizer"] == "Adam" and step["update"] == 0
    gn = con.execute("SELECT grad_norm, lr, n_tokens FROM steps").fetchall()
    assert gn[0][1] == pytest.approx(1e-3) and gn[0][0] > 0 and gn[0][2] == int(batch["mask"].sum())
