"""TRL 1.16's vLLM importance-sampling correction, fed sampling log-probs without a vLLM server: only the
generation step is patched (HF generate, then the sampler's per-token log-probs shaped as vLLM gives them:
one list of floats per completion, None where it did not score a token), so TRL's own code computes the
IS ratio, masks / truncates, and logs sampling/*. The recorded mismatch figures equal TRL's logged
metrics on the same batch (one micro-batch per generation, so a steps row is TRL's whole batch)."""

import math
import sys
from pathlib import Path

import pytest
import torch

from entropylens.read.query import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
import trl_tiny  # noqa: E402

CFG = dict(gradient_accumulation_steps=1, per_device_train_batch_size=8, max_steps=2, max_completion_length=8)


class _Sampler:
    """A sampler that differs from the trainer: the trainer's own log-prob of each generated token plus
    seeded N(0, 0.5) noise, one token a completion unscored (None, as vLLM's NaN)."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        self.use_vllm = False  # HF generate for the token ids
        try:
            completion_ids, _ = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        finally:
            self.use_vllm = True
        g = torch.Generator().manual_seed(int(self.state.global_step) + 1)
        prompts = (
            [p for p in prompt_ids for _ in range(num_generations)]
            if len(prompt_ids) != len(completion_ids)
            else prompt_ids
        )
        logps = []
        with torch.no_grad():
            for p, c in zip(prompts, completion_ids):
                ids = torch.tensor([list(p) + list(c)])
                logits = self.model(ids).logits[0, len(p) - 1 : -1].float() / self.temperature  # [len(c), V]
                lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)
                lp = lp + 0.5 * torch.randn(lp.shape, generator=g)
                vals = lp.tolist()
                if vals:
                    vals[len(vals) // 2] = None
                logps.append(vals)
        return completion_ids, logps


def _train(tmp_path, mode, **opts):
    from entropylens.integrations.trl import EntropyLensGRPOTrainer

    cls = type("Sampled", (_Sampler, EntropyLensGRPOTrainer), {})
    tr = trl_tiny.trainer(
        tmp_path,
        "mm",
        cls=cls,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=mode,
        **{**CFG, **opts},
    )
    tr.use_vllm = True  # after __init__: no vLLM engine is built
    tr.train()
    return tr, connect(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_trl_vllm_is_metrics_equal_recorded(tmp_path, mode):
    tr, con = _train(tmp_path, mode, vllm_importance_sampling_clip_min=0.7, vllm_importance_sampling_clip_max=1.4)
    rows = con.execute(
        "SELECT step, sampler_abs_log_ratio_mean, sampler_abs_log_ratio_max, is_masked_frac FROM steps ORDER BY step"
    ).fetchall()
    logged = [e for e in tr.state.log_history if "sampling/sampling_logp_difference/mean" in e]  # TRL's, per step
    assert len(rows) == len(logged) == 2
    worst = 0.0
    for (step, mean, mx, masked_frac), logs in zip(rows, logged):
        for ours, theirs in (
            (mean, logs["sampling/sampling_logp_difference/mean"]),
            (mx, logs["sampling/sampling_logp_difference/max"]),
        ):
            worst = max(worst, abs(ours - theirs) / abs(theirs))
        w = con.execute(
            "SELECT min(is_weight), avg(is_weight), max(is_weight), count(*) - count(sampler_logprob), "
            "count(*) FILTER (WHERE is_masked) FROM tokens WHERE step = ?",
            [step],
        ).fetchone()
        for ours, key in zip(w[:3], ("min", "mean", "max")):
            theirs = logs[f"sampling/importance_sampling_ratio/{key}"]
            worst = max(worst, abs(ours - theirs) / max(abs(theirs), 1e-12))
        assert w[3] >= 1  # the unscored tokens are null, not 0
        if mode == "token_mask":  # masked = the ratio exp(d) outside [0.7, 1.4], d = 0 where unscored
            want = con.execute(
                "SELECT count(*) FILTER (WHERE exp(coalesce(sampler_log_ratio, 0)) NOT BETWEEN 0.7 AND 1.4)"
                " FROM tokens WHERE step = ?",
                [step],
            ).fetchone()[0]
            assert w[4] == want > 0
            n = con.execute("SELECT count(*) FROM tokens WHERE step = ?", [step]).fetchone()[0]
            assert masked_frac == pytest.approx(want / n, rel=1e-6)
        else:
            assert masked_frac is None and w[4] == 0
    print(f"{mode}: max relative difference to TRL's sampling/* metrics {worst:.2e}")
    assert worst <= 1e-5
    # k1 / k3 by hand from the token rows (float64 SQL over the float32 columns)
    k = con.execute(
        "SELECT avg(-sampler_log_ratio), avg(exp(sampler_log_ratio) - sampler_log_ratio - 1) FROM tokens WHERE step = 0"
    ).fetchone()
    got = con.execute("SELECT sampler_kl_k1, sampler_kl_k3 FROM steps WHERE step = 0").fetchone()
    assert got == pytest.approx(k, rel=1e-4) and not any(math.isnan(x) for x in got)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_trl_sequence_level_is_equal_recorded(tmp_path, mode):
    """TRL's sequence modes: one ratio a completion, exp(sum over its tokens of d), d = old - sampler (0 where
    unscored), truncated to [lo, hi] or set to 0 outside it; its sampling/importance_sampling_ratio/* are
    over the completions ([B, 1]), and every token of a completion records its completion's weight."""
    lo, hi = 0.5, 2.0
    tr, con = _train(tmp_path, mode, vllm_importance_sampling_clip_min=lo, vllm_importance_sampling_clip_max=hi)
    logged = [e for e in tr.state.log_history if "sampling/sampling_logp_difference/mean" in e]
    rows = con.execute(
        "SELECT step, sampler_abs_log_ratio_mean, sampler_abs_log_ratio_max, is_masked_frac FROM steps ORDER BY step"
    ).fetchall()
    assert len(rows) == len(logged) == 2
    worst, outside_seen, inside_seen = 0.0, 0, 0
    for (step, mean, mx, masked_frac), logs in zip(rows, logged):
        for ours, theirs in (
            (mean, logs["sampling/sampling_logp_difference/mean"]),
            (mx, logs["sampling/sampling_logp_difference/max"]),
        ):
            worst = max(worst, abs(ours - theirs) / abs(theirs))
        seqs = con.execute(
            "SELECT min(is_weight), max(is_weight), sum(coalesce(sampler_log_ratio, 0)), "
            "count(*) FILTER (WHERE is_masked), count(*) FROM tokens WHERE step = ? "
            "GROUP BY update, seq ORDER BY update, seq",
            [step],
        ).fetchall()
        assert len(seqs) == CFG["per_device_train_batch_size"]
        weights = []
        for w_min, w_max, d_sum, n_masked, n in seqs:
            assert w_min == w_max  # one weight a completion, on each of its tokens
            raw = math.exp(d_sum)  # the completion's ratio by hand (float64 over the float32 column)
            outside = not lo <= raw <= hi
            want = min(max(raw, lo), hi) if mode == "sequence_truncate" else (0.0 if outside else raw)
            assert w_min == pytest.approx(want, rel=1e-4, abs=1e-6)
            if mode == "sequence_mask":  # all of a completion's tokens masked, or none
                assert n_masked == (n if outside else 0)
            else:
                assert n_masked == 0
            outside_seen += outside
            inside_seen += not outside
            weights.append(w_min)
        for ours, key in ((min(weights), "min"), (sum(weights) / len(weights), "mean"), (max(weights), "max")):
            theirs = logs[f"sampling/importance_sampling_ratio/{key}"]  # TRL's: over completions
            worst = max(worst, abs(ours - theirs) / max(abs(theirs), 1e-12))
        if mode == "sequence_mask":
            n_all = sum(s[4] for s in seqs)
            assert masked_frac == pytest.approx(sum(s[3] for s in seqs) / n_all, rel=1e-6)
        else:
            assert masked_frac is None
    assert outside_seen and inside_seen  # the batch has completions on both sides of the bounds
    print(f"{mode}: max relative difference to TRL's sampling/* metrics {worst:.2e}")
    assert worst <= 1e-5


@pytest.mark.slow
def test_trl_clipped_tokens_mismatched_share(tmp_path):
    """Off-policy updates (num_iterations 2, a tight clip) so PPO-clip acts: steps.clipped_mismatched_frac
    equals the share, over the token rows, of the clipped tokens with a sampler log-prob whose |d| > ln 2
    (schema.MISMATCH_LOG_RATIO), pooled over the step's updates; and the clipped share is TRL's."""
    from entropylens.schema import MISMATCH_LOG_RATIO

    tr, con = _train(
        tmp_path,
        "token_truncate",
        num_iterations=2,
        epsilon=0.02,
        max_steps=4,
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=2.0,
    )
    got = dict(
        con.execute(
            "SELECT step, sum(clipped_mismatched_frac * n_sampled_clipped) / "
            "nullif(sum(n_sampled_clipped), 0) FROM steps GROUP BY step"
        ).fetchall()
    )
    want = dict(
        con.execute(
            "SELECT step, avg(CAST(abs(sampler_log_ratio) > ? AS DOUBLE)) FILTER (WHERE clipped AND sampler_log_ratio "
            "IS NOT NULL) FROM tokens GROUP BY step",
            [MISMATCH_LOG_RATIO],
        ).fetchall()
    )
    clipped = con.execute("SELECT count(*) FILTER (WHERE clipped) FROM tokens").fetchone()[0]
    print(
        f"clipped tokens {clipped}; clipped_mismatched_frac by step {got}; TRL's clip_ratio/region_mean "
        f"{[e['clip_ratio/region_mean'] for e in tr.state.log_history if 'clip_ratio/region_mean' in e]}"
    )
    assert clipped > 0  # PPO-clip acted
    assert set(got) == set(want) and any(v is not None for v in want.values())
    for s in want:
        if want[s] is None:
            assert got[s] is None
        else:
            assert got[s] == pytest.approx(want[s], rel=1e-6)
    # the clipped share (r outside the band on the advantage's side) against TRL's clip_ratio/region_mean
    ours = dict(
        con.execute("SELECT step, sum(clipped_frac * n_tokens) / sum(n_tokens) FROM steps GROUP BY step").fetchall()
    )
    logs = [e for e in tr.state.log_history if "clip_ratio/region_mean" in e]
    assert len(logs) == len(ours) == 4
    for s, e in zip(sorted(ours), logs):
        assert ours[s] == pytest.approx(e["clip_ratio/region_mean"], abs=1e-6)
