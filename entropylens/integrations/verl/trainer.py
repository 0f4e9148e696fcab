"""Layer 3: the trainer mode ``trainer.v1.trainer_mode=entropylens``, :class:`EntropyLensTrainer`: verl's
sync v1 trainer that installs :class:`~.loss_fn.EntropyLensLoss` on every actor worker, numbers the
samples, supplies the old-policy entropy and sum pi^2, logs the exact step metrics, and has every
worker end / commit / close its recorders at the step's end, at checkpoints and at the end of ``fit``
(docs/verl.md). Importing this module imports verl's v1 trainer (TransferQueue, Ray).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import transfer_queue as tq
from omegaconf import open_dict
from tensordict import TensorDict
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass

from .checkpoint import resume_plan, resumed_checkpoint_folder, write_checkpoint_record
from .config import ON_POLICY_TEXT, eps_from, on_policy, pl_get
from .loss_fn import EntropyLensLoss
from .metrics import MetricShares, logged_metrics
from .names import SAMPLE_ID, STEP, check_registered, method_of, new_run_id, registered_names
from .version import check_verl_version

logger = logging.getLogger(__name__)


class EntropyLensTrainer(PPOTrainerSync):
    """verl's sync v1 trainer + entropylens (``trainer.v1.trainer_mode=entropylens``). Runs as verl's
    ``sync`` mode (the mode's config section, replay buffer and weight sync are sync's); only the actor
    update path is extended. verl builds it for that trainer mode (``register_trainer``); it warns once
    (``OnPolicyWarning``) where every ratio of the run will be 1.

    Args:
        config: the trainer's whole config (main_ppo's composed DictConfig). Its
            ``actor_rollout_ref.actor.policy_loss`` holds the entropylens settings (:class:`EntropyLensLossConfig`);
            the trainer sets ``calculate_entropy`` on and, with ``record_dir`` and no ``run``, a new run id.

    Raises:
        ValueError: when the actor's loss_mode is not an entropylens loss, or is entropylens_dapo with verl's
            default clip_ratio_high.
        RuntimeError: when the verl release is not one this plug-in was tested with (without
            ``ENTROPYLENS_VERL_UNSAFE=1``), or entropylens' losses are not registered in verl.
    """

    actor_rollout_wg: Any  # verl's actor worker group (verl's init sets it; _update_actor swaps it for a while)

    def __init__(self, config: Any) -> None:
        check_verl_version()
        check_registered()
        pl = config.actor_rollout_ref.actor.policy_loss
        method = _loss_method(config)
        self._el_run_given = pl.get("run") or None
        self._el_new_run = new_run_id(method)
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
            config.actor_rollout_ref.actor.calculate_entropy = True  # H of the current policy reaches the loss
            if pl.get("record_dir") and not pl.get("run"):
                pl.run = self._el_new_run
        super().__init__(config)
        self._el_next_id = 0
        self._el_warn_on_policy(config)

    def _el_warn_on_policy(self, config) -> None:
        """Warn once, at the start (on the driver), when every ratio of the run will be 1
        (:func:`~.config.on_policy`), with TRL's OnPolicyWarning and its text in verl's settings."""
        why = on_policy(config)
        if why is not None:
            from ...report.run_findings import OnPolicyWarning

            warnings.warn(f"entropylens: on_policy: {ON_POLICY_TEXT} ({why})", OnPolicyWarning, stacklevel=3)

    def init(self):
        super().init()  # verl's _load_checkpoint ran: global_steps is the resumed checkpoint's step (0: none)
        actor_cfg = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)  # as the worker builds it
        run, resume = self._el_resume(actor_cfg)
        self._el_loss = EntropyLensLoss(
            actor_cfg, run=run, resume=resume, tokenizer=pl_get(actor_cfg, "tokenizer") or self._el_tokenizer_name()
        )
        self.actor_rollout_wg.set_loss_fn(self._el_loss)
        self._el_exact = bool(pl_get(actor_cfg, "exact_logit_grad_norm", True))
        self._el_fused_warned = False

    def _el_resume(self, actor_cfg) -> tuple[str | None, int | None]:
        """(run, resume) of the loss function: without recording (None, None); else the run and the step
        it continues after as :func:`~.checkpoint.resume_plan` finds them (the next sample id too)."""
        if not pl_get(actor_cfg, "record_dir"):
            return None, None
        plan = resume_plan(
            resumed_checkpoint_folder(self.config.trainer, self.global_steps),
            self.global_steps,
            self._el_run_given,
            self._el_new_run,
        )
        self._el_next_id = plan.next_sample_id
        if self.global_steps:  # a restarted job: say which run it records into, and why
            logger.warning("entropylens: %s", plan.note)
        return plan.run, plan.resume

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
        checkpoint continues it after step N (:func:`~.checkpoint.resume_plan`)."""
        loss = self._el_loss
        if loss.record_dir:
            self.actor_rollout_wg.set_loss_fn(loss.shipped(committing=True))
            folder = os.path.join(str(self.config.trainer.default_local_dir), f"global_step_{self.global_steps}")
            write_checkpoint_record(
                folder,
                record_dir=loss.record_dir,
                run=loss.run,
                step=self.global_steps,
                next_sample_id=self._el_next_id,
            )
        return super()._save_checkpoint()

    def _el_ensure_old_entropy(self, batch):
        """v1 keeps the old-policy entropy in the batch as ``entropy`` (written by _compute_old_log_prob);
        bypass mode (old_log_probs = rollout_log_probs) computes none: then the actor, not yet updated
        this step, computes it here (it is the old policy)."""
        if _has_old_entropy(batch):
            return batch
        batch.extra_info.update(
            {
                "calculate_entropy": True,
                "compute_loss": False,
                "temperature": self.config.actor_rollout_ref.rollout.temperature,
            }
        )
        self.actor_rollout_wg.compute_log_prob(batch)
        return _put_old_entropy(batch)

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
        """verl's actor update, the batch given run-unique sample ids, the step, the old-policy entropy and
        the request for sum pi^2; ``metrics`` gets verl's keys and the exact step values (docs/verl.md)."""
        n = len(batch.keys)
        ids, steps = self._el_take_ids(n)
        batch = self._el_ensure_old_entropy(batch)
        extra = dict(batch.extra_info)
        batch = tq.kv_batch_put(
            keys=batch.keys,
            partition_id=batch.partition_id,
            fields=TensorDict({SAMPLE_ID: ids, STEP: steps}, batch_size=n),
        )
        batch.extra_info.update(extra)
        batch.extra_info["calculate_sum_pi_squared"] = self._el_sum_pi_squared()
        own: dict = {}
        wg, capture = self.actor_rollout_wg, MetricShares(self.actor_rollout_wg)
        self.actor_rollout_wg = capture  # verl's _update_actor calls update_actor on it
        try:
            batch = super()._update_actor(batch, own)
        finally:
            self.actor_rollout_wg = wg
        self._el_step_done()
        metrics.update(logged_metrics(own, capture.sums))  # exact values over the whole step
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
                warnings.warn(
                    "entropylens: actor_rollout_ref.model.use_fused_kernels=True: verl's fused kernels "
                    "do not give sum_j pi_j^2 (the logits are never materialised), so logit_grad_norm "
                    "is not recorded (null); set use_fused_kernels=False to record it",
                    stacklevel=2,
                )
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


def _loss_method(config) -> str:
    """The entropylens method of the actor's loss_mode, refused here (not on a worker) when the loss is
    verl's own or its eps are refused (:func:`~.config.eps_from`: a dapo loss at verl's default)."""
    pl = config.actor_rollout_ref.actor.policy_loss
    method = method_of(str(pl.loss_mode))
    if method is None:
        raise ValueError(
            f"trainer_mode=entropylens needs an entropylens loss_mode ({', '.join(registered_names())}), "
            f"got {pl.loss_mode!r}"
        )
    eps_from(config.actor_rollout_ref.actor, method)
    return method


def _has_old_entropy(batch) -> bool:
    """Whether the batch (a KVBatchMeta) holds the old-policy entropy: in its field list or, for a meta
    without one, in the store (TransferQueue 0.1.11 answers a missing field with an empty TensorDict,
    older releases raised ValueError)."""
    fields = set(getattr(batch, "fields", None) or ())
    if fields & {"entropy", "entropylens_old_entropy"}:
        return True
    try:
        got = tq.kv_batch_get(keys=batch.keys[:1], partition_id=batch.partition_id, select_fields=["entropy"])
        return "entropy" in got.keys()
    except ValueError:  # "field doesn't exist"
        return False


def _put_old_entropy(batch):
    """The entropy that compute_log_prob just stored, as ``entropylens_old_entropy`` (padded to the
    response) in the store; returns the batch's new meta."""
    from verl.workers.utils.padding import response_from_nested

    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["entropy", "response_mask"])
    fields = TensorDict(
        {"entropylens_old_entropy": response_from_nested(data["entropy"], data["response_mask"])},
        batch_size=len(batch.keys),
    )
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
