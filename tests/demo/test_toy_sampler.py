"""The toy's mismatched sampler (entropylens/demo/toy/sampler.py): its log-probs by hand on a tiny logit
row, bf16 rounding, TIS's truncated weight, and the bad names."""

import math

import pytest
import torch
from sampler_api import needs_sampler_api

from entropylens.demo.toy.sampler import check_mismatch, sampler_logits, sampler_logprobs, tis_weight


def _lse(xs):
    return math.log(sum(math.exp(x) for x in xs))


def test_temperature_sampler_delta_by_hand():
    # z = (2, 0, -1), T = 1, sampler at S = 2: pi_old = softmax(2, 0, -1), pi_s = softmax(1, 0, -0.5)
    # LSE(2, 0, -1) = ln(e^2 + 1 + e^-1) = ln(7.389056 + 1 + 0.367879) = ln 8.756935 = 2.169846
    # LSE(1, 0, -0.5) = ln(2.718282 + 1 + 0.606531) = ln 4.324813 = 1.464367
    # token 0: old 2 - 2.169846 = -0.169846; sampler 1 - 1.464367 = -0.464367; delta = +0.294521
    # token 2: old -1 - 2.169846 = -3.169846; sampler -0.5 - 1.464367 = -1.964367; delta = -1.205479
    z = torch.tensor([[[2.0, 0.0, -1.0], [2.0, 0.0, -1.0]]])  # [1, 2, 3]
    tok = torch.tensor([[0, 2]])
    old = torch.log_softmax(z, -1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    s = sampler_logprobs(z, tok, "temp:2")
    assert s.tolist()[0] == pytest.approx([-0.464367, -1.964367], abs=1e-5)
    assert (old - s).tolist()[0] == pytest.approx([0.294521, -1.205479], abs=1e-5)
    assert s[0, 0].item() == pytest.approx(1 - _lse([1, 0, -0.5]), abs=1e-6)
    # with the run's temperature T = 0.5 the sampler is at S T = 1: z / 1 -> LSE 2.169846, token 0: -0.169846
    assert sampler_logprobs(z, tok, "temp:2", temperature=0.5)[0, 0].item() == pytest.approx(-0.169846, abs=1e-5)
    # no mismatch: the sampler is the trainer
    assert torch.equal(sampler_logprobs(z, tok, ""), old)


def test_bf16_sampler_rounds_the_logits():
    # bf16 keeps 8 significant bits: 1.00390625 (1 + 2^-8) rounds to 1.0 (ties to even), 3.3 to 3.296875
    z = torch.tensor([[[1.00390625, 3.3, 0.0]]])
    assert sampler_logits(z, "bf16")[0, 0].tolist() == [1.0, 3.296875, 0.0]
    tok = torch.tensor([[1]])
    # delta for token 1 = (3.3 - LSE(1.00390625, 3.3, 0)) - (3.296875 - LSE(1, 3.296875, 0))
    want = (3.3 - _lse([1.00390625, 3.3, 0.0])) - (3.296875 - _lse([1.0, 3.296875, 0.0]))
    old = torch.log_softmax(z, -1)[0, 0, 1]
    assert (old - sampler_logprobs(z, tok, "bf16")[0, 0]).item() == pytest.approx(want, abs=2e-6)
    assert abs(want) < 1e-2  # a small, controlled gap


def test_tis_weight_truncates():
    old = torch.tensor([[0.0, -1.0, -2.0]])
    samp = torch.tensor([[0.0, -2.0, -1.0]])  # ratios exp(0) = 1, exp(1) = 2.718, exp(-1) = 0.368
    assert tis_weight(old, samp, cap=2.0).tolist()[0] == pytest.approx([1.0, 2.0, math.exp(-1)])


def test_sampler_names():
    assert [check_mismatch(x) for x in ("", "bf16", "temp:1.1", "temp:.9")] == ["", "bf16", "temp:1.1", "temp:.9"]
    for bad in ("fp8", "temp:", "temp:0", "temp:-1", "temp:x"):
        with pytest.raises(ValueError, match="mismatch: unknown sampler"):
            check_mismatch(bad)


def test_sample_draws_from_the_samplers_logits():
    # a sampler whose logits are the model's x 1000 samples (almost surely) the model's argmax at every step
    from entropylens.demo.toy import task
    from entropylens.demo.toy.model import build_model, sample

    model = build_model(16, 1, 2, seed=0).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = task.make_prompts(4, gen)
    greedy = sample(model, prompts, 3, gen, 1.0, transform=lambda z: z.float() * 1000)  # [4, 3]
    with torch.no_grad():
        seqs = prompts
        for i in range(3):
            nxt = model(input_ids=seqs).logits[:, -1].argmax(-1, keepdim=True)
            assert torch.equal(nxt, greedy[:, i : i + 1])
            seqs = torch.cat([seqs, nxt], dim=1)


@needs_sampler_api
def test_toy_run_records_the_sampler_and_tis(tmp_path):
    """A short toy run with a temp:1.5 sampler and TIS at 2: every token has a sampler log-prob, and the IS
    weight the loss applied is min(exp(old_logprob - sampler_logprob), 2) (float32 tolerance); a run
    without --mismatch records none (NULL). At S > 1 the sampler is flatter: delta = log pi_old - log pi_s
    grows with the token's logit, so it rises with the trainer's log-prob (a positive correlation)."""
    from entropylens.demo.runner import QUICK
    from entropylens.demo.toy.config import config_for
    from entropylens.demo.toy.train import train
    from entropylens.read.query import connect

    for name, kw in (("mm", {"mismatch": "temp:1.5", "tis": 2.0}), ("plain", {})):
        train(config_for("grpo", **{**QUICK, "steps": 2}, **kw), tmp_path, run=name, fsync=False)
    con = connect(tmp_path)
    n, n_s, max_err, hp = con.execute(
        "SELECT count(*), count(sampler_logprob), max(abs(is_weight - least(exp(sampler_log_ratio), 2.0))), "
        "corr(old_logprob, sampler_log_ratio) FROM tokens WHERE run = 'mm'"
    ).fetchone()
    assert n > 0 and n_s == n and max_err < 1e-5 and hp > 0
    assert con.execute(
        "SELECT count(sampler_logprob), count(is_weight) FROM tokens WHERE run = 'plain'"
    ).fetchone() == (0, 0)


def test_demo_mismatch_runs_each_method_with_and_without_tis():
    from entropylens.demo.runner import demo_configs, run_id

    plain = demo_configs(("grpo", "dapo"), seeds=2, quick=True)
    assert [run_id(c) for c in plain] == ["grpo-s0", "grpo-s1", "dapo-s0", "dapo-s1"]
    assert all(c.mismatch == "" and c.tis == 0 for c in plain)  # the default demo: no sampler, unchanged
    cfgs = demo_configs(("grpo",), seeds=2, quick=True, mismatch="temp:1.1", tis=3.0)
    assert [(run_id(c), c.method, c.mismatch, c.tis) for c in cfgs] == [
        ("grpo-temp1.1-s0", "grpo", "temp:1.1", 0.0),
        ("grpo-temp1.1-s1", "grpo", "temp:1.1", 0.0),
        ("grpo-temp1.1-tis-s0", "grpo", "temp:1.1", 3.0),
        ("grpo-temp1.1-tis-s1", "grpo", "temp:1.1", 3.0),
    ]
    with pytest.raises(ValueError, match="mismatch: unknown sampler"):
        demo_configs(("grpo",), mismatch="fp8")


def test_demo_cli_refuses_a_bad_sampler_in_one_line(tmp_path):
    from entropylens.cli.main import app
    from typer.testing import CliRunner

    for args, msg in (
        (["--mismatch", "fp8"], "error: --mismatch: unknown sampler 'fp8'; one of bf16, temp:S (S > 0, e.g. temp:1.1)"),
        (["--mismatch", "bf16", "--tis", "0"], "error: --tis must be > 0, got 0.0"),
    ):
        res = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "d"), "--quick", *args])
        assert res.exit_code == 2 and res.output.strip() == msg, res.output
        assert not (tmp_path / "d").exists()
