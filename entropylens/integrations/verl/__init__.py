"""verl (0.9.x) plug-in: CE-GPPO / GPPO policy losses, ERC, and per-token recording, without a fork.

Loaded on ``import verl`` through the setuptools entry point group ``verl.plugins`` (pyproject.toml);
importing this module registers the losses. Three layers, each usable alone:

1. Registered policy losses (``actor_rollout_ref.actor.policy_loss.loss_mode``): ``gppo``,
   ``ce_gppo`` (and ``entropylens_grpo`` / ``entropylens_dapo`` / ``entropylens_cispo``), each computed
   by :func:`entropylens.rl.losses.policy_loss`. verl's signature
   ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``
   sees no entropy, so ERC is not available at this layer.
   beta1 / beta2 (and the ERC band, recording settings) come from :class:`EntropyLensLossConfig`,
   set with ``actor_rollout_ref.actor.policy_loss._target_=entropylens.integrations.verl.EntropyLensLossConfig``
   (hydra instantiates it on every worker).
2. :class:`EntropyLensLoss`, an actor loss function in verl's ``loss_fn(model_output, data, dp_group)``
   form (a drop-in for ``verl.workers.utils.losses.ppo_loss``): it sees the current entropies
   (``model_output["entropy"]``), the old-policy entropies carried in the micro-batch, and
   ``sum_pi_squared``; so it applies ERC on top of any method, and records every micro-batch through
   one :class:`~entropylens.record.recorder.Recorder` per data-parallel rank.
3. The trainer ``trainer.v1.trainer_mode=entropylens`` (:func:`register_trainer`): verl's sync v1
   trainer that installs :class:`EntropyLensLoss` on every actor worker (``set_loss_fn``), agrees the
   run id once on the driver, writes an int64 sample id and the step into every sample of the batch
   (mini-batches are shuffled and dynamic batch sizing reorders rows: row position is never used),
   makes sure the old-policy entropy reaches the loss function (and computes it where verl did not),
   asks the engine for ``sum_pi_squared``, hands the workers the name of verl's tokenizer, and logs our
   aggregates as ``entropylens/...``. At each
   checkpoint it commits every worker's recorded steps and leaves ``entropylens.json`` (the run, the
   step, the next sample id) in the checkpoint folder; a job resumed from that checkpoint continues
   the run after its step (:func:`resume_plan`).

Aggregation: verl normalises each micro-batch's loss by GLOBAL counts (``agg_loss``: dp_size,
batch_num_tokens, global_batch_size, loss_scale_factor). policy_loss has verl's five modes; with n
local tokens (B' local sequences with tokens) verl's normalisation is our aggregation times ``scale``:
    token-mean             scale = n * dp_size / batch_num_tokens
    token-sum              scale = dp_size
    seq-mean-token-mean    scale = B' * dp_size / global_batch_size
    seq-mean-token-sum     scale = B' * dp_size / global_batch_size
    seq-mean-token-sum-norm  the same, policy_loss dividing by loss_scale_factor (default: the width T)
so ``grad_coef`` is the token's true dLoss/dlogp in verl's backward.

Metrics (trainer_mode=entropylens; verl sums a Metric SUM over micro-batches after averaging it over
data-parallel ranks, averages a Metric MEAN, then averages every key over the step's mini-batches):
    entropylens/<name>     the step metric over ALL the step's tokens (every micro-batch, rank,
                           mini-batch and epoch): the loss function returns additive shares
                           (``entropylens/_sum/<name>``, Metric SUM, times dp_size), the trainer takes them
                           out of update_actor's metrics before verl averages them and divides the sums
                           (:func:`metric_shares`, :func:`step_values`). Quantiles (entropy_ratio_p*) and
                           the per-quadrant mean logit-gradient norms do not add up: steps table only.
    entropylens/loss       the back-propagated policy loss (entropy bonus in, KL out), aggregated as
                           verl's actor/pg_loss (SUM over micro-batches, mean over mini-batches)
    actor/pg_loss          as ppo_loss: the policy term alone (no entropy bonus)
    actor/pg_clipfrac, actor/ppo_kl, actor/pg_clipfrac_lower, actor/entropy_loss, kl_loss: as ppo_loss
                           makes them (compute_policy_loss_vanilla's definitions, the same aggregations);
                           pg_clipfrac_lower is the share of dual-clipped tokens (entropylens' dual_clip_frac
                           per micro-batch)
The registered losses alone (layer 1) return what verl's ppo_loss averages over micro-batches: verl's
three clip diagnostics and entropylens' fractions / means (micro-batch means; no counts, no loss).

Sequences: each recording worker records a sequences row per sample the first time the step's micro-batches
show it (the score from the batch's ``token_level_scores`` / ``rm_scores`` / ``token_level_rewards``, summed
over the response; the advantage's mean over its tokens; the response's length; its text decoded with
the tokenizer, special tokens skipped, as verl logs it). Without a score in the actor's batch no
sequences are recorded (said once in the log); samples without a trained token (verl's padding samples)
have no row. run.json names the tokenizer (``config.tokenizer``); a token viewer decodes tokens.token_id
with it (entropylens.token_text). The tokenizer is verl's own (the trainer's ``self.tokenizer``, loaded by each
worker from its name, local files only) or ``policy_loss.tokenizer``; layer 2 alone without one records
no texts.

Recording ranks: one recorder per data-parallel rank. FSDP: the data-parallel group that holds global
rank 0 (Ulysses peers hold the same data). Megatron (``megatron.core.parallel_state`` set up):
:func:`recording_rank` of (pp_rank, pp_size, tp_rank, cp_rank, dp_rank): the last pipeline stage,
tensor rank 0, context rank 0, where verl collects its outputs.

Settings: ``entropylens_dapo`` needs actor.clip_ratio_high set away from verl's default 0.2 (DAPO's 0.28:
refused otherwise, since a composed config cannot tell the default from a setting); eps used are in
run.json. verl's entropy_coeff goes into the loss (and its config: steps.entropy_coef). With
``actor_rollout_ref.model.use_fused_kernels=True`` the trainer does not ask for sum_pi_squared (verl
refuses it with fused kernels): logit_grad_norm is null, said once.

Logit-gradient norm without logits (verl's engine computes sum_j pi_j^2 when asked): for a loss that
reaches the logits z only through logp_a = log softmax(z/T)_a, with g = dLoss/dlogp_a,
    dLoss/dz = (g / T) (e_a - pi)  =>  ||dLoss/dz||_2 = |g| / T * sqrt(1 - 2 pi_a + sum_j pi_j^2).
Recorded when the loss has no entropy bonus and no KL term (otherwise that identity does not hold).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import secrets
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Optional

import torch

from ...rl.losses import policy_loss
from .._version import require_tested
from ...rl.stats import logit_grad_norm_from_sum_p2

VERL_TESTED = ("0.9",)  # major.minor releases whose loss / trainer / engine interfaces this was tested with
METHODS = ("gppo", "ce_gppo")  # registered under their own names
PREFIXED = ("grpo", "dapo", "cispo")  # registered as entropylens_<name> (verl has its own vanilla etc.)
SAMPLE_ID = "entropylens_sample_id"  # int64 [B] in the batch: run-unique id of the sample
STEP = "entropylens_step"  # int64 [B] in the batch: the trainer step the update belongs to
OLD_ENTROPY_KEYS = ("entropylens_old_entropy", "entropy", "old_entropys", "entropys")  # first found wins
# the response's score as verl's reward step leaves it ([B, T] nested, summed over the response): first found wins
# (token_level_rewards last: it has the in-reward KL penalty subtracted)
REWARD_KEYS = ("token_level_scores", "rm_scores", "token_level_rewards")
METRIC_PREFIX = "entropylens/"

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- version
def check_verl_version(version: str | None = None) -> str:
    """Raise a clear error on a verl release this plug-in was not tested with
    (ENTROPYLENS_VERL_UNSAFE=1 skips the check)."""
    if version is None:
        import verl

        version = verl.__version__
    return require_tested("verl", version, VERL_TESTED, "ENTROPYLENS_VERL_UNSAFE",
                          "It plugs into verl's policy-loss registry, actor loss function and v1 trainer, whose "
                          "interfaces move between releases.")


check_verl_version()

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, register_policy_loss  # noqa: E402
from verl.workers.config import PolicyLossConfig  # noqa: E402


# ----------------------------------------------------------------------------------- config
@dataclass
class EntropyLensLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig plus entropylens' settings (``policy_loss._target_`` points here).

    loss_mode: a verl loss name; ``gppo`` / ``ce_gppo`` / ``entropylens_grpo`` ... are ours.
    beta1, beta2: CE-GPPO's scales of the low-side (A<0, r<1-eps_low) and high-side (A>0, r>1+eps_high)
        clipped tokens' gradient (paper: 0.5 / 1.0 at 1.5B, 0.75 / 1.0 at 7B).
    erc_low, erc_high: ERC band on rho = H / H_old (both set = ERC on; paper 0.95 / 1.05). Needs the
        entropylens loss function (trainer_mode=entropylens), which sees the entropies.
    record_dir: where runs are recorded (a path every actor worker can write; None = no recording).
    run: run id (None: the trainer picks one, once, on the driver). sample: token-row keep fraction.
    tau: HP/LP threshold. exact_logit_grad_norm: ask the engine for sum_pi^2 (an extra [N, V] pass).
    tokenizer: the tokenizer (a local path or cached hub name) that decodes the responses' texts and that
        run.json names for a token viewer; None: the one verl's trainer loaded (trainer_mode=entropylens).
    """

    beta1: float = 0.5
    beta2: float = 1.0
    erc_low: Optional[float] = None
    erc_high: Optional[float] = None
    record_dir: Optional[str] = None
    run: Optional[str] = None
    sample: float = 1.0
    tau: float = 0.5
    exact_logit_grad_norm: bool = True
    tokenizer: Optional[str] = None

    def __post_init__(self):
        super_post = getattr(super(), "__post_init__", None)
        if super_post is not None:
            super_post()
        check_registered()
        method = method_of(self.loss_mode)
        if (self.erc_low is None) != (self.erc_high is None):
            raise ValueError("policy_loss.erc_low and policy_loss.erc_high must be set together (ERC band)")
        if method is None and (self.erc is not None or self.record_dir):
            raise ValueError(
                f"policy_loss.loss_mode={self.loss_mode!r} is verl's own loss; ERC and recording need one of "
                f"entropylens' losses: {', '.join(registered_names())}"
            )
        if self.erc is not None and not (0.0 <= self.erc[0] < 1.0 < self.erc[1]):
            raise ValueError(f"ERC band must satisfy 0 <= erc_low < 1 < erc_high, got {self.erc}")
        if not (self.beta1 >= 0 and self.beta2 >= 0):
            raise ValueError(f"beta1 and beta2 must be >= 0, got {self.beta1}, {self.beta2}")
        if not 0.0 < self.sample <= 1.0:
            raise ValueError(f"policy_loss.sample must be in (0, 1], got {self.sample}")
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"policy_loss.tau must be in (0, 1], got {self.tau}")

    @property
    def erc(self) -> tuple[float, float] | None:
        return None if self.erc_low is None else (float(self.erc_low), float(self.erc_high))


def _pl_get(config, key: str, default=None):
    """A field of ``config.policy_loss`` (dataclass or DictConfig), or ``default``."""
    pl = getattr(config, "policy_loss", None) if config is not None else None
    if pl is None:
        return default
    v = pl.get(key, default) if hasattr(pl, "get") and not hasattr(pl, key) else getattr(pl, key, default)
    return default if v is None and default is not None else v


# ----------------------------------------------------------------------------------- the maths
def method_of(loss_mode: str) -> str | None:
    """entropylens method behind a verl loss_mode (None: verl's own loss)."""
    if loss_mode in METHODS:
        return loss_mode
    if loss_mode.startswith("entropylens_") and loss_mode[len("entropylens_"):] in (*METHODS, *PREFIXED):
        return loss_mode[len("entropylens_"):]
    return None


def registered_names() -> tuple[str, ...]:
    return (*METHODS, *(f"entropylens_{m}" for m in (*METHODS, *PREFIXED)))


def verl_default(field: str):
    """The default of one of verl's ActorConfig fields (its dataclass; actor.yaml sets the same values)."""
    import dataclasses

    from verl.workers.config import ActorConfig

    return {f.name: f.default for f in dataclasses.fields(ActorConfig)}[field]


DAPO_EPS_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025): eps_low 0.2, eps_high 0.28


def eps_from(config, method: str | None = None) -> tuple[float, float]:
    """verl's clip range: clip_ratio_low / clip_ratio_high, each defaulting to clip_ratio.

    ``method='dapo'``: DAPO is PPO-clip with a wider high side; verl's clip_ratio_high defaults to
    0.2 (actor.yaml) and a composed config cannot tell that default from a user's 0.2, so a dapo loss
    with clip_ratio_high at verl's default is refused (one line) instead of silently running as GRPO."""
    clip = float(getattr(config, "clip_ratio", 0.2))
    low = getattr(config, "clip_ratio_low", None)
    high = getattr(config, "clip_ratio_high", None)
    low, high = (clip if low is None else float(low)), (clip if high is None else float(high))
    if method == "dapo" and abs(high - float(verl_default("clip_ratio_high"))) < 1e-12:
        raise ValueError(
            f"entropylens_dapo: actor.clip_ratio_high is {high:g}, verl's default, which makes DAPO plain GRPO (verl's "
            f"config cannot tell its default from a setting): set actor_rollout_ref.actor.clip_ratio_high="
            f"{DAPO_EPS_HIGH} (DAPO's clip-higher), or use loss_mode=entropylens_grpo for a symmetric clip")
    return low, high


def agg_and_scale(loss_agg_mode: str, mask: torch.Tensor, info: dict) -> tuple[str, float | torch.Tensor]:
    """Our aggregation (policy_loss's ``agg``: verl's five modes, seq-mean-token-sum-norm with
    ``loss_scale_factor``) and the scale that turns it into verl's ``agg_loss`` with global counts
    (module docstring). ``info`` is ``config.global_batch_info`` (dp_size, batch_num_tokens,
    global_batch_size, loss_scale_factor); missing entries fall back to local counts as verl does."""
    dp = int(info.get("dp_size") or 1)
    m = mask.bool()
    n = m.sum()
    n_seq = (m.sum(-1) > 0).sum()
    if loss_agg_mode == "token-mean":
        total = info.get("batch_num_tokens")
        if total is None:
            if dp > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            return "token-mean", 1.0
        return "token-mean", n.double() * dp / float(total)
    if loss_agg_mode == "token-sum":
        return "token-sum", float(dp)
    if loss_agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        gbs = info.get("global_batch_size")
        if gbs is None and dp > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        return loss_agg_mode, (1.0 if gbs is None else n_seq.double() * dp / float(gbs))
    raise ValueError(f"loss_agg_mode: unknown {loss_agg_mode!r}")


def compute_loss(method: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, *,
                 entropy=None, old_entropy=None, erc=None, entropy_coef: float = 0.0):
    """``policy_loss`` with verl's configuration: eps from clip_ratio_low/high (:func:`eps_from`),
    dual-clip from clip_ratio_c (verl applies it to every PPO loss; default 3), beta1/beta2 from the
    policy_loss config, aggregation with verl's global counts via ``scale``, ``entropy_coef`` (verl's
    entropy_coeff: the bonus is in the loss and in its config, where the recorder's entropy-bonus
    rule reads it). Returns the PolicyLossOutput."""
    eps_low, eps_high = eps_from(config, method)
    info = dict(getattr(config, "global_batch_info", None) or {})
    agg, scale = agg_and_scale(loss_agg_mode, response_mask, info)
    scale = float(scale)
    scale = scale if scale > 0 else 1.0  # no token in this micro-batch: every weight is 0 anyway
    dual = None if method == "cispo" else float(getattr(config, "clip_ratio_c", 3.0) or 3.0)
    lsf = info.get("loss_scale_factor") if agg == "seq-mean-token-sum-norm" else None
    kw = dict(method=method, eps_low=eps_low, eps_high=eps_high, dual_clip=dual, agg=agg,
              beta1=float(_pl_get(config, "beta1", 0.5)), beta2=float(_pl_get(config, "beta2", 1.0)),
              tau=float(_pl_get(config, "tau", 0.5)), entropy=entropy, old_entropy=old_entropy, erc=erc,
              entropy_coef=entropy_coef, loss_scale_factor=None if lsf is None else float(lsf))
    return policy_loss(log_prob, old_log_prob, advantages, response_mask, scale=scale, **kw)


def verl_clip_metrics(log_prob, old_log_prob, advantages, mask, config, method: str) -> torch.Tensor:
    """verl's own PPO diagnostics of one micro-batch, as compute_policy_loss_vanilla defines them
    (log-ratio clamped to +-20): [pg_clipfrac, ppo_kl, pg_clipfrac_lower], float64 [3] on the device.
    pg_clipfrac: share of tokens whose clipped surrogate exceeds the unclipped one (A > 0, r > 1+eps_high;
    A < 0, r < 1-eps_low); pg_clipfrac_lower: share with A < 0 and r above the dual-clip bound
    clip_ratio_c (entropylens' dual_clipped); ppo_kl: mean of log pi_old - log pi."""
    eps_low, eps_high = eps_from(config, method)
    c = float(getattr(config, "clip_ratio_c", 3.0) or 3.0)
    m = mask.bool()
    denom = m.sum().clamp(min=1).double()
    log_r = torch.clamp(log_prob.detach().double() - old_log_prob.double(), min=-20.0, max=20.0)
    r = torch.exp(log_r)
    a = advantages.double()
    l1, l2 = -a * r, -a * torch.clamp(r, 1 - eps_low, 1 + eps_high)
    clipfrac = ((l2 > l1) & m).sum() / denom
    lower = ((torch.maximum(l1, l2) > -a * c) & (a < 0) & m).sum() / denom
    kl = torch.where(m, -log_r, torch.zeros_like(log_r)).sum() / denom
    return torch.stack([clipfrac.double(), kl, lower.double()])


VERL_CLIP_KEYS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


# Step metrics by how they add up over micro-batches, ranks and mini-batches (exact step values):
# counts are summed; a fraction / mean of tokens is (sum of value * n_tokens) / sum of n_tokens; ratio_mean
# and kl_k3 are means over the tokens with a finite ratio (n_tokens - n_nonfinite_ratio); clip_frac_<q>
# is of quadrant q's tokens; the entropy budget is a sum. Quantiles (entropy_ratio_p*) and the mean
# logit-gradient norms per quadrant do not add up: they are in the steps table, not in the logs.
def _metric_rule(name: str) -> tuple[str, str | None] | None:
    """(kind, denominator) of a step metric for exact aggregation; None: not logged (not additive)."""
    from ...rl.aggregates import BUDGET_NAMES

    if name == "n_tokens" or name.startswith("n_"):
        return ("count", None)
    if name in ("ratio_mean", "kl_k3"):
        return ("mean", "n_finite_ratio")
    if name.startswith("clip_frac_"):
        return ("mean", "n_" + name[len("clip_frac_"):])
    if name in BUDGET_NAMES:
        return ("sum", None)
    if name.startswith("entropy_ratio_p") or name.startswith("lgn_mean_") or name == "loss":
        return None
    if name.endswith("_frac") or name.endswith("_mean"):
        return ("mean", "n_tokens")
    return None


# a micro-batch's additive share of a step metric (EntropyLensTrainer turns the shares into step values)
SUM_PREFIX = METRIC_PREFIX + "_sum/"


def metric_shares(scal: dict[str, float], dp_size: int) -> dict[str, float]:
    """One micro-batch's additive shares of the step metrics (``scal``: its PolicyLossOutput.scalars()),
    each times ``dp_size``: verl's Metric SUM aggregation averages over data-parallel ranks and sums
    over micro-batches, so a share times dp_size adds up to the global sum of the mini-batch."""
    n = scal.get("n_tokens", 0.0)
    den = {"n_tokens": n, "n_finite_ratio": n - scal.get("n_nonfinite_ratio", 0.0)}
    out = {}
    for name, v in scal.items():
        rule = _metric_rule(name)
        if rule is None:
            continue
        kind, d = rule
        if kind == "mean":
            w = den[d] if d in den else scal.get(d, 0.0)
            v = v * w if w else 0.0  # an empty denominator adds nothing (its value is 0 or NaN)
        out[name] = v * dp_size
    if "n_nonfinite_ratio" in scal or "ratio_mean" in scal:
        out["n_finite_ratio"] = den["n_finite_ratio"] * dp_size
    return out


def step_values(sums: dict[str, float]) -> dict[str, float]:
    """The step metrics from their shares summed over the whole step (every micro-batch, rank,
    mini-batch and epoch): each value equals the metric computed over all the step's tokens at once."""
    out = {}
    for name, total in sums.items():
        if name == "n_finite_ratio":
            continue
        rule = _metric_rule(name)
        if rule is None:
            continue
        kind, d = rule
        if kind == "mean":  # over no token: 0, as step_aggregates makes it (its denominators are clamped to 1)
            out[name] = total / max(sums.get(d, 0.0), 1.0)
        else:
            out[name] = total
    return out


def _total(v) -> float:
    """A metric verl collected over the step: a list (one value per mini-batch: Metric.aggregate_dp),
    a Metric (verl ran without a data-parallel group: every micro-batch's value) or a number."""
    from verl.utils.metric import Metric

    if isinstance(v, Metric):
        return float(v.aggregate())
    if isinstance(v, (list, tuple)):
        return float(sum(_total(x) for x in v))
    return float(v)


def _make_registered(method: str):
    def loss_fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                rollout_is_weights=None):
        if config is None:
            raise ValueError(f"entropylens {method}: verl passed no actor config")
        if rollout_is_weights is not None:
            raise ValueError(f"entropylens {method}: rollout correction weights (rollout_is_weights) are not supported; "
                             "turn algorithm.rollout_correction off or use verl's own loss")
        if method == "ce_gppo" and _pl_get(config, "beta1") is None and not loss_fn.warned:
            loss_fn.warned = True
            logger.warning("entropylens ce_gppo: policy_loss has no beta1/beta2 (set policy_loss._target_="
                           "entropylens.integrations.verl.EntropyLensLossConfig); using beta1=0.5, beta2=1.0")
        out = compute_loss(method, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)
        clip = verl_clip_metrics(log_prob, old_log_prob, advantages, response_mask, config, method)
        scal = out.scalars()
        # verl's ppo_loss averages these over micro-batches (Metric MEAN): only intensive values are
        # returned (a count or the loss would come out divided by the number of micro-batches); exact step
        # values need trainer.v1.trainer_mode=entropylens (EntropyLensLoss)
        metrics = {METRIC_PREFIX + k: v for k, v in scal.items() if (_metric_rule(k) or ("",))[0] == "mean"}
        metrics.update(zip(VERL_CLIP_KEYS, clip.tolist()))
        return out.loss, metrics

    loss_fn.__name__ = f"entropylens_{method}_policy_loss"
    loss_fn.__doc__ = f"entropylens' {method} as a verl policy loss (entropylens.rl.losses.policy_loss)."
    loss_fn.entropylens_method = method
    loss_fn.warned = False
    return loss_fn


def register() -> None:
    """Register every entropylens loss in verl's POLICY_LOSS_REGISTRY (idempotent)."""
    for method in (*METHODS, *PREFIXED):
        fn = _make_registered(method)
        names = [f"entropylens_{method}"] + ([method] if method in METHODS else [])
        for name in names:
            existing = POLICY_LOSS_REGISTRY.get(name)
            if existing is not None and getattr(existing, "entropylens_method", None) is None:
                raise RuntimeError(f"verl already has a policy loss named {name!r}; entropylens will not replace it")
            register_policy_loss(name)(fn)


def check_registered() -> None:
    """Loud check: verl logs plug-in load errors only at DEBUG, so the losses are verified here."""
    missing = [n for n in registered_names() if getattr(POLICY_LOSS_REGISTRY.get(n), "entropylens_method", None) is None]
    if missing:
        raise RuntimeError(f"entropylens losses are not registered in verl: {', '.join(missing)} "
                           "(import entropylens.integrations.verl, or check VERL_USE_EXTERNAL_PLUGINS)")


register()


# ----------------------------------------------------------------------------------- loss function
_RECORDERS: dict[tuple[str, str], Any] = {}  # (root, run) -> Recorder, one per process (= one per rank)


def close_recorders(status: str = "finished") -> None:
    """Close this process's recorders (flushes the last step's steps file)."""
    while _RECORDERS:
        key, rec = _RECORDERS.popitem()
        try:
            _flush_sequences(key, rec)
        finally:
            rec.close(status=status, _raise=False)


def end_step_recorders() -> None:
    """End the step in this process's recorders (:meth:`Recorder.end_step`): their files are written
    now, in the background, not when the next step's first update arrives."""
    for key, rec in _RECORDERS.items():
        _flush_sequences(key, rec)
        rec.end_step()


def commit_recorders() -> None:
    """Commit this process's recorders (:meth:`Recorder.commit`): every step they recorded is in whole
    files on disk when this returns, so a job killed later has lost none of them."""
    for key, rec in _RECORDERS.items():
        _flush_sequences(key, rec)
        rec.commit()


def recording_rank(pp_rank: int, pp_size: int, tp_rank: int, cp_rank: int, dp_rank: int, *,
                   dynamic_cp: bool = False) -> int | None:
    """The recorder rank of a Megatron process (its data-parallel rank), or None when it does not record.

    The loss runs on the last pipeline stage only, and every tensor / context-parallel peer of a
    data-parallel rank holds the same micro-batch: one process per data-parallel rank records, the one
    at the last pipeline stage with tensor rank 0 and context rank 0 (verl's
    MegatronEngine.is_mp_src_rank_with_outputs; its data-parallel groups exclude global rank 0 when
    pp_size > 1). With verl's dynamic context parallelism every data-parallel rank holds the whole
    batch (verl makes dp 1): only data-parallel rank 0 records."""
    if not (0 <= pp_rank < pp_size) or min(tp_rank, cp_rank, dp_rank) < 0:
        raise ValueError(f"not a parallel layout: pp_rank={pp_rank}, pp_size={pp_size}, tp_rank={tp_rank}, "
                         f"cp_rank={cp_rank}, dp_rank={dp_rank}")
    if pp_rank != pp_size - 1 or tp_rank != 0 or cp_rank != 0:
        return None
    if dynamic_cp:
        return 0 if dp_rank == 0 else None
    return dp_rank


def megatron_layout() -> tuple[int, int, int, int, int, int] | None:
    """(pp_rank, pp_size, tp_rank, cp_rank, dp_rank, dp_size) of this process from Megatron's
    parallel state (megatron.core.parallel_state, which verl's Megatron engine imports as mpu), or None
    where Megatron's model-parallel state is not set up here (FSDP: megatron is not even imported)."""
    import sys

    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is None or not mpu.model_parallel_is_initialized():
        return None
    return (mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_tensor_model_parallel_rank(), mpu.get_context_parallel_rank(), mpu.get_data_parallel_rank(),
            mpu.get_data_parallel_world_size())


def dp_rank(dp_group, *, dynamic_cp: bool = False) -> tuple[int, int, bool]:
    """(rank in the data-parallel group, its size, whether this process records).

    Megatron (:func:`megatron_layout`): :func:`recording_rank` of its layout. Otherwise (FSDP) the
    Ulysses sequence-parallel peers of a data-parallel rank hold the same micro-batch and verl's
    data-parallel groups are the processes of one sequence-parallel rank: the group that contains
    global rank 0 (sequence-parallel rank 0) records, so each data-parallel rank writes once."""
    dist = torch.distributed
    layout = megatron_layout()
    if layout is not None:
        pp_rank, pp_size, tp_rank, cp_rank, rank, size = layout
        got = recording_rank(pp_rank, pp_size, tp_rank, cp_rank, rank, dynamic_cp=dynamic_cp)
        return (0, 1, got is not None) if dynamic_cp else (rank, size, got is not None)
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, True
    if dp_group is None:
        return dist.get_rank(), dist.get_world_size(), True
    ranks = dist.get_process_group_ranks(dp_group)
    return dist.get_rank(dp_group), len(ranks), 0 in ranks


def _non_tensor(data, key: str, default=None):
    """A non-tensor entry of verl's micro-batch TensorDict (tensordict_utils.get_non_tensor_data)."""
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=default)


def _padded(tensor, data, width: int):
    """A model output (nested over prompt+response) as [B, width] response positions."""
    from verl.workers.utils.padding import no_padding_2_padding

    return _fit(no_padding_2_padding(tensor, data), width)


def _fit(t: torch.Tensor, width: int) -> torch.Tensor:
    """Crop or zero-pad the last dim of a [B, T'] tensor to [B, width]."""
    if t.shape[-1] == width:
        return t
    if t.shape[-1] > width:
        return t[..., :width]
    return torch.nn.functional.pad(t, (0, width - t.shape[-1]))


class EntropyLensLoss:
    """verl actor loss function ``(model_output, data, dp_group) -> (loss, metrics)``: verl's ``ppo_loss``
    with entropylens' policy loss (ERC included: this function sees H and H_old) and recording.

    config: the ActorConfig as verl's worker builds it (``omega_conf_to_dataclass(actor)``); its
    ``policy_loss`` is an :class:`EntropyLensLossConfig` (or carries the same fields).
    run: the run id agreed once (the trainer picks it on the driver); None with recording: rank 0 of
    the recording dp group broadcasts one. resume: the step a resumed job continues after (the verl
    checkpoint's global step; ``Recorder(resume=...)``: the run's steps after it are removed and
    recorded again). ``closing=True``: unpickling this object on a worker closes that worker's
    recorders (how the trainer flushes the last step on every rank); ``committing=True``: unpickling it
    commits them (how the trainer commits every rank's steps at a checkpoint), ``ending=True`` ends
    their step (how the trainer has every rank write a step as soon as its actor update is done); the
    object is then the worker's loss function as before. tokenizer: the tokenizer's name or local path
    (``policy_loss.tokenizer`` when None): run.json names it and each worker loads it once to decode the
    responses' texts (sequences.text).
    """

    def __init__(self, config, *, run: str | None = None, closing: bool = False, resume: int | None = None,
                 committing: bool = False, ending: bool = False, tokenizer: str | None = None):
        self.config = config
        pl = config.policy_loss
        self.method = method_of(pl.loss_mode)
        if self.method is None:
            raise ValueError(f"EntropyLensLoss: policy_loss.loss_mode={pl.loss_mode!r} is not an entropylens loss; "
                             f"use one of {', '.join(registered_names())}")
        lo, hi = _pl_get(config, "erc_low"), _pl_get(config, "erc_high")
        self.erc = None if lo is None else (float(lo), float(hi))
        self.record_dir = _pl_get(config, "record_dir")
        self.run = run or _pl_get(config, "run")
        self.sample = float(_pl_get(config, "sample", 1.0))
        self.tau = float(_pl_get(config, "tau", 0.5))
        self.closing = closing
        self.committing = committing
        self.ending = ending
        self.resume = resume
        self.tokenizer = tokenizer or _pl_get(config, "tokenizer")
        self._update: dict[int, int] = {}
        self._warned: set[str] = set()

    # pickling: the trainer ships this object to every worker with set_loss_fn
    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items()}

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self.closing:
            close_recorders(getattr(self, "status", "finished"))
        elif self.committing:
            commit_recorders()
        elif self.ending:
            end_step_recorders()
        self.committing = self.ending = False

    def shipped(self, *, committing: bool = False, ending: bool = False, closing: bool = False,
                status: str = "finished") -> "EntropyLensLoss":
        """A copy of this loss function for ``set_loss_fn`` that commits (``committing``), ends the step
        in (``ending``) or closes (``closing``, with the run's final ``status``) the recorders of every
        worker it reaches."""
        out = copy.copy(self)
        out.committing, out.ending, out.closing, out.status = committing, ending, closing, status
        out._update, out._warned = {}, set()
        return out

    def _recorder(self, dp_group, *, dynamic_cp: bool = False):
        if not self.record_dir or self.closing:
            return None
        rank, world, records = dp_rank(dp_group, dynamic_cp=dynamic_cp)
        if not records:
            return None
        if self.run is None:  # agreed once, within the recording dp group (its first member's id)
            rid = [f"{self.method}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"]
            if world > 1 and dp_group is not None:
                src = torch.distributed.get_global_rank(dp_group, 0)
                torch.distributed.broadcast_object_list(rid, src=src, group=dp_group)
            self.run = rid[0]
        key = (str(self.record_dir), self.run)
        rec = _RECORDERS.get(key)
        if rec is None:
            from ...record.recorder import Recorder

            eps_low, eps_high = eps_from(self.config, self.method)
            cfg = {"method": self.method, "framework": "verl", "eps_low": eps_low, "eps_high": eps_high,
                   "beta1": _pl_get(self.config, "beta1") if self.method == "ce_gppo" else None,
                   "beta2": _pl_get(self.config, "beta2") if self.method == "ce_gppo" else None,
                   "erc": list(self.erc) if self.erc else None,
                   "dual_clip": None if self.method == "cispo" else getattr(self.config, "clip_ratio_c", 3.0),
                   "loss_agg_mode": getattr(self.config, "loss_agg_mode", None),
                   "entropy_coeff": getattr(self.config, "entropy_coeff", None),
                   "ppo_epochs": getattr(self.config, "ppo_epochs", None)}
            rec = Recorder(self.record_dir, self.run, config=cfg, tau=self.tau, sample=self.sample,
                           rank=rank, world_size=world, resume=self.resume, tokenizer=self.tokenizer or None)
            _RECORDERS[key] = rec
        return rec

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)

    def __call__(self, model_output, data, dp_group=None):
        from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
        from verl.utils.metric import AggregationType, Metric

        config = self.config
        # verl's global normalisation (as ppo_loss does)
        config.global_batch_info["dp_size"] = data["dp_size"]
        config.global_batch_info["batch_num_tokens"] = data["batch_num_tokens"]
        config.global_batch_info["global_batch_size"] = data["global_batch_size"]
        config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
        global_norm = (data["dp_size"] > 1 or data["batch_num_tokens"] is not None
                       or data["global_batch_size"] is not None or config.loss_scale_factor is not None)
        metric_aggregation = AggregationType.SUM if global_norm else AggregationType.MEAN

        keys = set(data.keys())
        old_key = next((k for k in OLD_ENTROPY_KEYS if k in keys), None)
        fields = ["response_mask", "old_log_probs", "advantages", "responses"]
        fields += [k for k in ("rollout_is_weights", "ref_log_prob", SAMPLE_ID, STEP) if k in keys]
        fields += [k for k in REWARD_KEYS if k in keys][:1]  # the score, for the sequences rows
        if old_key is not None:
            fields.append(old_key)
        td = data.select(*fields).to_padded_tensor()
        mask = td["response_mask"].bool()  # [B, T]
        width = mask.shape[-1]
        log_prob = _padded(model_output["log_probs"], data, width)  # [B, T], carries grad
        entropy = model_output.get("entropy", None)
        entropy = _padded(entropy, data, width) if entropy is not None else None
        spp = model_output.get("sum_pi_squared", None)
        spp = _padded(spp, data, width) if spp is not None else None
        old_logp = _fit(td["old_log_probs"], width)
        adv = _fit(td["advantages"], width)
        old_entropy = _fit(td[old_key], width).float() if old_key is not None else None
        if td.get("rollout_is_weights", None) is not None:
            raise ValueError("entropylens: rollout correction weights (rollout_is_weights) are not supported; "
                             "turn algorithm.rollout_correction off")
        if self.erc is not None and (entropy is None or old_entropy is None):
            raise RuntimeError(
                "entropylens ERC needs the current entropy (actor.calculate_entropy=True) and the old policy's "
                f"entropy in the batch (one of {', '.join(OLD_ENTROPY_KEYS)}); got entropy="
                f"{'yes' if entropy is not None else 'no'}, batch keys={sorted(keys)}. "
                "trainer.v1.trainer_mode=entropylens provides both.")

        entropy_coef = float(getattr(config, "entropy_coeff", 0.0) or 0.0) if entropy is not None else 0.0
        out = compute_loss(self.method, old_logp, log_prob, adv, mask, config.loss_agg_mode, config,
                           entropy=entropy, old_entropy=old_entropy if entropy is not None else None,
                           erc=self.erc, entropy_coef=entropy_coef)
        loss = out.loss
        metrics: dict[str, Any] = {}
        ent_loss = None
        if entropy is not None:  # as ppo_loss reports it
            ent_loss = agg_loss(loss_mat=entropy.detach(), loss_mask=mask, loss_agg_mode=config.loss_agg_mode,
                                **config.global_batch_info)
            metrics["actor/entropy_loss"] = Metric(value=ent_loss, aggregation=metric_aggregation)
        if config.use_kl_loss:
            kld = kl_penalty(logprob=log_prob, ref_logprob=_fit(td["ref_log_prob"], width),
                             kl_penalty=config.kl_loss_type)
            kl_loss = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=config.loss_agg_mode,
                               **config.global_batch_info)
            loss = loss + kl_loss * config.kl_loss_coef
            metrics["kl_loss"] = Metric(value=kl_loss, aggregation=metric_aggregation)
            metrics["kl_coef"] = config.kl_loss_coef

        clip = verl_clip_metrics(log_prob, old_logp, adv, mask, config, self.method)
        host = torch.cat([clip, ent_loss.detach().double().reshape(1) if ent_loss is not None
                          else torch.zeros(1, dtype=torch.float64, device=clip.device)]).tolist()  # one host copy
        scal = out.scalars()  # one host copy
        total = scal.get("loss", float("nan"))
        # verl's keys as ppo_loss makes them: pg_loss without the entropy bonus (out.loss = pg - coef * H_agg),
        # the clip diagnostics averaged over micro-batches (Metric MEAN, as ppo_loss wraps a policy loss's metrics)
        metrics["actor/pg_loss"] = Metric(value=total + entropy_coef * host[3], aggregation=metric_aggregation)
        for key, v in zip(VERL_CLIP_KEYS, host[:3]):
            metrics[key] = Metric(value=v, aggregation=AggregationType.MEAN)
        # ours: the back-propagated policy loss (bonus included) with pg_loss's aggregation, and the step
        # metrics as additive shares (Metric SUM); EntropyLensTrainer turns the shares into step values
        metrics[METRIC_PREFIX + "loss"] = Metric(value=total, aggregation=metric_aggregation)
        for k, v in metric_shares(scal, int(data["dp_size"] or 1)).items():
            metrics[SUM_PREFIX + k] = Metric(value=v, aggregation=AggregationType.SUM)

        dynamic_cp = _non_tensor(data, "local_cp_size") is not None
        rec = self._recorder(dp_group, dynamic_cp=dynamic_cp)
        if rec is not None:
            self._record(rec, out, td, mask, adv, log_prob, old_logp, entropy, old_entropy, spp,
                         data, keys, exact=entropy_coef == 0.0 and not config.use_kl_loss)
        return loss, metrics

    def _record(self, rec, out, td, mask, adv, log_prob, old_logp, entropy, old_entropy, spp, data, keys, exact):
        if SAMPLE_ID not in keys or STEP not in keys:
            raise RuntimeError(
                f"entropylens recording needs {SAMPLE_ID} and {STEP} (int64 per sample) in the batch: rows are "
                "joined by id, never by position (mini-batches are shuffled). trainer.v1.trainer_mode=entropylens "
                "puts them there.")
        sid = td[SAMPLE_ID].reshape(-1).long()  # [B]
        steps = td[STEP].reshape(-1).long()  # [B]
        step = int(steps.max())  # one host sync
        if old_entropy is None:
            self._warn_once("old_entropy", "entropylens: no old-policy entropy in the batch; entropy_ratio is not recorded")
        columns = dict(out.columns)
        if spp is not None and exact:
            temp = data["temperature"] if "temperature" in keys else 1.0
            if not isinstance(temp, torch.Tensor):
                temp = float(getattr(temp, "data", temp))
            lgn = logit_grad_norm_from_sum_p2(columns["grad_coef"], log_prob, spp, temp)
            columns["logit_grad_norm"] = torch.where(mask, lgn, torch.zeros_like(lgn))
        update = self._update.get(step, 0)
        self._update = {step: update + 1}
        key = (str(self.record_dir), self.run)
        if key in _SEQUENCES and _SEQUENCES[key].step != step:  # before this update closes the earlier step
            _flush_sequences(key, rec)
        responses = _fit(td["responses"], mask.shape[-1])  # [B, T]
        rec.record_update(step, update, mask=mask, advantages=adv, logprobs=log_prob.detach(), old_logprobs=old_logp,
                          entropy=entropy.detach() if entropy is not None else None, old_entropy=old_entropy,
                          tokens=responses, seq_ids=sid, loss=_Columns(out, columns))
        self._add_sequences(key, step, sid, td, data, keys, mask, adv, responses)

    def _add_sequences(self, key, step, sid, td, data, keys, mask, adv, responses) -> None:
        """The sequences rows of this micro-batch's samples not yet seen in ``step`` (module docstring), kept
        until the step ends (one sequences file per step and rank, :func:`_flush_sequences`)."""
        score_key = next((k for k in REWARD_KEYS if k in keys), None)
        if score_key is None:
            if "no_score" not in self._warned:
                self._warned.add("no_score")
                logger.info("entropylens: no score (%s) in the actor's batch: no sequences rows", ", ".join(REWARD_KEYS))
            return
        pending = _SEQUENCES.setdefault(key, _StepSequences(step))
        n_tok = mask.sum(dim=1)  # [B]
        ids = sid.tolist()
        new = [i for i, (s, n) in enumerate(zip(ids, n_tok.tolist())) if n > 0 and s not in pending.seen]
        if not new:
            return
        pending.seen.update(ids[i] for i in new)
        pick = torch.tensor(new, device=mask.device)
        width = mask.shape[-1]
        lengths = _response_lengths(data, responses.shape[0], width)[pick.cpu()]  # [b]
        score = _fit(td[score_key], width).index_select(0, pick).double().sum(dim=1)  # [b]
        adv_seq = (adv.index_select(0, pick).double() * mask.index_select(0, pick)).sum(dim=1) / n_tok[pick]  # [b]
        texts = _response_texts(self.tokenizer, responses.index_select(0, pick).cpu(), lengths)
        pending.parts.append({"seq_ids": sid.index_select(0, pick).cpu(), "rewards": score.cpu(),
                              "advantages": adv_seq.cpu(), "lengths": lengths, "texts": texts})


@dataclass
class _StepSequences:
    """A step's sequences rows on this worker, not yet handed to its recorder."""

    step: int
    seen: set = field(default_factory=set)  # sample ids with a row
    parts: list = field(default_factory=list)  # per micro-batch: record_sequences' arguments


_SEQUENCES: dict[tuple[str, str], _StepSequences] = {}  # (root, run) -> the step's rows, per process


def _flush_sequences(key, rec) -> None:
    """Hand the buffered step's sequences rows to ``rec`` (one record_sequences call, before the step closes)."""
    pending = _SEQUENCES.pop(key, None)
    if pending is None or not pending.parts:
        return
    parts = pending.parts
    texts = None if any(p["texts"] is None for p in parts) else [t for p in parts for t in p["texts"]]
    rec.record_sequences(pending.step, **{k: torch.cat([p[k] for p in parts]) for k in
                                          ("seq_ids", "rewards", "advantages", "lengths")}, texts=texts)


def _response_lengths(data, b: int, width: int) -> torch.Tensor:
    """int64 [B]: each response's own length (the nested ``responses``' row lengths; ``width`` if not nested)."""
    r = data["responses"] if "responses" in data.keys() else None
    if r is not None and getattr(r, "is_nested", False):
        return r.offsets().diff().cpu().clamp(max=width).long()
    return torch.full((b,), width, dtype=torch.int64)


_TOKENIZERS: dict[str, Any] = {}  # tokenizer name -> the tokenizer (None: it could not be loaded), per worker


def _response_texts(name: str | None, responses: torch.Tensor, lengths: torch.Tensor) -> list[str] | None:
    """Each response's text ([B, T] ids, each cut to its length), special tokens skipped as verl logs them;
    None without a tokenizer. The tokenizer is loaded once per worker process (local files only); one that
    cannot be loaded warns once and leaves the texts out."""
    if not name:
        return None
    if name not in _TOKENIZERS:
        from ...token_text import TokenTextWarning, load_tokenizer

        try:
            _TOKENIZERS[name] = load_tokenizer(name)
        except Exception as e:  # noqa: BLE001 - texts are optional: say why, record the rest
            _TOKENIZERS[name] = None
            warnings.warn(f"entropylens: tokenizer {name} could not be loaded on this worker ({type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}); sequences are recorded without texts",
                          TokenTextWarning, stacklevel=2)
    tok = _TOKENIZERS[name]
    if tok is None:
        return None
    rows = [r[: int(n)].tolist() for r, n in zip(responses, lengths)]
    return list(tok.batch_decode(rows, skip_special_tokens=True))


@dataclass
class _Columns:
    """A policy_loss output with extra token columns (the recorder stores columns as given)."""

    _out: Any
    columns: dict

    @property
    def loss(self):
        return self._out.loss

    @property
    def config(self):
        return self._out.config

    @property
    def metrics(self):
        return self._out.metrics


# ----------------------------------------------------------------------------------- checkpoints
CHECKPOINT_RECORD = "entropylens.json"  # in verl's global_step_N folder: the run that checkpoint belongs to


def write_checkpoint_record(folder, *, record_dir: str, run: str, step: int, next_sample_id: int) -> str:
    """Write ``<folder>/entropylens.json`` (atomically: a temporary file renamed into place): the
    entropylens run a verl checkpoint belongs to, its last step (the checkpoint's global step) and the
    next sample id (sample ids stay run-unique after a resume). Returns the file's path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, CHECKPOINT_RECORD)
    tmp = os.path.join(folder, f".{CHECKPOINT_RECORD}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump({"record_dir": str(record_dir), "run": run, "step": int(step),
                   "next_sample_id": int(next_sample_id)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_checkpoint_record(folder) -> dict | None:
    """The record :func:`write_checkpoint_record` left in a checkpoint folder; None where there is none
    (a checkpoint saved without recording, or by another trainer)."""
    path = os.path.join(folder, CHECKPOINT_RECORD)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rec = json.load(f)
    if not isinstance(rec, dict) or not {"run", "step", "next_sample_id"} <= set(rec):
        raise ValueError(f"{path} is not an entropylens checkpoint record (needs run, step, next_sample_id)")
    return rec


def resumed_checkpoint_folder(trainer_config, global_steps: int) -> str | None:
    """The global_step_N folder verl's ``_load_checkpoint`` resumed from (None when it started from
    scratch: global_steps 0), found as verl finds it (trainer.resume_mode auto: default_local_dir;
    resume_path: resume_from_path)."""
    if not global_steps:
        return None
    tr = trainer_config
    if tr.resume_mode == "resume_path":
        folder = str(tr.resume_from_path)
    else:
        folder = os.path.join(str(tr.default_local_dir), f"global_step_{int(global_steps)}")
    return os.path.abspath(folder)


@dataclass
class ResumePlan:
    """What a (re)started verl job records into: ``run``, ``resume`` (the step it continues after, or
    None for a new run) and the first sample id; ``note`` says why, for the log."""

    run: str
    resume: int | None
    next_sample_id: int
    note: str


def resume_plan(folder: str | None, global_steps: int, run_given: str | None, new_run: str) -> ResumePlan:
    """Where a verl job that loaded checkpoint ``folder`` (global step ``global_steps``; None / 0: from
    scratch) records. The checkpoint's record names the run it belongs to: that run continues after the
    checkpoint's step (the crashed job's later steps are recorded again), unless ``policy_loss.run``
    (``run_given``) names another run, which then starts new. A checkpoint without a record (saved
    without recording) starts ``run_given`` or ``new_run``."""
    if folder is None or not global_steps:
        return ResumePlan(run_given or new_run, None, 0, "from scratch")
    rec = read_checkpoint_record(folder)
    if rec is None:
        run = run_given or new_run
        return ResumePlan(run, None, 0, f"checkpoint {folder} carries no entropylens record (saved without "
                                        f"recording): run {run!r} starts new at step {int(global_steps) + 1}")
    if int(rec["step"]) != int(global_steps):
        raise ValueError(f"{os.path.join(folder, CHECKPOINT_RECORD)} says step {rec['step']}, verl resumed from "
                         f"global step {global_steps}: the record does not belong to this checkpoint")
    if run_given and run_given != rec["run"]:
        return ResumePlan(run_given, None, int(rec["next_sample_id"]),
                          f"checkpoint {folder} belongs to run {rec['run']!r}; policy_loss.run={run_given!r} "
                          f"starts that run new at step {int(global_steps) + 1}")
    return ResumePlan(rec["run"], int(global_steps), int(rec["next_sample_id"]),
                      f"run {rec['run']!r} continues after step {int(global_steps)} (checkpoint {folder})")


# ----------------------------------------------------------------------------------- trainer
class _MetricShares:
    """The actor worker group as verl's ``_update_actor`` sees it, with one change: ``update_actor``'s
    metrics lose the additive shares (``entropylens/_sum/...``) before verl averages them over
    mini-batches (reduce_metrics); their totals over the step are kept in ``sums``."""

    def __init__(self, wg):
        self._wg = wg
        self.sums: dict[str, float] = {}

    def update_actor(self, *args, **kwargs):
        from verl.utils import tensordict_utils as tu

        out = self._wg.update_actor(*args, **kwargs)
        metrics = dict(out["metrics"])
        for k in [k for k in metrics if k.startswith(SUM_PREFIX)]:
            name = k[len(SUM_PREFIX):]
            self.sums[name] = self.sums.get(name, 0.0) + _total(metrics.pop(k))
        tu.assign_non_tensor(out, metrics=metrics)
        return out

    def __getattr__(self, name):
        return getattr(self._wg, name)


def _trainer_class():
    """verl's sync v1 trainer + entropylens (``trainer.v1.trainer_mode=entropylens``)."""
    import transfer_queue as tq
    from omegaconf import open_dict
    from tensordict import TensorDict
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.utils.config import omega_conf_to_dataclass

    class EntropyLensTrainer(PPOTrainerSync):
        """See the module docstring, layer 3. Runs as verl's ``sync`` mode (the mode's config section,
        replay buffer and weight sync are sync's); only the actor update path is extended."""

        def __init__(self, config):
            check_verl_version()
            check_registered()
            pl = config.actor_rollout_ref.actor.policy_loss
            if method_of(str(pl.loss_mode)) is None:
                raise ValueError(f"trainer_mode=entropylens needs an entropylens loss_mode ({', '.join(registered_names())}), "
                                 f"got {pl.loss_mode!r}")
            eps_from(config.actor_rollout_ref.actor, method_of(str(pl.loss_mode)))  # refused here, not on a worker
            self._el_run_given = pl.get("run") or None
            self._el_new_run = f"{method_of(str(pl.loss_mode))}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
            with open_dict(config):
                config.trainer.v1.trainer_mode = "sync"
                config.actor_rollout_ref.actor.calculate_entropy = True  # H of the current policy reaches the loss
                if pl.get("record_dir") and not pl.get("run"):
                    pl.run = self._el_new_run
            super().__init__(config)
            self._el_next_id = 0
            self._el_old_entropy_checked = False

        def init(self):
            super().init()  # verl's _load_checkpoint ran: global_steps is the resumed checkpoint's step (0: none)
            actor_cfg = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)  # as the worker builds it
            run, resume = None, None
            if _pl_get(actor_cfg, "record_dir"):
                plan = resume_plan(resumed_checkpoint_folder(self.config.trainer, self.global_steps),
                                   self.global_steps, self._el_run_given, self._el_new_run)
                run, resume, self._el_next_id = plan.run, plan.resume, plan.next_sample_id
                if self.global_steps:  # a restarted job: say which run it records into, and why
                    logger.warning("entropylens: %s", plan.note)
            self._el_loss = EntropyLensLoss(actor_cfg, run=run, resume=resume,
                                            tokenizer=_pl_get(actor_cfg, "tokenizer") or self._el_tokenizer_name())
            self.actor_rollout_wg.set_loss_fn(self._el_loss)
            self._el_exact = bool(_pl_get(actor_cfg, "exact_logit_grad_norm", True))
            self._el_fused_warned = False

        def _el_tokenizer_name(self) -> str | None:
            """The name of verl's tokenizer, for run.json and the workers (which load it, local files only):
            the trainer's ``self.tokenizer`` (its local copy's path or hub name), else the model config's
            tokenizer_path / path (what verl loads it from)."""
            name = getattr(getattr(self, "tokenizer", None), "name_or_path", None)
            model = self.config.actor_rollout_ref.model
            return str(name or model.get("tokenizer_path", None) or model.get("path", None) or "") or None

        def _save_checkpoint(self):
            """Before verl saves checkpoint N: every worker commits its recorded steps (all <= N: whole
            files on disk), then global_step_N/entropylens.json names the run, so a job resumed from this
            checkpoint continues it after step N (:func:`resume_plan`)."""
            loss = self._el_loss
            if loss.record_dir:
                self.actor_rollout_wg.set_loss_fn(loss.shipped(committing=True))
                folder = os.path.join(str(self.config.trainer.default_local_dir), f"global_step_{self.global_steps}")
                write_checkpoint_record(folder, record_dir=loss.record_dir, run=loss.run, step=self.global_steps,
                                        next_sample_id=self._el_next_id)
            return super()._save_checkpoint()

        def _el_ensure_old_entropy(self, batch):
            """v1 keeps the old-policy entropy in the batch as ``entropy`` (written by _compute_old_log_prob);
            bypass mode (old_log_probs = rollout_log_probs) computes none: then the actor, not yet updated
            this step, computes it here (it is the old policy)."""
            fields = set(getattr(batch, "fields", None) or ())
            if fields & {"entropy", "entropylens_old_entropy"}:
                return batch
            try:  # a meta without its field list: ask the store (TransferQueue 0.1.11 answers a missing
                # field with an empty TensorDict, older releases raised ValueError)
                got = tq.kv_batch_get(keys=batch.keys[:1], partition_id=batch.partition_id, select_fields=["entropy"])
                if "entropy" in got.keys():
                    return batch
            except ValueError:  # "field doesn't exist": compute it below
                pass
            batch.extra_info.update({"calculate_entropy": True, "compute_loss": False,
                                     "temperature": self.config.actor_rollout_ref.rollout.temperature})
            self.actor_rollout_wg.compute_log_prob(batch)
            from verl.workers.utils.padding import response_from_nested

            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                   select_fields=["entropy", "response_mask"])
            fields = TensorDict({"entropylens_old_entropy": response_from_nested(data["entropy"], data["response_mask"])},
                                batch_size=len(batch.keys))
            return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)

        def _el_take_ids(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            """(sample ids, steps), int64 [n] each: the next n run-unique sample ids (they go on after a
            resume: the checkpoint record keeps the next one) and the current step."""
            ids = torch.arange(self._el_next_id, self._el_next_id + n, dtype=torch.int64)
            self._el_next_id += n
            return ids, torch.full((n,), int(self.global_steps), dtype=torch.int64)

        def _el_step_done(self) -> None:
            """The actor update is done: every worker writes the step now (Recorder.end_step), not when
            the next step's first update arrives, after its rollout (a kill there lost the step)."""
            if self._el_loss.record_dir:
                self.actor_rollout_wg.set_loss_fn(self._el_loss.shipped(ending=True))

        def _update_actor(self, batch, metrics):
            n = len(batch.keys)
            ids, steps = self._el_take_ids(n)
            batch = self._el_ensure_old_entropy(batch)
            extra = dict(batch.extra_info)
            batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                                    fields=TensorDict({SAMPLE_ID: ids, STEP: steps}, batch_size=n))
            batch.extra_info.update(extra)
            batch.extra_info["calculate_sum_pi_squared"] = self._el_sum_pi_squared()
            own: dict = {}
            wg, capture = self.actor_rollout_wg, _MetricShares(self.actor_rollout_wg)
            self.actor_rollout_wg = capture  # verl's _update_actor calls update_actor on it
            try:
                batch = super()._update_actor(batch, own)
            finally:
                self.actor_rollout_wg = wg
            self._el_step_done()
            for k, v in own.items():  # verl's own keys unchanged; ours (entropylens/loss) without actor/
                metrics[k.replace("actor/" + METRIC_PREFIX, METRIC_PREFIX, 1)] = v
            for k, v in step_values(capture.sums).items():  # exact values over the whole step
                metrics[METRIC_PREFIX + k] = v
            return batch

        def _el_sum_pi_squared(self) -> bool:
            """Ask the engine for sum_j pi_j^2 (the exact logit-gradient norm)? Not with verl's fused
            kernels, which never materialise the logits (verl refuses the request): logit_grad_norm is
            then not recorded (null), said once."""
            if not self._el_exact:
                return False
            if bool(self.config.actor_rollout_ref.model.get("use_fused_kernels", False)):
                if not self._el_fused_warned:
                    self._el_fused_warned = True
                    warnings.warn("entropylens: actor_rollout_ref.model.use_fused_kernels=True: verl's fused kernels "
                                  "do not give sum_j pi_j^2 (the logits are never materialised), so logit_grad_norm "
                                  "is not recorded (null); set use_fused_kernels=False to record it", stacklevel=2)
                return False
            return True

        def fit(self, *args, **kwargs):
            status = "failed"
            try:
                out = super().fit(*args, **kwargs)
                status = "finished"
                return out
            finally:  # every worker closes its recorder: the last step's steps file is written
                self.actor_rollout_wg.set_loss_fn(self._el_loss.shipped(closing=True, status=status))

    return EntropyLensTrainer


def register_trainer() -> bool:
    """Register ``trainer.v1.trainer_mode=entropylens``; False (logged) when verl's v1 trainer cannot be
    imported here (e.g. TransferQueue missing)."""
    try:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer as _reg
    except ImportError as e:
        logger.info("entropylens: verl's v1 trainer is not importable (%s); trainer_mode=entropylens unavailable", e)
        return False
    if "entropylens" not in TRAINER_REGISTRY:
        _reg("entropylens")(_trainer_class())
    return True


register_trainer()

__all__ = ["EntropyLensLossConfig", "EntropyLensLoss", "check_verl_version", "check_registered", "register",
           "register_trainer", "compute_loss", "agg_and_scale", "logit_grad_norm_from_sum_p2", "VERL_TESTED",
           "recording_rank", "megatron_layout", "metric_shares", "step_values", "verl_clip_metrics", "eps_from"]
