"""verl (0.9.x) plug-in: CE-GPPO / GPPO policy losses, ERC, and per-token recording, without a fork.

Loaded on ``import verl`` through the setuptools entry point group ``verl.plugins`` (pyproject.toml);
importing this module registers the losses. Three layers, each usable alone:

1. Registered policy losses (``actor_rollout_ref.actor.policy_loss.loss_mode``): ``gppo``,
   ``ce_gppo`` (and ``entropylens_grpo`` / ``entropylens_dapo`` / ``entropylens_cispo``), each computed
   by :func:`entropylens.losses.policy_loss`. verl's signature
   ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)``
   sees no entropy, so ERC is not available at this layer.
   beta1 / beta2 (and the ERC band, recording settings) come from :class:`EntropyLensLossConfig`,
   set with ``actor_rollout_ref.actor.policy_loss._target_=entropylens.integrations.verl.EntropyLensLossConfig``
   (hydra instantiates it on every worker).
2. :class:`EntropyLensLoss`, an actor loss function in verl's ``loss_fn(model_output, data, dp_group)``
   form (a drop-in for ``verl.workers.utils.losses.ppo_loss``): it sees the current entropies
   (``model_output["entropy"]``), the old-policy entropies carried in the micro-batch, and
   ``sum_pi_squared``; so it applies ERC on top of any method, and records every micro-batch through
   one :class:`~entropylens.recorder.Recorder` per data-parallel rank.
3. The trainer ``trainer.v1.trainer_mode=entropylens`` (:func:`register_trainer`): verl's sync v1
   trainer that installs :class:`EntropyLensLoss` on every actor worker (``set_loss_fn``), agrees the
   run id once on the driver, writes an int64 sample id and the step into every sample of the batch
   (mini-batches are shuffled and dynamic batch sizing reorders rows: row position is never used),
   makes sure the old-policy entropy reaches the loss function (and computes it where verl did not),
   asks the engine for ``sum_pi_squared``, and logs our aggregates as ``entropylens/...``. At each
   checkpoint it commits every worker's recorded steps and leaves ``entropylens.json`` (the run, the
   step, the next sample id) in the checkpoint folder; a job resumed from that checkpoint continues
   the run after its step (:func:`resume_plan`).

Aggregation: verl normalises each micro-batch's loss by GLOBAL counts (``agg_loss``: dp_size,
batch_num_tokens, global_batch_size, loss_scale_factor). With n local tokens (B' local sequences with
tokens) that is our per-micro-batch aggregation times ``scale``:
    token-mean             scale = n * dp_size / batch_num_tokens
    token-sum              scale = n * dp_size                     (our token-mean weights)
    seq-mean-token-mean    scale = B' * dp_size / global_batch_size
    seq-mean-token-sum     scale = B' * dp_size / global_batch_size
    seq-mean-token-sum-norm  the same / loss_scale_factor (default: the response length T)
so ``grad_coef`` is the token's true dLoss/dlogp in verl's backward.

Logit-gradient norm without logits (verl's engine computes sum_j pi_j^2 when asked): for a loss that
reaches the logits z only through logp_a = log softmax(z/T)_a, with g = dLoss/dlogp_a,
    dLoss/dz = (g / T) (e_a - pi)  =>  ||dLoss/dz||_2 = |g| / T * sqrt(1 - 2 pi_a + sum_j pi_j^2).
Recorded when the loss has no entropy bonus and no KL term (otherwise that identity does not hold).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import secrets
import warnings
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

import torch

from ..losses import policy_loss
from ._version import require_tested
from ..stats import logit_grad_norm_from_sum_p2

VERL_TESTED = ("0.9",)  # major.minor releases whose loss / trainer / engine interfaces this was tested with
METHODS = ("gppo", "ce_gppo")  # registered under their own names
PREFIXED = ("grpo", "dapo", "cispo")  # registered as entropylens_<name> (verl has its own vanilla etc.)
SAMPLE_ID = "entropylens_sample_id"  # int64 [B] in the batch: run-unique id of the sample
STEP = "entropylens_step"  # int64 [B] in the batch: the trainer step the update belongs to
OLD_ENTROPY_KEYS = ("entropylens_old_entropy", "entropy", "old_entropys", "entropys")  # first found wins
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


def eps_from(config) -> tuple[float, float]:
    """verl's clip range: clip_ratio_low / clip_ratio_high, each defaulting to clip_ratio."""
    clip = float(getattr(config, "clip_ratio", 0.2))
    low = getattr(config, "clip_ratio_low", None)
    high = getattr(config, "clip_ratio_high", None)
    return (clip if low is None else float(low)), (clip if high is None else float(high))


def agg_and_scale(loss_agg_mode: str, mask: torch.Tensor, info: dict) -> tuple[str, float | torch.Tensor]:
    """Our aggregation and the scale that turns it into verl's ``agg_loss`` with global counts
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
        return "token-mean", n.double().clamp(min=1.0) * dp
    if loss_agg_mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        gbs = info.get("global_batch_size")
        if gbs is None and dp > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        scale = 1.0 if gbs is None else n_seq.double() * dp / float(gbs)
        agg = "seq-mean-token-mean" if loss_agg_mode == "seq-mean-token-mean" else "seq-mean-token-sum"
        if loss_agg_mode == "seq-mean-token-sum-norm":
            lsf = info.get("loss_scale_factor")
            scale = scale / float(lsf if lsf is not None else mask.shape[-1])
        return agg, scale
    raise ValueError(f"loss_agg_mode: unknown {loss_agg_mode!r}")


def compute_loss(method: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, *,
                 entropy=None, old_entropy=None, erc=None, entropy_coef: float = 0.0):
    """``policy_loss`` with verl's configuration: eps from clip_ratio_low/high, dual-clip from
    clip_ratio_c (verl applies it to every PPO loss; default 3), beta1/beta2 from the policy_loss
    config, aggregation with verl's global counts via ``scale``. Returns the PolicyLossOutput."""
    eps_low, eps_high = eps_from(config)
    info = dict(getattr(config, "global_batch_info", None) or {})
    agg, scale = agg_and_scale(loss_agg_mode, response_mask, info)
    scale = float(scale)
    scale = scale if scale > 0 else 1.0  # no token in this micro-batch: every weight is 0 anyway
    dual = None if method == "cispo" else float(getattr(config, "clip_ratio_c", 3.0) or 3.0)
    kw = dict(method=method, eps_low=eps_low, eps_high=eps_high, dual_clip=dual, agg=agg,
              beta1=float(_pl_get(config, "beta1", 0.5)), beta2=float(_pl_get(config, "beta2", 1.0)),
              tau=float(_pl_get(config, "tau", 0.5)), entropy=entropy, old_entropy=old_entropy, erc=erc,
              entropy_coef=entropy_coef)
    return policy_loss(log_prob, old_log_prob, advantages, response_mask, scale=scale, **kw)


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
        metrics = {METRIC_PREFIX + k: v for k, v in out.scalars().items()}
        metrics["actor/pg_clipfrac"] = metrics.get(METRIC_PREFIX + "clipped_frac", float("nan"))
        return out.loss, metrics

    loss_fn.__name__ = f"entropylens_{method}_policy_loss"
    loss_fn.__doc__ = f"entropylens' {method} as a verl policy loss (entropylens.losses.policy_loss)."
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
        _, rec = _RECORDERS.popitem()
        rec.close(status=status, _raise=False)


def end_step_recorders() -> None:
    """End the step in this process's recorders (:meth:`Recorder.end_step`): their files are written
    now, in the background, not when the next step's first update arrives."""
    for rec in _RECORDERS.values():
        rec.end_step()


def commit_recorders() -> None:
    """Commit this process's recorders (:meth:`Recorder.commit`): every step they recorded is in whole
    files on disk when this returns, so a job killed later has lost none of them."""
    for rec in _RECORDERS.values():
        rec.commit()


def dp_rank(dp_group) -> tuple[int, int, bool]:
    """(rank in the data-parallel group, its size, whether this process records). Model-parallel peers
    (Ulysses SP, TP) hold the same micro-batch: only the dp group that contains global rank 0 records,
    so each dp rank writes once."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, True
    if dp_group is None:
        return dist.get_rank(), dist.get_world_size(), True
    ranks = dist.get_process_group_ranks(dp_group)
    return dist.get_rank(dp_group), len(ranks), 0 in ranks



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
    object is then the worker's loss function as before.
    """

    def __init__(self, config, *, run: str | None = None, closing: bool = False, resume: int | None = None,
                 committing: bool = False, ending: bool = False):
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

    def _recorder(self, dp_group):
        if not self.record_dir or self.closing:
            return None
        rank, world, records = dp_rank(dp_group)
        if not records:
            return None
        if self.run is None:  # agreed once, within the recording dp group
            rid = [f"{self.method}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"]
            if world > 1:
                torch.distributed.broadcast_object_list(rid, src=0, group=dp_group)
            self.run = rid[0]
        key = (str(self.record_dir), self.run)
        rec = _RECORDERS.get(key)
        if rec is None:
            from ..recorder import Recorder

            eps_low, eps_high = eps_from(self.config)
            cfg = {"method": self.method, "framework": "verl", "eps_low": eps_low, "eps_high": eps_high,
                   "beta1": _pl_get(self.config, "beta1") if self.method == "ce_gppo" else None,
                   "beta2": _pl_get(self.config, "beta2") if self.method == "ce_gppo" else None,
                   "erc": list(self.erc) if self.erc else None,
                   "dual_clip": None if self.method == "cispo" else getattr(self.config, "clip_ratio_c", 3.0),
                   "loss_agg_mode": getattr(self.config, "loss_agg_mode", None),
                   "entropy_coeff": getattr(self.config, "entropy_coeff", None),
                   "ppo_epochs": getattr(self.config, "ppo_epochs", None)}
            rec = Recorder(self.record_dir, self.run, config=cfg, tau=self.tau, sample=self.sample,
                           rank=rank, world_size=world, resume=self.resume)
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

        scal = out.scalars()  # one host copy
        metrics["actor/pg_loss"] = Metric(value=scal.get("loss", float("nan")), aggregation=metric_aggregation)
        metrics["actor/pg_clipfrac"] = scal.get("clipped_frac", float("nan"))
        for k, v in scal.items():
            metrics[METRIC_PREFIX + k] = v

        rec = self._recorder(dp_group)
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
        rec.record_update(step, update, mask=mask, advantages=adv, logprobs=log_prob.detach(), old_logprobs=old_logp,
                          entropy=entropy.detach() if entropy is not None else None, old_entropy=old_entropy,
                          tokens=_fit(td["responses"], mask.shape[-1]), seq_ids=sid,
                          loss=_Columns(out, columns))


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
            self._el_loss = EntropyLensLoss(actor_cfg, run=run, resume=resume)
            self.actor_rollout_wg.set_loss_fn(self._el_loss)
            self._el_exact = bool(_pl_get(actor_cfg, "exact_logit_grad_norm", True))

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
            try:  # a meta without its field list: ask the store
                tq.kv_batch_get(keys=batch.keys[:1], partition_id=batch.partition_id, select_fields=["entropy"])
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
            ids, steps = self._el_take_ids(len(batch.keys))
            batch = self._el_ensure_old_entropy(batch)
            extra = dict(batch.extra_info)
            batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                                    fields=TensorDict({SAMPLE_ID: ids, STEP: steps}, batch_size=n))
            batch.extra_info.update(extra)
            batch.extra_info["calculate_sum_pi_squared"] = self._el_exact
            own: dict = {}
            batch = super()._update_actor(batch, own)
            self._el_step_done()
            for k, v in own.items():  # our aggregates as entropylens/..., verl's own keys unchanged
                metrics[k.replace("actor/" + METRIC_PREFIX, METRIC_PREFIX, 1)] = v
            return batch

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
           "register_trainer", "compute_loss", "agg_and_scale", "logit_grad_norm_from_sum_p2", "VERL_TESTED"]
