"""The Parquet contract: every table's columns, their Arrow dtypes and meanings.

This module is the single source of the table, column, quadrant and clip names; every other
module imports them from here. It imports nothing of the project and pyarrow only lazily
(inside :func:`arrow_type`), so ``entropylens --help`` stays fast.

Versions (numbered, like migrations):
  1  first layout: tables runs / steps / sequences / tokens.
  2  entropy attribution: tokens.entropy_effect / entropy_effect_dropped, the steps' entropy-budget
     sums (entropy_effect_*), table probes (parameter-space probe).
  3  the loss's modifiers: tokens.dual_clipped / token_kept / seq_kept / is_weight, steps.dual_clip_frac /
     token_masked_frac / seq_masked_frac / is_weight_mean; the dropped entropy effect split by cause
     (steps.entropy_effect_dropped_clip_low / _clip_high / _dual_clip / _erc, which add up to
     entropy_effect_dropped). steps.entropy_effect_dropped_erc changed meaning: ERC's own share
     (version 2: the whole dropped effect of the tokens ERC dropped, clipping's part included); readers
     null it for runs of version < 3. tokens.entropy_effect includes an entropy bonus's own term or is
     null (version 2 left the bonus out).
  4  the field's entropy controls: tokens.sapo_weight, steps.sapo_weight_mean (SAPO's soft gate);
     steps.entropy_coef_adaptive (the adaptive entropy controller's coefficient; steps.entropy_coef is
     then the applied one, 0 included); tokens.cov / cov_clipped / kl_cov_penalised, steps.cov_clipped_frac /
     kl_cov_frac / entropy_effect_dropped_clip_cov / entropy_effect_dropped_kl_cov (Clip-Cov, KL-Cov);
     training-inference mismatch: tokens.sampler_logprob / is_masked, the derived tokens.sampler_log_ratio,
     steps.sampler_abs_log_ratio_mean / _max / sampler_kl_k1 / sampler_kl_k3 / is_masked_frac /
     clipped_mismatched_frac / sampler_abs_log_ratio_mean_<quadrant> and their counts n_sampled /
     n_sampled_clipped (the weights that pool them over a step's updates).
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEMA_VERSION = 4
# (table, column) whose meaning changed at a schema version -> that version: readers (query.py, spark.py)
# show it as null in runs written before it, so no query mixes the two meanings
CHANGED_MEANING: dict[tuple[str, str], int] = {("steps", "entropy_effect_dropped_erc"): 3}

# --- quadrant codes (int8) -----------------------------------------------------------------
# Advantage sign x sampling probability (p = exp(old_logprob)) against tau.
ZA, PA_HP, PA_LP, NA_HP, NA_LP = 0, 1, 2, 3, 4
QUADRANT_NAMES: dict[int, str] = {
    ZA: "ZA",  # advantage exactly 0 (a zero-advantage group): never folded into a quadrant
    PA_HP: "PA&HP",  # A > 0, p >= tau: pushes entropy down
    PA_LP: "PA&LP",  # A > 0, p <  tau: pushes entropy up
    NA_HP: "NA&HP",  # A < 0, p >= tau: pushes entropy up
    NA_LP: "NA&LP",  # A < 0, p <  tau: pushes entropy down
}
QUADRANTS: tuple[str, ...] = ("PA&HP", "PA&LP", "NA&HP", "NA&LP")  # the four real quadrants
QUADRANT_CODES: dict[str, int] = {v: k for k, v in QUADRANT_NAMES.items()}
# Sign of the entropy change each quadrant drives (Cui et al. covariance law; CE-GPPO Sec. 3).
ENTROPY_SIGN: dict[str, int] = {"PA&HP": -1, "PA&LP": +1, "NA&HP": +1, "NA&LP": -1}

# --- clip region codes (int8) --------------------------------------------------------------
CLIP_LOW, CLIP_NONE, CLIP_HIGH = -1, 0, 1
CLIP_NAMES: dict[int, str] = {CLIP_LOW: "low", CLIP_NONE: "inside", CLIP_HIGH: "high"}

# --- training-inference mismatch ------------------------------------------------------------
# A token is "mismatched" when the trainer's and the sampler's probabilities of it differ by more than a
# factor 2, |old_logprob - sampler_logprob| > ln 2, or the trainer's IS correction masked it (is_masked):
# steps.clipped_mismatched_frac counts the clipped tokens that are.
MISMATCH_LOG_RATIO = 0.6931471805599453  # ln 2


def quadrant_slug(name: str) -> str:
    """'PA&HP' -> 'pa_hp': the form used inside column and metric names."""
    return name.replace("&", "_").lower()


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str  # Arrow type name: int8/int16/int32/int64/float32/float64/bool/string/dict8
    meaning: str
    derived: str | None = None  # SQL over the stored columns: not in the files, computed by the view


def _c(name: str, dtype: str, meaning: str, derived: str | None = None) -> Column:
    return Column(name, dtype, meaning, derived)


RUNS: tuple[Column, ...] = (
    _c("run", "string", "run id (the run directory's name)"),
    _c("method", "string", "policy loss method (grpo, dapo, gppo, ce_gppo, cispo, gspo, ...)"),
    _c("config", "string", "hyperparameters as JSON (eps, beta1, beta2, erc, lr, ...)"),
    _c("model", "string", "model name or description"),
    _c("seed", "int64", "random seed, if known"),
    _c("world_size", "int32", "number of ranks that recorded"),
    _c("eps_low", "float64", "clip range, low side (as the loss resolved it)"),
    _c("eps_high", "float64", "clip range, high side"),
    _c("tau", "float64", "HP / LP threshold on the sampling probability"),
    _c("sample", "float64", "token-row keep fraction (steps aggregates always cover all tokens)"),
    _c("status", "string", "running / finished / failed (stale: running, but its heartbeat stopped)"),
    _c("started_at", "string", "start time, ISO 8601 UTC"),
    _c("heartbeat_at", "string", "last heartbeat, ISO 8601 UTC"),
    _c("schema_version", "int32", "SCHEMA_VERSION the run was written with"),
    _c("resumes", "int32", "times a job resumed the run (Recorder(resume=K)); run.json lists each one's step and time"),
)

_STEP_KEYS: tuple[Column, ...] = (
    _c("step", "int32", "training step (one rollout batch)"),
    _c("update", "int16", "policy update (mini-batch / optimizer step) within the step"),
    _c("rank", "int16", "torch.distributed rank that recorded the row"),
)

STEPS: tuple[Column, ...] = _STEP_KEYS + (
    _c("loss", "float32", "policy loss of the update"),
    _c("grad_norm", "float32", "global gradient norm before clipping"),
    _c("lr", "float32", "learning rate"),
    _c("n_tokens", "int64", "response tokens in the update (all of them, before sampling)"),
    _c("entropy_mean", "float32", "mean token entropy H(pi_theta) over all tokens, nats"),
    _c("old_entropy_mean", "float32", "mean token entropy H(pi_old) over all tokens, nats"),
    _c("ratio_mean", "float32", "mean importance ratio r = pi_theta / pi_old"),
    _c("clip_low_frac", "float32", "share of tokens with r < 1-eps_low and A < 0 (gradient dropped)"),
    _c("clip_high_frac", "float32", "share of tokens with r > 1+eps_high and A > 0 (gradient dropped)"),
    _c("clipped_frac", "float32", "share of tokens whose gradient PPO-clip removes (low + high)"),
    _c("region_low_frac", "float32", "share of tokens with r < 1-eps_low, any advantage"),
    _c("region_high_frac", "float32", "share of tokens with r > 1+eps_high, any advantage"),
    *(
        _c(f"n_{quadrant_slug(q)}", "int64", f"tokens in quadrant {q}")
        for q in ("PA&HP", "PA&LP", "NA&HP", "NA&LP", "ZA")
    ),
    *(
        _c(f"clip_frac_{quadrant_slug(q)}", "float32", f"share of {q} tokens whose gradient PPO-clip removes")
        for q in QUADRANTS
    ),
    *(
        _c(f"lgn_mean_{quadrant_slug(q)}", "float32", f"mean logit-gradient norm ||dLoss/dz_t|| of {q} tokens")
        for q in QUADRANTS
    ),
    _c("entropy_ratio_p05", "float32", "5th percentile of rho = H(pi_theta)/H(pi_old) over all tokens"),
    _c("entropy_ratio_p50", "float32", "median entropy ratio"),
    _c("entropy_ratio_p95", "float32", "95th percentile of the entropy ratio"),
    _c("erc_drop_frac", "float32", "share of tokens whose gradient ERC removes (rho outside its band)"),
    _c(
        "dual_clip_frac",
        "float32",
        "share of tokens in tokens.dual_clipped: dual-clip's A < 0 and r > c (verl's "
        "pg_clipfrac_lower), or TRL's delta cap; null without dual_clip / delta",
    ),
    _c(
        "token_masked_frac",
        "float32",
        "share of tokens outside the loss's token mask (TRL's top-entropy quantile: "
        "tokens.token_kept false); null without a token mask",
    ),
    _c(
        "seq_masked_frac",
        "float32",
        "share of tokens whose sequence the off-policy sequence mask dropped "
        "(tokens.seq_kept false); null without a sequence mask",
    ),
    _c(
        "is_weight_mean",
        "float32",
        "mean importance-sampling weight (tokens.is_weight, e.g. vLLM's correction) over all tokens; null without one",
    ),
    _c(
        "sapo_weight_mean",
        "float32",
        "mean SAPO gate weight (tokens.sapo_weight) over all tokens; null for other losses",
    ),
    _c(
        "cov_clipped_frac",
        "float32",
        "share of tokens Clip-Cov selected (tokens.cov_clipped: loss and gradient "
        "multiplied by 0; verl's clip_cov pg_clipfrac); null without clip_cov",
    ),
    _c("kl_cov_frac", "float32", "share of tokens KL-Cov penalised (tokens.kl_cov_penalised); null without kl_cov"),
    _c(
        "sampler_abs_log_ratio_mean",
        "float32",
        "mean |old_logprob - sampler_logprob| over the tokens with a "
        "sampler log-prob (TRL's sampling/sampling_logp_difference/mean); null without sampler log-probs",
    ),
    _c(
        "sampler_abs_log_ratio_max",
        "float32",
        "max |old_logprob - sampler_logprob| (TRL's "
        "sampling/sampling_logp_difference/max); null without sampler log-probs",
    ),
    _c(
        "sampler_kl_k1",
        "float32",
        "KL(pi_sampler || pi_old), k1 estimator: mean of sampler_logprob - old_logprob "
        "(verl's rollout_corr/kl); null without sampler log-probs",
    ),
    _c(
        "sampler_kl_k3",
        "float32",
        "KL(pi_sampler || pi_old), k3 estimator: mean of exp(d) - d - 1, d = old_logprob - "
        "sampler_logprob (verl's rollout_corr/k3_kl); null without sampler log-probs",
    ),
    _c(
        "is_masked_frac",
        "float32",
        "share of tokens the IS correction masked (tokens.is_masked: TRL's vLLM *_mask "
        "modes, verl's rollout rejection); null without a masking correction",
    ),
    _c(
        "clipped_mismatched_frac",
        "float32",
        "share of the clipped tokens (tokens.clipped) that are mismatched: "
        "|old_logprob - sampler_logprob| > ln 2 (schema.MISMATCH_LOG_RATIO) or is_masked; null without sampler "
        "log-probs or without clipped tokens",
    ),
    _c(
        "n_sampled",
        "int64",
        "tokens with a sampler log-prob (not NaN): the tokens sampler_abs_log_ratio_mean / "
        "sampler_kl_k1 / sampler_kl_k3 are means over, the weight that pools them over updates; null without "
        "sampler log-probs",
    ),
    _c(
        "n_sampled_clipped",
        "int64",
        "clipped tokens (tokens.clipped) with a sampler log-prob: "
        "clipped_mismatched_frac's denominator, the weight that pools it over updates; null without sampler "
        "log-probs",
    ),
    *(
        _c(
            f"sampler_abs_log_ratio_mean_{quadrant_slug(q)}",
            "float32",
            f"mean |old_logprob - sampler_logprob| of {q} tokens; null without sampler log-probs",
        )
        for q in QUADRANTS
    ),
    _c("kl_k3", "float32", "KL(pi_old || pi_theta), k3 estimator mean of (r - 1) - log r"),
    _c(
        "n_nonfinite_ratio",
        "int64",
        "tokens whose ratio or k3 is not finite (exp overflow, or a sampled token of probability 0: log-prob -inf): left out of "
        "ratio_mean and kl_k3, which are means over the other tokens",
    ),
    _c("n_nonfinite_lgn", "int64", "tokens whose logit-gradient norm is not finite: left out of lgn_mean_*"),
    _c("reward_mean", "float32", "mean reward of the step's sequences (record_step / record_sequences)"),
    # loss settings of the update (losses.update_settings): null where the method has none
    _c("beta1", "float32", "CE-GPPO's low-side gradient scale of this update (ce_gppo only)"),
    _c("beta2", "float32", "CE-GPPO's high-side gradient scale of this update (ce_gppo only)"),
    _c("dual_clip", "float32", "dual-clip constant c of this update (when set)"),
    _c("erc_low", "float32", "ERC band, low end (when set)"),
    _c("erc_high", "float32", "ERC band, high end (when set)"),
    _c(
        "entropy_coef",
        "float32",
        "entropy-bonus coefficient this update's loss applied (when not 0; with adaptive "
        "control always, 0 where its gate is shut: the previous step's entropy above the target)",
    ),
    _c(
        "entropy_coef_adaptive",
        "float32",
        "adaptive entropy control's coefficient c_k at this update, before its "
        "gate (TRL's use_adaptive_entropy, AdaptiveEntropyCoef; docs/losses.md); null without adaptive control",
    ),
    _c("kl_coef", "float32", "KL-penalty coefficient of this update (when not 0)"),
    _c("loss_scale", "float32", "scale of the back-propagated loss, e.g. 1 / gradient accumulation (when not 1)"),
    # entropy budget: first-order entropy change per unit logit step, summed over ALL tokens of the update
    *(
        _c(
            f"entropy_effect{sfx}",
            "float32",
            f"sum of tokens.entropy_effect over {what} (null where an entropy "
            "bonus's own term was not measured: tokens.entropy_effect)",
        )
        for sfx, what in (
            ("", "all tokens"),
            *((f"_{quadrant_slug(q)}", f"{q} tokens") for q in QUADRANTS),
            ("_low", "tokens with r < 1-eps_low"),
            ("_high", "tokens with r > 1+eps_high"),
        )
    ),
    *(
        _c(
            f"entropy_effect_dropped{sfx}",
            "float32",
            f"sum of tokens.entropy_effect_dropped over {what} "
            "(the entropy effect clipping / beta scaling / dual-clip / ERC took away)" + note,
        )
        for sfx, what, note in (
            (
                "",
                "all tokens",
                ": the by-cause parts entropy_effect_dropped_clip_low + _clip_high + _dual_clip + "
                "_erc + _clip_cov + _kl_cov add up to it",
            ),
            *((f"_{quadrant_slug(q)}", f"{q} tokens", "") for q in QUADRANTS),
            (
                "_low",
                "tokens with r < 1-eps_low",
                "; by region (where), not by cause: it includes what ERC took "
                "from these tokens, so it overlaps _erc; the cause split is _clip_low / _clip_high / _dual_clip / _erc",
            ),
            (
                "_high",
                "tokens with r > 1+eps_high",
                "; by region (where), not by cause: it includes dual-clipped "
                "tokens (r > c > 1+eps_high) and what ERC took, so it overlaps _dual_clip and _erc; the cause split "
                "is _clip_low / _clip_high / _dual_clip / _erc",
            ),
        )
    ),
    # the dropped effect by cause (why): a partition of entropy_effect_dropped. With g_u = grad_coef_unclipped,
    # g_e = the token's grad_coef just before ERC acted (grad_coef without ERC) and g = grad_coef, ERC's share is
    # (g_e - g) s / T^2; the rest, (g_u - g_e) s / T^2, goes to dual-clip on tokens PPO-clip did not clip that are
    # dual-clipped or inside the band, else to the token's clip side (aggregates.entropy_budget; the loss's
    # masks and IS weight are in g_u as in g: they drop nothing)
    _c(
        "entropy_effect_dropped_clip_low",
        "float32",
        "by cause: the part of entropy_effect_dropped PPO-clip's low "
        "side took away ((g_u - g_e) s / T^2 summed over tokens with clip = -1 whose gradient clipping changed: "
        "PPO-clip's A < 0 side, CE-GPPO's beta1, cispo's weight clip; g_u = grad_coef_unclipped, g_e = grad_coef "
        "before ERC); null without attribution, or with ERC but no pre-ERC grad_coef from the loss",
    ),
    _c(
        "entropy_effect_dropped_clip_high",
        "float32",
        "by cause: as _clip_low for clip = +1 (PPO-clip's A > 0 side, "
        "CE-GPPO's beta2, cispo), dual-clipped tokens left out (_dual_clip)",
    ),
    _c(
        "entropy_effect_dropped_dual_clip",
        "float32",
        "by cause: (g_u - g_e) s / T^2 over tokens PPO-clip did not "
        "clip that are dual_clipped (dual-clip's c, TRL's delta) or inside the band (there only delta acts: at "
        "ratio_level='sequence' a capped token changes its sequence's other tokens too); null without "
        "dual_clip / delta",
    ),
    _c(
        "entropy_effect_dropped_clip_cov",
        "float32",
        "by cause: (g_u - g_e) s / T^2 over the tokens Clip-Cov "
        "selected (tokens.cov_clipped; never PPO-clipped or dual-clipped); null without clip_cov",
    ),
    _c(
        "entropy_effect_dropped_kl_cov",
        "float32",
        "by cause: (g_u - g_e) s / T^2 over the tokens KL-Cov "
        "penalised (tokens.kl_cov_penalised: minus the penalty's own entropy effect); null without kl_cov",
    ),
    _c(
        "entropy_effect_dropped_erc",
        "float32",
        "by cause: ERC's own share, (g_e - g) s / T^2 over the changed "
        "tokens (g_e = the token's grad_coef just before ERC: what a clipped token had kept, not what clipping "
        "took; nonzero on tokens ERC dropped, and at ratio_level='sequence' on the other tokens of their "
        "sequence); null without ERC. Schema version 2 stored here the whole entropy_effect_dropped of the tokens ERC "
        "dropped (clipping's part included): readers null it in runs of version < 3",
    ),
)

# The steps columns computed from an update's tokens (aggregates.step_aggregates), in the order it
# computes them. One name per quantity: policy_loss(...).metrics, the recorder's steps rows and
# step_summary, trainer logs ("entropylens/<name>": a prefix, as TRL's and verl's loggers group by
# it) and the SQL analyses all use these names.
STEP_METRICS: tuple[str, ...] = (
    "n_tokens",
    "entropy_mean",
    "old_entropy_mean",
    "ratio_mean",
    "clip_low_frac",
    "clip_high_frac",
    "clipped_frac",
    "region_low_frac",
    "region_high_frac",
    *(f"n_{quadrant_slug(q)}" for q in (*QUADRANTS, "ZA")),
    *(f"clip_frac_{quadrant_slug(q)}" for q in QUADRANTS),
    *(f"lgn_mean_{quadrant_slug(q)}" for q in QUADRANTS),
    "entropy_ratio_p05",
    "entropy_ratio_p50",
    "entropy_ratio_p95",
    "erc_drop_frac",
    "kl_k3",
    "n_nonfinite_ratio",
    "n_nonfinite_lgn",
    "dual_clip_frac",
    "token_masked_frac",
    "seq_masked_frac",
    "is_weight_mean",
    "sapo_weight_mean",
    "cov_clipped_frac",
    "kl_cov_frac",
    "sampler_abs_log_ratio_mean",
    "sampler_abs_log_ratio_max",
    "sampler_kl_k1",
    "sampler_kl_k3",
    "is_masked_frac",
    "clipped_mismatched_frac",
    "n_sampled",
    "n_sampled_clipped",
    *(f"sampler_abs_log_ratio_mean_{quadrant_slug(q)}" for q in QUADRANTS),
    "loss",
)
SEQUENCES: tuple[Column, ...] = (
    _c("step", "int32", "training step"),
    _c("rank", "int16", "rank that recorded the row"),
    _c(
        "seq",
        "int32",
        "sequence id (tokens.seq): unique within the step; the row sits at the step that recorded "
        "the sequence (TRL: its generation step, ids unique across the run, so with num_iterations > 1 "
        "join later steps' tokens on seq alone)",
    ),
    _c("group", "int32", "prompt group id (the G responses to one prompt share it)"),
    _c("reward", "float32", "scalar reward of the response"),
    _c("advantage", "float32", "advantage of the response"),
    _c("length", "int32", "response length in tokens"),
    _c("text", "string", "response text (optional)"),
)

TOKENS: tuple[Column, ...] = _STEP_KEYS + (
    _c("seq", "int32", "sequence id, unique within the step (TRL, verl: across the run)"),
    _c("group", "int32", "prompt group id"),
    _c("pos", "int32", "position of the token in the response (0-based)"),
    _c("token_id", "int32", "sampled token id a_t"),
    _c("prob", "float32", "sampling probability p = exp(old_logprob)", "exp(old_logprob)"),
    _c("logprob", "float32", "log pi_theta(a_t) at this update"),
    _c("old_logprob", "float32", "log pi_old(a_t), the policy that sampled it"),
    _c("ratio", "float32", "importance ratio r = exp(logprob - old_logprob)", "exp(logprob - old_logprob)"),
    _c("advantage", "float32", "advantage A of the token (its sequence's)"),
    _c("quadrant", "dict8", "PA&HP / PA&LP / NA&HP / NA&LP, or ZA when A == 0 (p against tau)"),
    _c(
        "clip",
        "int8",
        "clip region of the ratio the method clips: -1 below 1-eps_low, +1 above 1+eps_high, else 0 "
        "(TRL's own loss: the ratio TRL clips, the sequence ratio with importance_sampling_level='sequence'; "
        "TRL cispo: +1 where its weight is capped at epsilon_high; TRL sapo / vespo clip nothing: 0; entropylens' "
        "sapo, which has no band: the side of 1, -1 where r < 1, +1 where r > 1)",
    ),
    _c(
        "clipped",
        "bool",
        "PPO-clip removes the gradient: (clip = -1 and A < 0) or (clip = +1 and A > 0) "
        "(TRL's delta adds A < 0 and r > delta; TRL cispo / sapo / vespo and entropylens' sapo never remove it: "
        "false)",
    ),
    _c("entropy", "float32", "full-vocabulary entropy H(pi_theta(.|s_t)), nats"),
    _c("old_entropy", "float32", "full-vocabulary entropy H(pi_old(.|s_t)), nats"),
    _c(
        "entropy_ratio",
        "float32",
        "rho = (entropy + 1e-8) / (old_entropy + 1e-8)",
        "(entropy + 1e-8) / (old_entropy + 1e-8)",
    ),
    _c("erc_kept", "bool", "ERC kept the gradient (rho inside its band); null without ERC"),
    _c(
        "dual_clipped",
        "bool",
        "dual-clip removed the gradient (A < 0 and r > c, a token PPO-clip did not clip), or "
        "TRL's delta capped the ratio (losses.policy_loss's delta); null without either (TRL's own loss folds "
        "delta into clipped)",
    ),
    _c(
        "token_kept",
        "bool",
        "inside the loss's token mask: the 80/20 forking-token rule's top-entropy quantile "
        "mask on every path (plain loop, TRL, verl: the token keeps its policy gradient); null without a token mask",
    ),
    _c("seq_kept", "bool", "the off-policy sequence mask kept the token's sequence; null without a sequence mask"),
    _c(
        "is_weight",
        "float32",
        "importance-sampling weight the loss multiplied the token's policy term by (vLLM's "
        "truncated IS correction); null without one",
    ),
    _c(
        "sapo_weight",
        "float32",
        "SAPO's gate weight w = 4 sigma (1 - sigma), sigma = sigmoid(tau (r - 1)) (tau_pos "
        "where A > 0, else tau_neg): grad_coef = w * grad_coef_unclipped; 1 at r = 1, 0 where verl's log-ratio "
        "clamp cut the gradient; null for other losses",
    ),
    _c(
        "cov",
        "float32",
        "covariance term (A - mean A)(logprob - mean logprob), means over the update's (the loss "
        "call's) masked-in tokens (Cui et al. 2025; the term Clip-Cov and KL-Cov select on); null for other losses (the "
        "covariance analyses compute it from the token rows)",
    ),
    _c(
        "cov_clipped",
        "bool",
        "Clip-Cov selected the token (its loss and gradient multiplied by 0); null without clip_cov",
    ),
    _c(
        "kl_cov_penalised",
        "bool",
        "KL-Cov added ppo_kl_coef |log r| to the token's loss (top cov share); null without kl_cov",
    ),
    _c(
        "sampler_logprob",
        "float32",
        "log pi_sampler(a_t): the log-prob the sampling engine gave the token (TRL's "
        "vLLM sampling log-probs, verl's rollout_log_probs, record_update's sampler_logprobs); null where the "
        "trainer does not have it (never 0)",
    ),
    _c(
        "is_masked",
        "bool",
        "the trainer's IS correction masked the token (TRL's vllm_importance_sampling_mode "
        "token_mask / sequence_mask: its weight set to 0; verl's rollout rejection, rollout_rs); null without "
        "a masking correction",
    ),
    _c(
        "sampler_log_ratio",
        "float32",
        "training-inference mismatch d = old_logprob - sampler_logprob (log pi_old / pi_sampler)",
        "old_logprob - sampler_logprob",
    ),
    _c(
        "grad_coef",
        "float32",
        "dLoss/dlogprob of the token for the back-propagated loss (aggregation weight and "
        "gradient-accumulation scale included; TRL's own loss: from a hook on the [B, T] log-prob tensor)",
    ),
    _c(
        "logit_grad_norm",
        "float32",
        "||dLoss/dz_t||_2 over the vocabulary, g_t = dLoss/dlogp_t, p the current "
        "policy's: from a hook on the logits (watch_logits; policy_update with an entropy bonus); "
        "policy_update's logits path the exact closed form |g_t| / T * ||e_a - p_t|| from its sensitivity "
        "pass's sums (no cancellation as p_t -> 1); without logits (TRL's fused head, head_stats) "
        "|g_t| / T * sqrt(1 - 2 p_t + sum_j p_j^2), null where an entropy bonus also reaches the logits",
    ),
    _c(
        "entropy_effect",
        "float32",
        "first-order entropy change of the token's own position per unit logit step "
        "of its gradient: grad_coef * s / T^2, s = p_a (log p_a + H) - sum_j p_j^2 (log p_j + H) "
        "(stats.entropy_sensitivity; eta left out: dH_t = eta * entropy_effect). With an entropy bonus (the loss's "
        "entropy_coef != 0), whose gradient reaches the logits through H as well, the bonus's own term "
        "-dLoss/dH_t * sum_j p_j^2 (log p_j + H)^2 / T^2 is included (policy_update's logits path: dLoss/dH_t "
        "from autograd, the sum from one more pass over the logits); where it is not measured (no logits: "
        "head_stats, TRL's fused head; record_update by hand without the loss column entropy_effect_bonus) the "
        "value is null, never the policy term alone",
    ),
    _c(
        "entropy_effect_dropped",
        "float32",
        "(grad_coef_unclipped - grad_coef) * s / T^2: the entropy effect "
        "clipping, CE-GPPO's beta scaling, dual-clip / delta, Clip-Cov / KL-Cov or ERC took away from this token; null "
        "where they left its gradient unchanged. An entropy bonus is in both gradients and cancels: exact with "
        "or without one",
    ),
)

PROBES: tuple[Column, ...] = _STEP_KEYS + (
    _c(
        "part",
        "string",
        "which gradient: a quadrant's kept gradient (PA&HP, ..., ZA), its dropped part "
        "('PA&HP dropped': what clipping / ERC took away), 'momentum' (the optimizer's history), 'other' "
        "(the rest of the real step: entropy bonus, weight decay, ...), 'step' (the real optimizer step)",
    ),
    _c("tokens", "int64", "tokens whose gradient forms the part (0 for momentum / other / step)"),
    _c("grad_norm", "float32", "L2 norm of the part's parameter gradient (after the update's grad clipping)"),
    _c(
        "predicted_dh",
        "float64",
        "first-order change of the batch's mean entropy: grad(H) . step(part), "
        "step() = the optimizer's update direction from its state (Adam: preconditioner + bias correction)",
    ),
    _c(
        "measured_dh",
        "float64",
        "on the 'step' row: mean entropy on the same positions after the real "
        "optimizer step minus before; null on the other rows",
    ),
    _c("entropy_before", "float64", "mean entropy of the batch's positions before the step"),
    _c("optimizer", "string", "optimizer class (Adam, AdamW, SGD)"),
    _c("lr", "float32", "learning rate of the step"),
)

TABLES: dict[str, tuple[Column, ...]] = {
    "runs": RUNS,
    "steps": STEPS,
    "sequences": SEQUENCES,
    "tokens": TOKENS,
    "probes": PROBES,
}


def changed_meaning(table: str, version) -> tuple[str, ...]:
    """The columns of ``table`` a run of schema ``version`` (None or unreadable: 0) wrote with an older
    meaning (:data:`CHANGED_MEANING`): readers null them."""
    try:
        v = int(version)
    except (TypeError, ValueError):
        v = 0
    return tuple(col for (t, col), since in CHANGED_MEANING.items() if t == table and v < since)


def stored_columns(table: str) -> tuple[Column, ...]:
    """The columns written to the files (derived ones are computed by the DuckDB views)."""
    return tuple(c for c in TABLES[table] if c.derived is None)


def arrow_type(dtype: str):
    import pyarrow as pa

    return {
        "int8": pa.int8(),
        "int16": pa.int16(),
        "int32": pa.int32(),
        "int64": pa.int64(),
        "float32": pa.float32(),
        "float64": pa.float64(),
        "bool": pa.bool_(),
        "string": pa.string(),
        "dict8": pa.dictionary(pa.int8(), pa.string()),
    }[dtype]


def schema_markdown(only: str | None = None) -> str:
    """The column contract as Markdown tables (docs/schema.md embeds this text verbatim; a test checks it);
    ``only``: that table alone."""
    lines: list[str] = []
    for table, cols in TABLES.items():
        if only is not None and table != only:
            continue
        lines.append(f"**{table}**\n")
        lines.append("| column | dtype | meaning |")
        lines.append("|---|---|---|")
        for c in cols:
            dtype = "dictionary<int8, string>" if c.dtype == "dict8" else c.dtype
            meaning = c.meaning.replace("|", "/") + (" (derived in the view, not stored)" if c.derived else "")
            lines.append(f"| `{c.name}` | {dtype} | {meaning} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
