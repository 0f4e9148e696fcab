"""Layer 2: :class:`EntropyLensLoss`, an actor loss function in verl's ``loss_fn(model_output, data,
dp_group)`` form (a drop-in for ``verl.workers.utils.losses.ppo_loss``): entropylens' policy loss with
ERC on top (it sees H and H_old), verl's own metrics as ppo_loss makes them, the step metrics as
additive shares, and every micro-batch recorded on the recording ranks (docs/verl.md).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
from verl.utils.metric import AggregationType, Metric

from ...rl.forking import AdaptiveEntropyCoef, all_reduce_sum, gather_valid, top_entropy_mask
from ...rl.stats import logit_grad_norm_from_sum_p2
from .batch import MicroBatch, fit, non_tensor, read_micro_batch
from .config import pl_get
from .metrics import METRIC_PREFIX, SUM_PREFIX, metric_shares
from .names import OLD_ENTROPY_KEYS, SAMPLE_ID, STEP, method_of, new_run_id, registered_names
from .ranks import dp_rank
from .recorders import (
    add_sequences,
    close_recorders,
    commit_recorders,
    end_step_recorders,
    flush_earlier_sequences,
    open_recorder,
)
from .registered import compute_loss, verl_clip_metrics, verl_metric_keys

# the adaptive entropy controllers of this worker, by (record_dir, run): [controller, its last step]
_CONTROLLERS: dict[tuple[str, str | None], list] = {}


class EntropyLensLoss:
    """verl actor loss function ``(model_output, data, dp_group) -> (loss, metrics)``: verl's ``ppo_loss``
    with entropylens' policy loss (ERC included: this function sees H and H_old) and recording.

    The trainer mode (trainer_mode=entropylens) builds it and installs it on every actor worker
    (``set_loss_fn``); each call computes a micro-batch's loss and, on the recording ranks, records it.

    Args:
        config: the ActorConfig as verl's worker builds it (``omega_conf_to_dataclass(actor)``); its
            ``policy_loss`` is an :class:`EntropyLensLossConfig` (or carries the same fields), whose
            loss_mode must be one of entropylens' losses.
        run: the run id agreed once (the trainer picks it on the driver); None: ``policy_loss.run``, and
            without one, with recording, rank 0 of the recording dp group broadcasts one.
        closing: True: unpickling this object on a worker closes that worker's recorders (how the trainer
            flushes the last step on every rank). Default False.
        resume: the step a resumed job continues after (the verl checkpoint's global step;
            ``Recorder(resume=...)``: the run's steps after it are removed and recorded again). None: a new
            run.
        committing: True: unpickling it commits the worker's recorders (how the trainer commits every rank's
            steps at a checkpoint); the object is then the worker's loss function as before. Default False.
        ending: True: unpickling it ends their step (how the trainer has every rank write a step as soon as
            its actor update is done); the object is then the worker's loss function as before. Default
            False.
        tokenizer: the tokenizer's name or local path (``policy_loss.tokenizer`` when None): run.json names
            it and each worker loads it once to decode the responses' texts (sequences.text).

    Raises:
        ValueError: when ``policy_loss.loss_mode`` is not an entropylens loss.
    """

    status: str  # the run's final status, on a closing copy only (:meth:`shipped`)

    def __init__(
        self,
        config: Any,
        *,
        run: str | None = None,
        closing: bool = False,
        resume: int | None = None,
        committing: bool = False,
        ending: bool = False,
        tokenizer: str | None = None,
    ) -> None:
        self.config = config
        pl = config.policy_loss
        method = method_of(pl.loss_mode)
        if method is None:
            raise ValueError(
                f"EntropyLensLoss: policy_loss.loss_mode={pl.loss_mode!r} is not an entropylens loss; "
                f"use one of {', '.join(registered_names())}"
            )
        self.method = method
        lo, hi = pl_get(config, "erc_low"), pl_get(config, "erc_high")
        self.erc = None if lo is None else (float(lo), float(hi))
        self.record_dir = pl_get(config, "record_dir")
        self.run = run or pl_get(config, "run")
        self.sample = float(pl_get(config, "sample", 1.0))
        self.tau = float(pl_get(config, "tau", 0.5))
        self.closing = closing
        self.committing = committing
        self.ending = ending
        self.resume = resume
        self.tokenizer = tokenizer or pl_get(config, "tokenizer")
        self._update: dict[int, int] = {}
        self._warned: set[str] = set()
        self.top_entropy_quantile = float(pl_get(config, "top_entropy_quantile", 1.0))
        self.adaptive_entropy = None  # AdaptiveEntropyCoef's arguments when on
        if pl_get(config, "adaptive_entropy", False):
            self.adaptive_entropy = dict(
                target=float(pl_get(config, "entropy_target", 0.2)),
                coef=float(getattr(config, "entropy_coeff", 0.0) or 0.0),
                delta=float(pl_get(config, "entropy_coef_delta", 0.005)),
                coef_min=float(pl_get(config, "entropy_coef_min", 0.0)),
                coef_max=float(pl_get(config, "entropy_coef_max", 1.0)),
            )

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

    def shipped(
        self, *, committing: bool = False, ending: bool = False, closing: bool = False, status: str = "finished"
    ) -> EntropyLensLoss:
        """A copy of this loss function for ``set_loss_fn`` that commits (``committing``), ends the step
        in (``ending``) or closes (``closing``, with the run's final ``status``) the recorders of every
        worker it reaches."""
        out = copy.copy(self)
        out.committing, out.ending, out.closing, out.status = committing, ending, closing, status
        out._update, out._warned = {}, set()
        return out

    def __call__(self, model_output: Any, data: Any, dp_group: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
        config = self.config
        aggregation = _global_batch_info(config, data)
        b = read_micro_batch(model_output, data)
        self._check(b)
        entropy_coef = float(getattr(config, "entropy_coeff", 0.0) or 0.0) if b.entropy is not None else 0.0
        keep, ctrl = self._forking_and_adaptive(b, dp_group)
        if ctrl is not None:
            entropy_coef = ctrl.applied
        out = compute_loss(
            self.method,
            b.old_log_prob,
            b.log_prob,
            b.advantages,
            b.mask,
            config.loss_agg_mode,
            config,
            entropy=b.entropy,
            old_entropy=b.old_entropy if b.entropy is not None else None,
            erc=self.erc,
            entropy_coef=entropy_coef,
            token_mask=keep,
            is_weight=b.is_weight,
        )
        if ctrl is not None:
            out.config["entropy_coef_adaptive"] = ctrl.coef
            out.config.update(ctrl.settings())
        if keep is not None:
            out.config["top_entropy_quantile"] = self.top_entropy_quantile
        loss, metrics, ent_loss = _verl_terms(config, b, out.loss, aggregation)
        clip = verl_clip_metrics(
            b.log_prob,
            b.old_log_prob,
            b.advantages,
            b.mask,
            config,
            self.method,
            cov_clipped=out.columns.get("cov_clipped"),
        )
        metrics.update(
            _loss_metrics(
                out, verl_metric_keys(self.method), clip, ent_loss, entropy_coef, aggregation, int(data["dp_size"] or 1)
            )
        )
        rec = self._recorder(dp_group, dynamic_cp=non_tensor(data, "local_cp_size") is not None)
        if rec is not None:
            self._record(rec, out, b, exact=entropy_coef == 0.0 and not config.use_kl_loss)
        return loss, metrics

    def _forking_and_adaptive(self, b: MicroBatch, dp_group):
        """The forking mask [B, T] (None: off) and the adaptive controller (None: off) for micro-batch ``b``:
        the quantile over the data-parallel group (every rank runs the same number of micro-batches, as
        verl's data-parallel update does); the controller lives on the worker (``_CONTROLLERS``: a shipped
        copy of this object finds it again), steps once per training step (the first micro-batch of a new
        step moves it with the previous step's entropy, summed over the group), and takes each
        micro-batch's entropies over the tokens the bonus acts on."""
        q = getattr(self, "top_entropy_quantile", 1.0)
        adaptive = getattr(self, "adaptive_entropy", None)
        if q >= 1.0 and adaptive is None:
            return None, None
        if b.entropy is None:
            raise RuntimeError(
                "entropylens: policy_loss.top_entropy_quantile / adaptive_entropy need the entropy "
                "(actor.calculate_entropy=True; trainer.v1.trainer_mode=entropylens provides it)"
            )
        group = dp_group if dp_group is not None and torch.distributed.is_initialized() else None
        keep = None
        if q < 1.0:
            keep = top_entropy_mask(
                b.entropy, b.mask, q, all_gather=None if group is None else (lambda t: gather_valid(t, group))
            )
        if adaptive is None:
            return keep, None
        if STEP not in b.keys:
            raise RuntimeError(
                f"entropylens: policy_loss.adaptive_entropy needs {STEP} in the batch "
                "(trainer.v1.trainer_mode=entropylens puts it there)"
            )
        step = int(b.td[STEP].reshape(-1).long().max())
        key = (str(self.record_dir), str(pl_get(self.config, "run")))
        if key not in _CONTROLLERS:
            _CONTROLLERS[key] = [AdaptiveEntropyCoef(**adaptive), None]
        ctrl, seen = _CONTROLLERS[key]
        if seen is not None and step != seen:
            ctrl.step(all_reduce_sum(group))
        _CONTROLLERS[key][1] = step
        e = b.mask.float() if keep is None else b.mask.float() * keep.float()
        ctrl.observe(b.entropy, e)
        return keep, ctrl

    def _check(self, b: MicroBatch) -> None:
        """Refuse what this loss cannot do: ERC without both entropies."""
        if self.erc is not None and (b.entropy is None or b.old_entropy is None):
            raise RuntimeError(
                "entropylens ERC needs the current entropy (actor.calculate_entropy=True) and the old policy's "
                f"entropy in the batch (one of {', '.join(OLD_ENTROPY_KEYS)}); got entropy="
                f"{'yes' if b.entropy is not None else 'no'}, batch keys={sorted(b.keys)}. "
                "trainer.v1.trainer_mode=entropylens provides both."
            )

    def _recorder(self, dp_group, *, dynamic_cp: bool = False):
        """This process's recorder; None without recording, in a closing copy, or on a rank that does not
        record (:func:`~.ranks.dp_rank`). A run id not given is agreed here, at the first call."""
        if not self.record_dir or self.closing:
            return None
        rank, world, records = dp_rank(dp_group, dynamic_cp=dynamic_cp)
        if not records:
            return None
        if self.run is None:
            self.run = _agreed_run_id(self.method, world, dp_group)
        return open_recorder(self, rank, world)

    def _warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=3)

    def _record(self, rec, out, b: MicroBatch, *, exact: bool) -> None:
        """Record micro-batch ``b`` (joined by sample id, never by position) and buffer its sequences rows."""
        if SAMPLE_ID not in b.keys or STEP not in b.keys:
            raise RuntimeError(
                f"entropylens recording needs {SAMPLE_ID} and {STEP} (int64 per sample) in the batch: rows are "
                "joined by id, never by position (mini-batches are shuffled). trainer.v1.trainer_mode=entropylens "
                "puts them there."
            )
        sid = b.td[SAMPLE_ID].reshape(-1).long()  # [B]
        step = int(b.td[STEP].reshape(-1).long().max())  # one host sync
        if b.old_entropy is None:
            self._warn_once(
                "old_entropy", "entropylens: no old-policy entropy in the batch; entropy_ratio is not recorded"
            )
        columns = _token_columns(out, b, exact)
        update = self._update.get(step, 0)
        self._update = {step: update + 1}
        key = (str(self.record_dir), self.run)
        flush_earlier_sequences(key, rec, step)  # before this update closes the earlier step
        responses = fit(b.td["responses"], b.width)  # [B, T]
        rec.record_update(
            step,
            update,
            mask=b.mask,
            advantages=b.advantages,
            logprobs=b.log_prob.detach(),
            old_logprobs=b.old_log_prob,
            entropy=b.entropy.detach() if b.entropy is not None else None,
            old_entropy=b.old_entropy,
            tokens=responses,
            seq_ids=sid,
            loss=_Columns(out, columns),
            sampler_logprobs=b.rollout_log_prob,
        )
        add_sequences(key, step, b, sid, responses, tokenizer=self.tokenizer, warned=self._warned)


def _global_batch_info(config, data) -> AggregationType:
    """verl's global normalisation, set as ppo_loss sets it (``config.global_batch_info`` from the
    micro-batch's global counts); returns the aggregation of the loss-like metrics: SUM under global
    normalisation, else MEAN."""
    config.global_batch_info["dp_size"] = data["dp_size"]
    config.global_batch_info["batch_num_tokens"] = data["batch_num_tokens"]
    config.global_batch_info["global_batch_size"] = data["global_batch_size"]
    config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
    global_norm = (
        data["dp_size"] > 1
        or data["batch_num_tokens"] is not None
        or data["global_batch_size"] is not None
        or config.loss_scale_factor is not None
    )
    return AggregationType.SUM if global_norm else AggregationType.MEAN


def _verl_terms(config, b: MicroBatch, loss, aggregation):
    """ppo_loss's entropy and KL terms: ``actor/entropy_loss`` (reported), the KL loss (added to ``loss``;
    ``kl_loss``, ``kl_coef``). Returns (loss, those metrics, the aggregated entropy or None)."""
    metrics: dict[str, Any] = {}
    ent_loss = None
    if b.entropy is not None:  # as ppo_loss reports it
        ent_loss = agg_loss(
            loss_mat=b.entropy.detach(),
            loss_mask=b.mask,
            loss_agg_mode=config.loss_agg_mode,
            **config.global_batch_info,
        )
        metrics["actor/entropy_loss"] = Metric(value=ent_loss, aggregation=aggregation)
    if config.use_kl_loss:
        kld = kl_penalty(
            logprob=b.log_prob, ref_logprob=fit(b.td["ref_log_prob"], b.width), kl_penalty=config.kl_loss_type
        )
        kl_loss = agg_loss(
            loss_mat=kld, loss_mask=b.mask, loss_agg_mode=config.loss_agg_mode, **config.global_batch_info
        )
        loss = loss + kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=aggregation)
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics, ent_loss


def _loss_metrics(out, clip_keys, clip, ent_loss, entropy_coef: float, aggregation, dp_size: int) -> dict[str, Any]:
    """verl's keys as ppo_loss makes them: pg_loss without the entropy bonus (out.loss = pg - coef * H_agg),
    the clip diagnostics ``clip`` under ``clip_keys`` (those verl's own loss of the method returns:
    registered.verl_metric_keys) averaged over micro-batches (Metric MEAN, as ppo_loss wraps a policy loss's
    metrics); ours: the back-propagated policy loss (bonus included) with pg_loss's aggregation, and the
    step metrics as additive shares (Metric SUM), which EntropyLensTrainer turns into step values."""
    host = torch.cat(
        [
            clip,
            ent_loss.detach().double().reshape(1)
            if ent_loss is not None
            else torch.zeros(1, dtype=torch.float64, device=clip.device),
        ]
    ).tolist()  # one host copy
    scal = out.scalars()  # one host copy
    total = scal.get("loss", float("nan"))
    n_clip = len(clip_keys)
    metrics = {"actor/pg_loss": Metric(value=total + entropy_coef * host[n_clip], aggregation=aggregation)}
    for key, v in zip(clip_keys, host[:n_clip]):
        metrics[key] = Metric(value=v, aggregation=AggregationType.MEAN)
    metrics[METRIC_PREFIX + "loss"] = Metric(value=total, aggregation=aggregation)
    for k, v in metric_shares(scal, dp_size).items():
        metrics[SUM_PREFIX + k] = Metric(value=v, aggregation=AggregationType.SUM)
    return metrics


def _agreed_run_id(method: str, world: int, dp_group) -> str:
    """A new run id, agreed within the recording dp group (its first member's id)."""
    rid = [new_run_id(method)]
    if world > 1 and dp_group is not None:
        src = torch.distributed.get_global_rank(dp_group, 0)
        torch.distributed.broadcast_object_list(rid, src=src, group=dp_group)
    return rid[0]


def _token_columns(out, b: MicroBatch, exact: bool) -> dict:
    """policy_loss's token columns, plus ``logit_grad_norm`` from the engine's sum pi^2 where the loss has
    no entropy bonus and no KL term (``exact``: docs/verl.md, "Logit-gradient norm without logits")."""
    columns = dict(out.columns)
    if b.sum_pi_squared is not None and exact:
        temp = b.data["temperature"] if "temperature" in b.keys else 1.0
        if not isinstance(temp, torch.Tensor):
            temp = float(getattr(temp, "data", temp))
        lgn = logit_grad_norm_from_sum_p2(columns["grad_coef"], b.log_prob, b.sum_pi_squared, temp)
        columns["logit_grad_norm"] = torch.where(b.mask, lgn, torch.zeros_like(lgn))
    return columns


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
