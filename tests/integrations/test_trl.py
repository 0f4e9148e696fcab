"""TRL at real settings (real TRL 1.16, tiny Qwen2 from a config, local tokenizer, CPU, no mocks):
gradient accumulation, the closed-form logit-gradient norm against full logits, PEFT + KL,
TRL's non-PPO loss types, the fallback head, refused options, two processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from entropylens.read.query import connect, run_analysis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
import trl_tiny  # noqa: E402


def _snapshot_class():
    """EntropyLensGRPOTrainer that, before each training micro-batch, computes the FULL logits of the
    same model on the same inputs (a plain forward, no fused head) and keeps p_theta(a) and sum_j p_j^2:
    the independent reference for the closed-form logit-gradient norm."""
    from entropylens.integrations.trl import EntropyLensGRPOTrainer

    class Snapshot(EntropyLensGRPOTrainer):
        snaps: list

        def _compute_loss(self, model, inputs):
            if self.model.training:
                ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
                attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
                k = inputs["completion_ids"].size(1)
                with torch.no_grad():
                    logits = self._el_base_model()(input_ids=ids, attention_mask=attn).logits  # [b, P+K, V]
                u = logits[:, -k - 1 : -1].double() / self.temperature  # [b, K, V]
                logp = u.log_softmax(-1)
                lp_a = logp.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)  # [b, K]
                sq = logp.exp().square().sum(-1)  # [b, K]
                # entropy sensitivity s = p_a (log p_a + H) - sum_j p_j^2 (log p_j + H), float64
                h = -(logp.exp() * logp).sum(-1)  # [b, K]
                sens = lp_a.exp() * (lp_a + h) - (logp.exp().square() * (logp + h.unsqueeze(-1))).sum(-1)
                seq = inputs["el_seq_ids"].unsqueeze(1).expand(-1, k)
                pos = torch.arange(k).unsqueeze(0).expand_as(seq)
                keep = inputs["completion_mask"].bool()
                self.snaps.append(
                    pd.DataFrame(
                        {
                            "step": self.state.global_step,
                            "seq": seq[keep].numpy(),
                            "pos": pos[keep].numpy(),
                            "ref_logprob": lp_a[keep].numpy(),
                            "ref_sum_p2": sq[keep].numpy(),
                            "ref_sens": sens[keep].numpy(),
                        }
                    )
                )
            return super()._compute_loss(model, inputs)

    Snapshot.snaps = []
    return Snapshot


def _rows(run_dir):
    return connect(run_dir).execute('SELECT * FROM tokens ORDER BY step, "update", seq, pos').df()


def _check_bounds(t):
    # (1 - p)|g| <= ||dL/dz|| <= sqrt(2)|g| with p the current policy's probability of the token
    g, lgn, p = t["grad_coef"].abs(), t["logit_grad_norm"], np.exp(t["logprob"])
    assert t["logit_grad_norm"].notna().all() and t["grad_coef"].notna().all()
    assert (lgn >= (1 - p) * g * (1 - 1e-5) - 1e-12).all()
    assert (lgn <= np.sqrt(2) * g * (1 + 1e-5) + 1e-12).all()


def _check_closed_form(t, snaps):
    ref = pd.concat(snaps).drop_duplicates(["step", "seq", "pos"])
    j = t.merge(ref, on=["step", "seq", "pos"], how="left", validate="one_to_one")
    assert j["ref_sum_p2"].notna().all()
    np.testing.assert_allclose(j["logprob"], j["ref_logprob"], atol=2e-5)  # TRL's fused head == full logits
    p = np.exp(j["ref_logprob"])
    want = j["grad_coef"].abs() * np.sqrt(1 - 2 * p + j["ref_sum_p2"])  # T = 1
    np.testing.assert_allclose(j["logit_grad_norm"], want, rtol=2e-4, atol=1e-9)


@pytest.fixture(scope="module")
def ga2(tmp_path_factory):
    out = tmp_path_factory.mktemp("ga2")
    cls = _snapshot_class()
    tr = trl_tiny.trainer(out, "ga2", cls=cls, gradient_accumulation_steps=2, per_device_train_batch_size=4)
    tr.train()
    return _rows(out / "ga2"), cls.snaps, connect(out / "ga2")


def test_trl_ga2_every_row_closed_form_and_bounds(ga2):
    t, snaps, con = ga2
    assert sorted(t["step"].unique()) == [0, 1] and sorted(t["update"].unique()) == [0, 1]
    _check_bounds(t)
    _check_closed_form(t, snaps)
    # TRL's dapo loss, on-policy (r = 1): dLoss/dlogp = -A / (tokens of the generation batch): the
    # generation batch (8 sequences) is one optimizer step here, so grad_coef = -A / n_tokens(step)
    np.testing.assert_allclose(t["ratio"], 1.0, rtol=0, atol=1e-6)
    n = t.groupby("step")["seq"].transform("size")
    np.testing.assert_allclose(t["grad_coef"], -t["advantage"] / n, rtol=1e-5, atol=1e-9)
    # the recorder's aggregates see the closed-form norms too
    assert con.execute("SELECT count(*) FROM steps WHERE lgn_mean_na_lp IS NULL AND n_na_lp > 0").fetchone()[0] == 0


def test_trl_ga1_twice_the_micro_batch_same_grad_coef(ga2, tmp_path):
    t2, _, _ = ga2
    trl_tiny.trainer(tmp_path, "ga1", gradient_accumulation_steps=1, per_device_train_batch_size=8, max_steps=1).train()
    t1 = _rows(tmp_path / "ga1")
    a = t2[t2["step"] == 0].set_index(["seq", "pos"]).sort_index()
    b = t1[t1["step"] == 0].set_index(["seq", "pos"]).sort_index()
    assert len(a) == len(b) > 0 and (a.index == b.index).all()
    np.testing.assert_array_equal(a["token_id"], b["token_id"])  # the same completions
    np.testing.assert_allclose(b["grad_coef"], a["grad_coef"], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(b["logit_grad_norm"], a["logit_grad_norm"], rtol=1e-4, atol=1e-9)


def test_trl_logs_carry_every_steps_aggregates_at_their_own_step(tmp_path):
    # entropylens/* keys reach TRL's logs from the writer thread (no wait at a step's end), each step's
    # values at that step's own index (global_step = step + 1), whatever logging_steps is; all of them
    # by the last step. Checked against the step's values computed here from the token rows.
    tr = trl_tiny.trainer(tmp_path, "logs", max_steps=3, logging_steps=3)
    tr.train()
    logs = {h["step"]: h for h in tr.state.log_history if "entropylens/clip_low_frac" in h}
    assert sorted(logs) == [1, 2, 3] and not tr._el_summaries
    t = _rows(tmp_path / "logs")
    assert sorted(t["step"].unique()) == [0, 1, 2]
    per_step = t.groupby("step").agg(
        low=("clip", lambda c: (c == -1).mean()),
        high=("clip", lambda c: (c == 1).mean()),
        pa_hp=("quadrant", lambda q: (q == "PA&HP").mean()),
    )
    for step, row in per_step.iterrows():
        h = logs[step + 1]
        assert h["entropylens/clip_low_frac"] == pytest.approx(row["low"], abs=1e-6)
        assert h["entropylens/clip_high_frac"] == pytest.approx(row["high"], abs=1e-6)
        assert h["entropylens/share_pa_hp"] == pytest.approx(row["pa_hp"], abs=1e-6)


def test_trl_logs_every_step_once_with_logging_steps_1(tmp_path):
    from entropylens.integrations.trl import EntropyLensGRPOTrainer

    class Counting(EntropyLensGRPOTrainer):
        logged: list

        def _el_log_summary(self, step, summary):
            self.logged.append((step, summary["n_tokens"]))
            super()._el_log_summary(step, summary)

    Counting.logged = []
    tr = trl_tiny.trainer(tmp_path, "logs1", cls=Counting, max_steps=3, logging_steps=1)
    tr.train()
    # one summary per step, each logged at its own step
    t = _rows(tmp_path / "logs1")
    assert Counting.logged == list(enumerate(t.groupby("step").size().tolist())) and not tr._el_summaries
    assert sorted(h["step"] for h in tr.state.log_history if "entropylens/share_pa_hp" in h) == [1, 2, 3]
    # the learning rate each optimizer step used: TRL's default linear decay from 5e-3 over 3 steps, no
    # warm-up (lr_k = 5e-3 (1 - k/3)), read before the scheduler steps (after it, it would be one step late)
    lrs = connect(tmp_path / "logs1").execute("SELECT step, max(lr) FROM steps GROUP BY step ORDER BY step").fetchall()
    assert [s for s, _ in lrs] == [0, 1, 2]
    np.testing.assert_allclose([lr for _, lr in lrs], [5e-3, 5e-3 * 2 / 3, 5e-3 / 3], rtol=1e-6)


def test_trl_checkpoint_commits_the_recorded_steps(tmp_path, monkeypatch):
    # save_steps = 2: when TRL has saved checkpoint-2, steps 0 and 1 are already on disk (read here while
    # training goes on), and at checkpoint-3 step 2 too; the recorder is not closed before the last save
    from entropylens import Recorder

    seen = []
    commit = Recorder.commit

    def spy(self, step=None):
        upto = commit(self, step)
        con = connect(tmp_path / "ckpt")
        seen.append(
            (upto, con.execute("SELECT list(DISTINCT step ORDER BY step) FROM steps").fetchone()[0], self._closed)
        )
        return upto

    monkeypatch.setattr(Recorder, "commit", spy)
    tr = trl_tiny.trainer(tmp_path, "ckpt", max_steps=3, save_strategy="steps", save_steps=2)
    tr.train()
    assert (tmp_path / ".trl" / "checkpoint-2").is_dir() and (tmp_path / ".trl" / "checkpoint-3").is_dir()
    assert seen == [(1, [0, 1], False), (2, [0, 1, 2], False)]


def test_trl_each_step_is_written_when_it_ends(tmp_path):
    # at on_step_end (a callback after ours) the step that just ended is on disk once the writer has
    # caught up, before the next step's generation: a job killed during that generation keeps it
    from transformers import TrainerCallback

    seen = []

    class After(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            tr.recorder._writer.drain()  # only waits for the writer: no close, no commit
            con = connect(tmp_path / "ends")
            seen.append(
                (
                    state.global_step - 1,
                    con.execute("SELECT list(DISTINCT step ORDER BY step) FROM steps").fetchone()[0],
                )
            )

    tr = trl_tiny.trainer(tmp_path, "ends", max_steps=3, gradient_accumulation_steps=2)
    tr.add_callback(After())
    tr.train()
    assert seen == [(0, [0]), (1, [0, 1]), (2, [0, 1, 2])]


def test_trl_resume_from_a_checkpoint_continues_the_run(tmp_path):
    # 4 steps with checkpoints at 2 and 4, then a new trainer resumes from checkpoint-2 into the same run
    # (resume=<that checkpoint>: its steps 0-1) and trains to step 3: steps 0-2 once each, the first job's
    # rows of 0-1 kept as they were, its step 3 removed
    first = trl_tiny.trainer(tmp_path, "res", max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    con = connect(tmp_path / "res")
    kept = con.execute('SELECT step, "update", n_tokens, grad_norm FROM steps WHERE step <= 1 ORDER BY ALL').fetchall()
    assert sorted({r[0] for r in con.execute("SELECT step FROM steps").fetchall()}) == [0, 1, 2, 3]
    ckpt = tmp_path / ".trl" / "checkpoint-2"
    # an off-by-one resume= would record a step twice or lose steps: refused before any file goes
    with pytest.raises(
        ValueError,
        match=r"resume=2: no checkpoint in .* ends at step 2 \(checkpoint-2: steps 0-1, "
        r"checkpoint-4: steps 0-3\)",
    ):
        trl_tiny.trainer(tmp_path, "res", max_steps=3, el=dict(resume=2))
    wrong = trl_tiny.trainer(tmp_path, "res", max_steps=3, el=dict(resume=3))  # checkpoint-4's: nothing removed
    with pytest.raises(
        ValueError, match=r"resume=3 but .*checkpoint-2 holds steps 0-1: build the trainer with resume=1"
    ):
        wrong.train(resume_from_checkpoint=str(ckpt))
    assert con.execute("SELECT count(DISTINCT step) FROM steps").fetchone() == (4,)  # nothing lost
    with pytest.warns(UserWarning, match=r"removed 2 complete steps .* recorded after step 1: 2, 3"):
        second = trl_tiny.trainer(tmp_path, "res", max_steps=3, save_strategy="no", el=dict(resume=str(ckpt)))
    second.train(resume_from_checkpoint=str(ckpt))
    rows = (
        connect(tmp_path / "res")
        .execute('SELECT step, "update", n_tokens, grad_norm FROM steps ORDER BY ALL')
        .fetchall()
    )
    assert [r for r in rows if r[0] <= 1] == kept
    assert sorted({r[0] for r in rows}) == [0, 1, 2]
    info = json.loads((tmp_path / "res" / "run.json").read_text())
    # each job that resumed the run is listed, the refused one (after step 3, which recorded nothing) too
    assert [r["after_step"] for r in info["resumed"]] == [3, 1] and info["status"] == "finished"


@pytest.mark.parametrize("loss", [None, "ce_gppo"])
def test_trl_attribution_entropy_effect_against_float64_full_logits(tmp_path, loss):
    # attribution=True: every pass through head_stats; the training pass also gives s_t. The recorded
    # entropy_effect must equal grad_coef * s / T^2 with s from float64 full logits of the same model
    cls = _snapshot_class()
    el = dict(attribution=True, **({"loss": loss} if loss else {}))
    tr = trl_tiny.trainer(tmp_path, "attr", cls=cls, max_steps=2, num_iterations=2, el=el)
    tr.train()
    assert tr._el_fused is False
    t = _rows(tmp_path / "attr")
    _check_bounds(t)
    _check_closed_form(t, cls.snaps)
    ref = pd.concat(cls.snaps).drop_duplicates(["step", "seq", "pos"])
    j = t.merge(ref, on=["step", "seq", "pos"], how="left", validate="one_to_one")
    assert j["entropy_effect"].notna().all()
    np.testing.assert_allclose(j["entropy_effect"], j["grad_coef"] * j["ref_sens"], rtol=2e-4, atol=1e-8)
    assert (j["ref_sens"].abs() > 1e-3).mean() > 0.5  # a test that can fail: s is not ~0 everywhere
    steps = connect(tmp_path / "attr").execute("SELECT * FROM steps ORDER BY step").df()
    sums = t.groupby("step")["entropy_effect"].sum()
    np.testing.assert_allclose(steps.groupby("step")["entropy_effect"].sum(), sums, rtol=1e-4, atol=1e-7)
    dropped = t["entropy_effect_dropped"]
    if loss is None:  # TRL's own loss: its unclipped coefficient is unknown, so nothing is claimed
        assert dropped.isna().all()
    else:  # CE-GPPO: set exactly on the tokens whose gradient clipping / beta changed
        assert t["clipped"].sum() >= 3  # the second iteration is off-policy enough to clip some tokens
        assert (dropped.notna() == t["clipped"]).all()


def test_trl_ce_gppo_ga2_grad_coef_includes_the_accumulation_scale(tmp_path):
    cls = _snapshot_class()
    trl_tiny.trainer(tmp_path, "ce", cls=cls, max_steps=1, el=dict(loss="ce_gppo")).train()
    t = _rows(tmp_path / "ce")
    _check_bounds(t)
    _check_closed_form(t, cls.snaps)
    # on-policy: g = -A r = -A, normalised as TRL's dapo: by the tokens of the accumulation window (both
    # micro-batches of the step: GA 2 = steps_per_generation)
    n = t.groupby("step")["seq"].transform("size")
    np.testing.assert_allclose(t["grad_coef"], -t["advantage"] / n, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("attribution", [False, True])
def test_trl_peft_lora_with_kl_old_entropy_is_the_policy_not_the_reference(tmp_path, attribution):
    # attribution=True runs every pass (policy, old policy, reference with adapters off) through head_stats
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    tr = trl_tiny.trainer(
        tmp_path,
        "lora",
        peft_config=lora,
        beta=0.04,
        num_iterations=2,
        max_steps=3,
        learning_rate=5e-2,
        el=dict(attribution=attribution),
    )
    tr.train()
    t = _rows(tmp_path / "lora")
    assert t["entropy_effect"].notna().all() if attribution else t["entropy_effect"].isna().all()
    # generation every 2 optimizer steps (GA 2, num_iterations 2): step 2, update 0 is a fresh batch
    fresh = t[(t["step"] == 2) & (t["update"] == 0)]
    same = fresh[fresh["ratio"] == 1.0]
    assert len(same) > 0
    np.testing.assert_array_equal(same["entropy_ratio"].to_numpy(), 1.0)
    np.testing.assert_array_equal(same["entropy"], same["old_entropy"])
    # ... while the reference (adapters off) has moved away from the policy by then
    kl = [h["kl"] for h in tr.state.log_history if "kl" in h]
    assert kl[2] > 1e-6
    # reused batch (step 1 / 3): old != new
    assert (t.loc[t["step"] == 1, "entropy_ratio"] - 1).abs().max() > 1e-6


@pytest.mark.parametrize("loss_type,level", [("cispo", "token"), ("sapo", "token"), ("grpo", "sequence")])
def test_trl_non_ppo_loss_types_write_their_own_clip_definition(tmp_path, loss_type, level):
    kw = dict(epsilon_high=5.0) if loss_type == "cispo" else {}
    trl_tiny.trainer(
        tmp_path,
        "r",
        loss_type=loss_type,
        importance_sampling_level=level,
        num_iterations=2,
        max_steps=2,
        learning_rate=5e-2,
        **kw,
    ).train()
    t = _rows(tmp_path / "r")
    assert len(t) > 0
    if loss_type in ("cispo", "sapo"):
        assert not t["clipped"].any()  # their gradient is never removed
        if loss_type == "sapo":
            assert (t["clip"] == 0).all()
        else:
            np.testing.assert_array_equal(t["clip"], np.where(t["ratio"] > 5.0, 1, 0))
    else:  # clipping acts on the sequence ratio exp(mean_t log r), the same for every token of a sequence
        assert (t.groupby(["step", "update", "seq"])["clip"].nunique() == 1).all()
        seq_r = np.exp(
            t.groupby(["step", "update", "seq"])["logprob"].transform("mean")
            - t.groupby(["step", "update", "seq"])["old_logprob"].transform("mean")
        )
        np.testing.assert_array_equal(t["clip"], np.where(seq_r < 0.8, -1, np.where(seq_r > 1.2, 1, 0)))
    _check_bounds(t)


def test_trl_fallback_head_stats_matches_trl_fused_head(tmp_path):
    fused = trl_tiny.trainer(tmp_path, "fused", max_steps=1)
    fused.train()
    fb = trl_tiny.trainer(tmp_path, "fallback", max_steps=1)
    fb._el_fused = False  # as for a model TRL's fused head is not on
    with pytest.warns(UserWarning, match="head_stats"):
        fb.train()
    a, b = _rows(tmp_path / "fused"), _rows(tmp_path / "fallback")
    assert len(a) == len(b) > 0
    for c in ("logprob", "entropy", "grad_coef", "logit_grad_norm"):
        np.testing.assert_allclose(b[c], a[c], rtol=1e-4, atol=1e-6)


def test_trl_loss_swap_refuses_only_an_unknown_loss_type(tmp_path):
    # every GRPOConfig option composes with loss=... (tests/integrations/test_trl_options.py); a loss_type whose
    # normalisation entropylens does not know is the one refusal left, before anything is built
    from types import SimpleNamespace

    from entropylens.integrations.trl import unsupported_trl_options

    assert unsupported_trl_options(SimpleNamespace(loss_type="dapo", beta=0.04, top_entropy_quantile=0.2)) == []
    assert "loss_type='new_loss'" in unsupported_trl_options(SimpleNamespace(loss_type="new_loss"))[0]


@pytest.mark.slow
def test_trl_two_processes(tmp_path):
    child = Path(__file__).parent.parent / "helpers" / "trl_two_ranks.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(child),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    runs = [p for p in tmp_path.iterdir() if (p / "run.json").is_file()]
    assert len(runs) == 1  # one run id agreed by both ranks
    run = runs[0]
    for table in ("tokens", "sequences", "steps"):
        assert {p.name for p in run.glob(f"{table}/step=*/rank=*")} == {"rank=0", "rank=1"}
    con = connect(run)
    seqs = con.execute("SELECT seq, rank, step, reward FROM sequences").df()
    assert seqs["seq"].is_unique and set(seqs["rank"]) == {0, 1}
    tok = con.execute("SELECT rank, seq, count(*) AS n FROM tokens GROUP BY rank, seq").df()
    assert set(tok["seq"]) <= set(seqs["seq"])
    assert (tok.merge(seqs, on="seq")["rank_x"] == tok.merge(seqs, on="seq")["rank_y"]).all()
    # token counts add up: the exact step aggregates count every recorded row
    n_steps = con.execute("SELECT sum(n_tokens) FROM steps").fetchone()[0]
    assert n_steps == con.execute("SELECT count(*) FROM tokens").fetchone()[0] > 0
    # the run's reward is the mean over its sequences (both ranks), not one rank's step mean
    summary = run_analysis(con, "run_summary")
    last = seqs[seqs["step"] == seqs["step"].max()]
    assert summary["final_reward"].iloc[0] == pytest.approx(last["reward"].mean(), rel=1e-6)
    gn = run_analysis(con, "grad_norm_by_step")
    assert (gn["updates"] == 2).all()  # gradient_accumulation_steps micro-batches, counted once per rank
    # every rank's own status file; the run is finished because both ranks are
    assert sorted(p.name for p in (run / "ranks").iterdir()) == ["rank-0.json", "rank-1.json"]
    assert con.execute("SELECT status FROM runs").fetchone()[0] == "finished"


def test_trl_sum_p_squared_asked_only_in_the_training_pass(tmp_path, monkeypatch):
    # sum_j p_j^2 (log_sum_sq_probs, one more reduction per tile of TRL's fused head) feeds only the
    # training pass's logit_grad_norm: the old-policy and reference passes run TRL's own head
    import trl.trainer.utils as tu

    real = tu._ChunkedLogProbFunction
    calls = []

    class Spy:
        @staticmethod
        def apply(*args):
            calls.append((torch.is_grad_enabled(), "log_sum_sq_probs" in args[-1]))
            return real.apply(*args)

    from peft import LoraConfig

    monkeypatch.setattr(tu, "_ChunkedLogProbFunction", Spy)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    tr = trl_tiny.trainer(tmp_path, "sq", peft_config=lora, beta=0.04, num_iterations=2, max_steps=2)
    tr.train()
    grad = [sq for g, sq in calls if g]
    nograd = [sq for g, sq in calls if not g]
    assert grad and nograd  # training passes, and old-policy / reference passes
    assert all(grad) and not any(nograd)
    t = _rows(tmp_path / "sq")
    assert t["logit_grad_norm"].notna().all() and (t["old_entropy"] > 0).all()


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_trl_at_its_defaults_is_on_policy_and_says_so(tmp_path, num_iterations):
    """TRL's defaults (num_iterations 1, steps_per_generation = gradient_accumulation_steps) keep no old
    log-probs: every ratio is 1. The trainer warns once, and `check` notes on_policy; num_iterations 2 neither."""
    import warnings

    from entropylens.report.checks import notes
    from entropylens.report.run_findings import ON_POLICY_TEXT

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr = trl_tiny.trainer(tmp_path, "r", max_steps=2, num_iterations=num_iterations)
        tr.train()
    said = [str(w.message) for w in caught if "on_policy" in str(w.message)]
    found = [f for f in notes(tmp_path / "r") if f.rule == "on_policy"]
    ratios = (
        connect(tmp_path / "r").execute("SELECT count(*), count(*) FILTER (WHERE ratio <> 1) FROM tokens").fetchone()
    )
    if num_iterations == 1:
        assert len(said) == 1 and ON_POLICY_TEXT in said[0], said
        assert [f.signal for f in found] == [ON_POLICY_TEXT] and ratios[0] > 0 and ratios[1] == 0
    else:
        assert said == [] and found == [] and ratios[1] > 0
