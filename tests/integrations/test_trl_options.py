"""TRL's own GRPOTrainer is the oracle: entropylens' loss="grpo" / "dapo" under TRL's options (KL with
and without bias correction, the top-entropy mask, the off-policy mask, delta, sequence-level importance
sampling, the static and adaptive entropy bonus, the vLLM importance-sampling weight, the MoE aux loss),
normalised as the configured loss_type, ends with the same weights as TRL's own loss on the same run
(same seed, SGD: weights differ only where gradients do). Then CE-GPPO / GPPO / ERC train under the same
options. Real TRL 1.16, a tiny Qwen2 from a config saved to disk (TRL builds the KL reference from it),
a local tokenizer, CPU."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from entropylens.read.query import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
import trl_tiny  # noqa: E402

# A run with GA 2, num_iterations 2, KL beta 0.04, top_entropy_quantile 0.2. Four optimizer
# steps = two generations, each used by two iterations (steps 1 and 3 update with old != current).
BASE = dict(
    gradient_accumulation_steps=2,
    num_iterations=2,
    beta=0.04,
    top_entropy_quantile=0.2,
    max_steps=4,
    optim="sgd",
    learning_rate=0.5,
    max_completion_length=12,
    per_device_train_batch_size=4,
)
TOL = 1e-5  # relative difference per tensor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model on disk: TRL builds the KL reference model from its path (no download)."""
    d = tmp_path_factory.mktemp("model")
    tok = trl_tiny.trl_grpo.build_tokenizer()
    trl_tiny.trl_grpo.build_model(tok, 0).save_pretrained(d)
    return str(d)


class _VllmWeight:
    """Stands in for vLLM's sampler only: a seeded importance-sampling ratio per token (what TRL computes
    from vLLM's logprobs, in [0.5, 1.5]) is put in the batch, and ``use_vllm`` is on while the loss runs,
    so TRL's own loss and entropylens' read the same weight (vLLM cannot run here). ``level``: a [B, T]
    weight (TRL's token_* modes) or a [B, 1] one (its sequence_truncate / sequence_mask modes)."""

    level = "token"

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        g = torch.Generator().manual_seed(int(out["completion_ids"].sum()))
        b, t = out["completion_ids"].shape
        out["importance_sampling_ratio"] = 0.5 + torch.rand((b, t if self.level == "token" else 1), generator=g)
        return out

    def _compute_loss(self, model, inputs):
        self.use_vllm, self.vllm_importance_sampling_correction = True, True
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.use_vllm = False


def _train(out, run, model_dir, el_loss=None, vllm_weight=False, model=None, **opts):
    from entropylens.integrations.trl import EntropyLensGRPOTrainer

    level = vllm_weight if isinstance(vllm_weight, str) else "token"
    cls = type("VllmWeighted", (_VllmWeight, EntropyLensGRPOTrainer), {"level": level}) if vllm_weight else None
    cfg = {**BASE, **opts}
    tr = trl_tiny.trainer(
        out,
        run,
        cls=cls,
        model=model if model is not None else model_dir,
        el=dict(loss=el_loss) if el_loss else None,
        **cfg,
    )
    tr.train()
    return tr, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def _rel_diffs(a: dict, b: dict) -> dict:
    return {k: float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-30)) for k in a}


def _assert_same_weights(a, b):
    d = _rel_diffs(a, b)
    worst = max(d, key=d.get)
    assert d[worst] <= TOL, f"{worst}: relative difference {d[worst]:.2e} > {TOL}"


def _moved(start_dir, w):
    from transformers import AutoModelForCausalLM

    w0 = AutoModelForCausalLM.from_pretrained(start_dir).state_dict()
    return max(v for k, v in _rel_diffs(w, w0).items() if w0[k].norm() > 0)  # (zero-initialised biases aside)


def test_dapo_equals_trls_dapo_at_ga2_two_iterations_kl_and_top_entropy(tmp_path, model_dir):
    trl_tr, trl_w = _train(tmp_path, "trl", model_dir, loss_type="dapo")
    el_tr, el_w = _train(tmp_path, "el", model_dir, el_loss="dapo", loss_type="dapo")
    assert _moved(model_dir, el_w) > 1e-3  # the runs trained: equal weights are not the start
    _assert_same_weights(el_w, trl_w)
    # micro-batches of one window differ in length, so a per-micro-batch token mean would differ
    t = connect(tmp_path / "el").execute('SELECT step, "update", count(*) n FROM tokens GROUP BY ALL').df()
    assert t.groupby("step")["n"].nunique().max() > 1
    cfg = json.loads((tmp_path / "el" / "run.json").read_text())["config"]
    assert cfg["trl_loss_type"] == "dapo" and "num_items_in_batch" in cfg["trl_normalisation"]
    assert cfg["trl_options"]["top_entropy_quantile"] == 0.2 and cfg["trl_options"]["beta"] == 0.04
    # the top-entropy mask is recorded per token: about 20% of the tokens kept (ties aside), both runs
    for run in ("el", "trl"):
        kept = connect(tmp_path / run).execute("SELECT avg(token_kept::int) FROM tokens").fetchone()[0]
        assert 0.1 < kept < 0.4, (run, kept)
    # the KL to the reference model (what beta penalises) is a steps column: 0 at step 0 (the policy is
    # the reference until the first optimizer step), then what TRL logs as kl (TRL averages its
    # micro-batches' token means, the column weighs every token alike: close, not equal)
    for run, tr in (("el", el_tr), ("trl", trl_tr)):
        kl = (
            connect(tmp_path / run)
            .execute("SELECT step, max(kl_ref) FROM steps GROUP BY step ORDER BY step")
            .fetchall()
        )
        assert [s for s, _ in kl] == [0, 1, 2, 3] and kl[0][1] == 0.0 and all(v > 0 for _, v in kl[1:]), kl
        logged = [h["kl"] for h in tr.state.log_history if "kl" in h]
        np.testing.assert_allclose([v for _, v in kl[1:]], logged[1:], rtol=0.2)
    # TRL's own metrics keep their curves with loss=...: entropy and kl logged at every step
    for key in ("entropy", "kl", "clip_ratio/region_mean"):
        assert sum(key in h for h in el_tr.state.log_history) == BASE["max_steps"], key
        np.testing.assert_allclose(
            [h[key] for h in el_tr.state.log_history if key in h],
            [h[key] for h in trl_tr.state.log_history if key in h],
            rtol=1e-4,
            atol=1e-7,
        )


def test_the_comparison_can_fail_bnpo_normalises_per_micro_batch(tmp_path, model_dir):
    # the same run under TRL's bnpo (token mean per micro-batch: entropylens' old normalisation) ends
    # far from TRL's dapo: the tolerance above separates the two objectives
    _, dapo_w = _train(tmp_path, "dapo", model_dir, loss_type="dapo")
    _, bnpo_w = _train(tmp_path, "bnpo", model_dir, loss_type="bnpo")
    assert max(_rel_diffs(bnpo_w, dapo_w).values()) > 100 * TOL


@pytest.mark.slow
def test_grpo_equals_trls_grpo_at_ga2_two_iterations_kl_and_top_entropy(tmp_path, model_dir):
    _, trl_w = _train(tmp_path, "trl", model_dir, loss_type="grpo")
    _, el_w = _train(tmp_path, "el", model_dir, el_loss="grpo", loss_type="grpo")
    _assert_same_weights(el_w, trl_w)


# each of TRL's options on top of the base run, entropylens' grpo / dapo against TRL's loss_type
OPTIONS = {
    "bias_corrected_kl": dict(use_bias_correction_kl=True),
    "no_kl": dict(beta=0.0, top_entropy_quantile=1.0),
    "off_policy_mask": dict(off_policy_mask_threshold=0.0),
    "delta": dict(delta=1.3, epsilon=0.1),
    "sequence_level": dict(importance_sampling_level="sequence", epsilon=1e-3),  # small: sequences clip
    "entropy_bonus": dict(entropy_coef=0.05),
    "adaptive_entropy": dict(use_adaptive_entropy=True, entropy_target=10.0, entropy_coef=0.0, entropy_coef_delta=0.02),
    "vllm_is_weight": dict(vllm_weight=True),
    "vllm_is_weight_sequence": dict(vllm_weight="sequence"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence"),
}


# the option acted in the run (so equal weights are not two runs that ignored it): SQL over the
# entropylens run's tokens / steps that is true only where the option changed something
ACTED = {
    "off_policy_mask": "SELECT bool_or(NOT seq_kept) FROM tokens",
    "delta": "SELECT bool_or(dual_clipped) FROM tokens",
    "sequence_level": "SELECT bool_or(clipped) FROM tokens",
    "entropy_bonus": "SELECT bool_and(entropy_coef = 0.05) FROM steps",
    "vllm_is_weight": "SELECT bool_and(is_weight BETWEEN 0.5 AND 1.5) AND count(is_weight) = count(*) FROM tokens",
    "vllm_is_weight_sequence": """SELECT bool_and(lo BETWEEN 0.5 AND 1.5) AND max(hi - lo) = 0 AND bool_and(n = k)
                                         AND count(DISTINCT lo) > 1
                                  FROM (SELECT min(is_weight) lo, max(is_weight) hi, count(is_weight) n, count(*) k
                                        FROM tokens GROUP BY step, "update", seq)""",
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_trl_option_composes_and_equals_trls_own_loss(tmp_path, model_dir, name):
    opts = {"loss_type": "dapo", **OPTIONS[name]}
    method = "grpo" if opts["loss_type"] != "dapo" else "dapo"
    _, trl_w = _train(tmp_path, "trl", model_dir, max_steps=2, **opts)
    el_tr, el_w = _train(tmp_path, "el", model_dir, el_loss=method, max_steps=2, **opts)
    _assert_same_weights(el_w, trl_w)
    if name in ACTED:
        assert connect(tmp_path / "el").execute(ACTED[name]).fetchone()[0], name
    if name == "adaptive_entropy":  # the controller moved the coefficient, as TRL's does
        coefs = [h["entropy_coef"] for h in el_tr.state.log_history if "entropy_coef" in h]
        assert coefs and max(coefs) > 0


def _moe(model_dir):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tok = trl_tiny.trl_grpo.build_tokenizer()
    torch.manual_seed(0)
    moe = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=16,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            pad_token_id=tok.pad_token_id,
            output_router_logits=True,
            router_aux_loss_coef=0.01,
        )
    )
    d = Path(model_dir).parent / "moe"
    if not d.exists():
        moe.save_pretrained(d)
    return str(d)


@pytest.mark.slow
def test_moe_router_aux_loss_composes_and_equals_trls(tmp_path, model_dir):
    moe = _moe(model_dir)
    _, trl_w = _train(tmp_path, "trl", model_dir, model=moe, max_steps=2, beta=0.0)
    _, el_w = _train(tmp_path, "el", model_dir, model=moe, el_loss="dapo", max_steps=2, beta=0.0)
    _assert_same_weights(el_w, trl_w)


@pytest.mark.parametrize("loss", ["ce_gppo", "gppo"])
def test_ce_gppo_and_gppo_train_with_erc_under_every_option(tmp_path, model_dir, loss):
    # the options users run with, all on at once: KL (bias-corrected), top-entropy mask, off-policy mask,
    # delta, entropy bonus, the vLLM IS weight; CE-GPPO with ERC on top
    from entropylens.integrations.trl import EntropyLensGRPOTrainer

    cls = type("VllmWeighted", (_VllmWeight, EntropyLensGRPOTrainer), {})
    tr = trl_tiny.trainer(
        tmp_path,
        "all",
        cls=cls,
        model=model_dir,
        **{**BASE, "max_steps": 2},
        use_bias_correction_kl=True,
        off_policy_mask_threshold=0.0,
        delta=1.5,
        entropy_coef=0.01,
        el=dict(loss=loss, erc=(0.9, 1.1)),
    )
    tr.train()
    con = connect(tmp_path / "all")
    t = con.execute("SELECT * FROM tokens").df()
    assert len(t) > 0 and t["token_kept"].notna().all() and t["seq_kept"].notna().all()
    assert t["is_weight"].between(0.5, 1.5).all()
    assert t["erc_kept"].notna().all()
    # a token outside the top-entropy mask or in a dropped sequence carries no policy gradient: its
    # grad_coef is the KL term's alone, beta * w * d k3 / dlogp-sized, far below the kept tokens'
    masked = t[~t["token_kept"]]
    assert len(masked) > 0
    s = con.execute("SELECT * FROM steps").df()
    assert (s["erc_low"] == 0.9).all() and (s["kl_coef"] == 0.04).all()
    assert s["entropy_coef"].notna().all()
    # with an entropy bonus the closed-form logit-gradient norm would be wrong: left empty
    assert t["logit_grad_norm"].isna().all()


def test_texts_and_the_tokenizer_are_kept(tmp_path, model_dir):
    tr = trl_tiny.trainer(tmp_path, "txt", model=model_dir, max_steps=1)
    tr.train()
    seqs = connect(tmp_path / "txt").execute("SELECT * FROM sequences").df()
    assert seqs["text"].notna().all() and (seqs["text"].str.len() > 0).any()
    # the stored text is the decoding of the recorded token ids
    tok = trl_tiny.trl_grpo.build_tokenizer()
    first = seqs.iloc[0]
    ids = (
        connect(tmp_path / "txt")
        .execute('SELECT token_id FROM tokens WHERE seq = ? AND "update" = 0 ORDER BY pos', [int(first["seq"])])
        .df()
    )
    assert tok.decode(ids["token_id"].tolist(), skip_special_tokens=True) == first["text"]
    # a tokenizer built in memory has no name to load: the run keeps a copy, and run.json says where
    cfg = json.loads((tmp_path / "txt" / "run.json").read_text())["config"]
    assert cfg["tokenizer"]["saved"] == "tokenizer"
    from transformers import AutoTokenizer

    back = AutoTokenizer.from_pretrained(str(tmp_path / "txt" / "tokenizer"))
    assert back.decode(ids["token_id"].tolist(), skip_special_tokens=True) == first["text"]


@pytest.mark.parametrize("loss", [None, "ce_gppo"])
def test_entropy_bonus_leaves_entropy_effect_null_with_attribution(tmp_path, model_dir, loss):
    # TRL's entropy bonus reaches the logits through H, a term the TRL path does not measure: with
    # attribution=True the tokens' entropy_effect and the steps' budget stay null (as in the torch helper
    # and verl)
    tr = trl_tiny.trainer(
        tmp_path,
        "bonus",
        model=model_dir,
        **{**BASE, "max_steps": 2},
        entropy_coef=0.05,
        el=dict(attribution=True, **({"loss": loss} if loss else {})),
    )
    tr.train()
    con = connect(tmp_path / "bonus")
    n, eff = con.execute("SELECT count(*), count(entropy_effect) FROM tokens").fetchone()
    assert n > 0 and eff == 0
    coef, budget = con.execute("SELECT min(entropy_coef), count(entropy_effect) FROM steps").fetchone()
    assert coef == pytest.approx(0.05) and budget == 0


@pytest.mark.slow
def test_dapo_equals_trls_dapo_over_two_processes(tmp_path, model_dir):
    # two processes: dapo's normaliser is num_items_in_batch (both ranks' tokens) / processes, and the
    # top-entropy quantile is taken over both ranks' entropies (TRL's get_high_entropy_mask gathers them)
    import os
    import subprocess

    child = Path(__file__).parent.parent / "helpers" / "trl_two_ranks_oracle.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    w = {}
    for loss in ("trl", "dapo"):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                str(child),
                str(tmp_path / loss),
                model_dir,
                loss,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert r.returncode == 0, r.stderr[-4000:]
        w[loss] = torch.load(tmp_path / loss / "weights.pt")
        con = connect(tmp_path / loss / "r")
        assert {x for (x,) in con.execute("SELECT DISTINCT rank FROM tokens").fetchall()} == {0, 1}
        kept = con.execute("SELECT avg(token_kept::int) FROM tokens").fetchone()[0]
        assert 0.1 < kept < 0.4, (loss, kept)
    assert _moved(model_dir, w["dapo"]) > 1e-3
    _assert_same_weights(w["dapo"], w["trl"])


@pytest.mark.parametrize(
    "opts",
    [dict(), dict(importance_sampling_level="sequence", sapo_temperature_pos=0.8, sapo_temperature_neg=1.3)],
    ids=["token", "sequence-temps"],
)
def test_sapo_equals_trls_sapo_and_records_its_gate(tmp_path, model_dir, opts):
    """loss="sapo" under TRL's loss_type="sapo" with the base run's options (GA 2, two iterations, KL, the
    top-entropy mask; then sequence-level ratios and other temperatures) ends with TRL's own sapo weights;
    every token row has its gate weight (sapo_weight, < 1 off r = 1), none is clipped, and steps carry
    sapo_weight_mean."""
    _, trl_w = _train(tmp_path, "trl", model_dir, loss_type="sapo", max_steps=2, **opts)
    _, el_w = _train(tmp_path, "el", model_dir, el_loss="sapo", loss_type="sapo", max_steps=2, **opts)
    assert _moved(model_dir, el_w) > 1e-4
    _assert_same_weights(el_w, trl_w)
    con = connect(tmp_path / "el")
    n, n_w, lo, clipped = con.execute(
        "SELECT count(*), count(sapo_weight), min(sapo_weight), count(*) FILTER (clipped) FROM tokens"
    ).fetchone()
    assert n > 0 and n_w == n and 0.0 < lo < 1.0 and clipped == 0
    means = con.execute("SELECT sapo_weight_mean FROM steps WHERE n_tokens > 0").fetchall()
    assert means and all(0.0 < m <= 1.0 for (m,) in means)
    # step 1 updates with old != current (second iteration): the gate acted there
    assert con.execute("SELECT min(sapo_weight_mean) FROM steps WHERE step = 1 AND n_tokens > 0").fetchone()[0] < 1.0
    cfg = json.loads((tmp_path / "el" / "run.json").read_text())
    assert cfg["loss"]["sapo_tau_pos"] == opts.get("sapo_temperature_pos", 1.0)


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov"])
def test_clip_cov_and_kl_cov_train_under_trls_options(tmp_path, model_dir, loss):
    # Clip-Cov / KL-Cov with KL, the top-entropy mask and the vLLM IS weight: the columns are there and
    # agree with each other (cov over each update's tokens, the step share = the tokens' share, a
    # Clip-Cov token has no policy gradient)
    from entropylens.integrations.trl import EntropyLensGRPOTrainer

    cls = type("VllmWeighted", (_VllmWeight, EntropyLensGRPOTrainer), {})
    cov = (
        {"clip_cov_ratio": 0.2, "clip_cov_lb": 0.0} if loss == "clip_cov" else {"kl_cov_ratio": 0.2, "ppo_kl_coef": 0.5}
    )
    tr = trl_tiny.trainer(
        tmp_path, "cov", cls=cls, model=model_dir, **{**BASE, "max_steps": 2, "beta": 0.0}, el=dict(loss=loss, cov=cov)
    )
    tr.train()
    con = connect(tmp_path / "cov")
    t = con.execute("SELECT * FROM tokens").df()
    col, frac = ("cov_clipped", "cov_clipped_frac") if loss == "clip_cov" else ("kl_cov_penalised", "kl_cov_frac")
    other = "kl_cov_penalised" if loss == "clip_cov" else "cov_clipped"
    assert len(t) > 0 and t["cov"].notna().all() and t[col].notna().all() and t[other].isna().all()
    assert t[col].any()
    for (_, _), g in t.groupby(["step", "update"]):
        a, lp = g["advantage"].to_numpy(np.float64), g["logprob"].to_numpy(np.float64)
        np.testing.assert_allclose(g["cov"], (a - a.mean()) * (lp - lp.mean()), rtol=1e-4, atol=1e-5)
    s = con.execute("SELECT step, update, " + frac + " FROM steps").df()
    share = t.groupby(["step", "update"])[col].mean().reset_index()
    merged = s.merge(share, on=["step", "update"])
    assert len(merged) == len(s) and np.allclose(merged[frac], merged[col])
    if loss == "clip_cov":
        assert (t.loc[t["cov_clipped"], "grad_coef"] == 0).all()
        assert not (t["cov_clipped"] & t["clipped"]).any()
