"""The settings: :class:`EntropyLensLossConfig` (verl's policy-loss config plus entropylens' fields) and
what is read from verl's actor config: eps (:func:`eps_from`), the aggregation with verl's global
counts (:func:`agg_and_scale`), and whether the run trains on-policy (:func:`on_policy`, from the trainer's
whole config: the train batch size is not in the actor's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from verl.workers.config import ActorConfig, PolicyLossConfig

from .names import check_registered, method_of, registered_names

DAPO_EPS_HIGH = 0.28  # DAPO's clip-higher (Yu et al. 2025): eps_low 0.2, eps_high 0.28
# report.run_findings.ON_POLICY_TEXT with verl's settings in place of TRL's
ON_POLICY_TEXT = (
    "every ratio is 1: clipping, CE-GPPO and ERC cannot act; set actor_rollout_ref.actor.ppo_epochs > 1 "
    "or ppo_mini_batch_size < data.train_batch_size"
)


@dataclass
class EntropyLensLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig plus entropylens' settings (``policy_loss._target_`` points here).

    Its fields are verl's PolicyLossConfig's, then the ones below (hydra sets them from
    ``actor_rollout_ref.actor.policy_loss.<field>``, each with a leading ``+``). verl's ``loss_mode``: a verl
    loss name; ``gppo`` / ``ce_gppo`` / ``entropylens_grpo`` ... are ours.

    Args:
        beta1: CE-GPPO's scale of the low-side (A<0, r<1-eps_low) clipped tokens' gradient (paper: 0.5 at
            1.5B, 0.75 at 7B). Default 0.5.
        beta2: CE-GPPO's scale of the high-side (A>0, r>1+eps_high) clipped tokens' gradient (paper: 1.0).
            Default 1.0.
        erc_low: the ERC band's low end on rho = H / H_old, set together with erc_high (both set = ERC on;
            paper 0.95). Needs the entropylens loss function (trainer_mode=entropylens), which sees the
            entropies. Default None.
        erc_high: the ERC band's high end (paper 1.05). Default None.
        record_dir: where runs are recorded (a path every actor worker can write; None = no recording).
        run: run id (None: the trainer picks one, once, on the driver).
        sample: token-row keep fraction, in (0, 1] (the Recorder's ``sample``). Default 1.0.
        tau: HP/LP threshold, in (0, 1]. Default 0.5.
        exact_logit_grad_norm: ask the engine for sum_pi^2 (an extra [N, V] pass) for the exact
            logit_grad_norm. Default True.
        tokenizer: the tokenizer (a local path or cached hub name) that decodes the responses' texts and that
            run.json names for a token viewer; None: the one verl's trainer loaded (trainer_mode=entropylens).
        top_entropy_quantile: the 80/20 forking-token rule (TRL's option of that name): the policy term on the
            top q of valid tokens by entropy, the quantile over the data-parallel group's micro-batch
            (``entropylens.rl.forking``); in [0, 1], 1 = off (default). Needs actor.calculate_entropy
            (trainer_mode=entropylens).
        adaptive_entropy: TRL's use_adaptive_entropy: actor.entropy_coeff is the start of a coefficient moved
            by entropy_coef_delta towards entropy_target (clamped to [entropy_coef_min, entropy_coef_max]) once
            per training step, applied only while the previous step's entropy is at or below the target.
            Default False.
        entropy_target: the adaptive coefficient's target entropy. Default 0.2.
        entropy_coef_delta: how far the adaptive coefficient moves per training step. Default 0.005.
        entropy_coef_min: the adaptive coefficient's lower clamp. Default 0.0.
        entropy_coef_max: the adaptive coefficient's upper clamp (>= entropy_coef_min). Default 1.0.

    Raises:
        ValueError: when only one of erc_low / erc_high is set or the band is not 0 <= erc_low < 1 <
            erc_high, ERC or record_dir comes with one of verl's own losses, beta1 or beta2 is < 0, sample or
            tau is not in (0, 1], top_entropy_quantile is not in [0, 1], or with adaptive_entropy
            entropy_coef_min > entropy_coef_max.
        RuntimeError: when entropylens' losses are not registered in verl.
    """

    beta1: float = 0.5
    beta2: float = 1.0
    erc_low: float | None = None
    erc_high: float | None = None
    record_dir: str | None = None
    run: str | None = None
    sample: float = 1.0
    tau: float = 0.5
    exact_logit_grad_norm: bool = True
    tokenizer: str | None = None
    top_entropy_quantile: float = 1.0
    adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0

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
        if not 0.0 <= float(self.top_entropy_quantile) <= 1.0:
            raise ValueError(f"policy_loss.top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        if self.adaptive_entropy and not self.entropy_coef_min <= self.entropy_coef_max:
            raise ValueError(
                f"policy_loss.entropy_coef_min {self.entropy_coef_min} > entropy_coef_max {self.entropy_coef_max}"
            )
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(f"policy_loss.tau must be in (0, 1], got {self.tau}")

    @property
    def erc(self) -> tuple[float, float] | None:
        if self.erc_low is None:
            return None
        assert self.erc_high is not None  # __post_init__: erc_low and erc_high are set together
        return (float(self.erc_low), float(self.erc_high))


def pl_get(config, key: str, default=None):
    """A field of ``config.policy_loss`` (dataclass or DictConfig), or ``default``."""
    pl = getattr(config, "policy_loss", None) if config is not None else None
    if pl is None:
        return default
    v = pl.get(key, default) if hasattr(pl, "get") and not hasattr(pl, key) else getattr(pl, key, default)
    return default if v is None and default is not None else v


def verl_default(field: str):
    """The default of one of verl's ActorConfig fields (its dataclass; actor.yaml sets the same values)."""
    return {f.name: f.default for f in dataclasses.fields(ActorConfig)}[field]


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
            f"{DAPO_EPS_HIGH} (DAPO's clip-higher), or use loss_mode=entropylens_grpo for a symmetric clip"
        )
    return low, high


def agg_and_scale(loss_agg_mode: str, mask: torch.Tensor, info: dict) -> tuple[str, float | torch.Tensor]:
    """Our aggregation (policy_loss's ``agg``: verl's five modes, seq-mean-token-sum-norm with
    ``loss_scale_factor``) and the scale that turns it into verl's ``agg_loss`` with global counts
    (docs/verl.md, "Aggregation"). ``info`` is ``config.global_batch_info`` (dp_size, batch_num_tokens,
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


def on_policy(config) -> str | None:
    """Why verl trains on-policy with the trainer's whole ``config`` (main_ppo's composed DictConfig), or None.

    verl recomputes the old log-probs with the actor before its update (unless
    ``algorithm.rollout_correction.bypass_mode``, where they are the rollout engine's), so the first
    mini-batch of each step starts from them: every ratio is 1 there. With ``actor.ppo_epochs == 1`` and one
    mini-batch (``actor.ppo_mini_batch_size >= data.train_batch_size``, both counted in prompts) that first
    update is the only one, and every ratio of the run is 1. The actor's config alone (what the loss
    functions see) has ppo_epochs and ppo_mini_batch_size but not data.train_batch_size: the rule needs the
    trainer's config (docs/verl.md, "On-policy")."""
    actor = config.actor_rollout_ref.actor
    epochs, mini = actor.get("ppo_epochs", 1), actor.get("ppo_mini_batch_size", None)
    train = config.get("data", {}).get("train_batch_size", None)
    corr = config.get("algorithm", {}).get("rollout_correction", None) or {}
    if epochs is None or mini is None or train is None or corr.get("bypass_mode", False):
        return None
    if int(epochs) != 1 or int(mini) < int(train):
        return None
    return (
        f"verl recomputes the old log-probs before the actor update, and actor.ppo_epochs 1 over one mini-batch "
        f"(ppo_mini_batch_size {int(mini)} >= data.train_batch_size {int(train)}) is one update per step"
    )
