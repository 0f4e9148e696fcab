"""TRL: a GRPOTrainer that records every update with entropylens and can train with CE-GPPO / GPPO / ERC.

    from entropylens.integrations.trl import EntropyLensGRPOTrainer
    trainer = EntropyLensGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                     train_dataset=ds, processing_class=tok,
                                     entropylens_root="runs", loss="ce_gppo", beta1=0.5, beta2=1.0,
                                     erc=(0.95, 1.05))
    trainer.train()

What it changes in TRL (private methods, hence the version check):
- TRL's fused LM head (``add_fused_lm_head``) is asked for one more per-token output,
  ``log_sum_sq_probs`` (log sum_j p_j^2), besides its ``log_probs`` and ``entropy``: no [b, K, V] logits
  exist in any pass, as with TRL alone. ``_get_per_token_logps_and_entropies`` runs TRL's own method
  (text and multimodal batches alike) and keeps the entropies and sum p^2 it computed.
- Training pass: a tensor hook on the [b, K] log-prob tensor gives g_t = dLoss/dlogp_t of the loss that
  is actually back-propagated (TRL's own or entropylens', gradient accumulation included), and the
  exact logit-gradient norm is the closed form ||dLoss/dz_t|| = |g_t| / T * sqrt(1 - 2 p_t + sum_j p_j^2).
  The row is recorded after the backward (``training_step``).
- Old-policy pass: its entropies are kept (TRL drops them) only for the pass whose output becomes
  ``old_per_token_logps`` (never the reference pass, which for PEFT also runs through ``self.model``).
- ``_generate_and_score_completions`` adds ``old_entropies`` and run-unique ``el_seq_ids``
  (local index * world_size + rank) to the batch and records the sequences (reward, advantage, length).
- ``_compute_loss``: ``loss=None`` keeps TRL's loss and records the update (with the top-entropy
  and off-policy masks TRL computed, and the vLLM weight, as ``token_kept`` / ``seq_kept`` /
  ``is_weight``); ``loss="ce_gppo"`` (or any method of ``entropylens.losses``) replaces it with
  ``policy_loss`` (eps from GRPOConfig's epsilon / epsilon_high), every option of TRL's loss composed
  as TRL applies it (KL with or without bias correction, vLLM importance-sampling weight, top-entropy
  mask over all processes, off-policy mask, delta, sequence-level ratio, static or adaptive entropy
  bonus, MoE aux loss), and normalised as the configured ``loss_type`` (:func:`trl_loss_weights`:
  ``dapo`` divides by the accumulation window's tokens, ``num_items_in_batch``). TRL's own loss
  metrics (entropy, kl, clip_ratio/*) are logged from the same tensors. Step aggregates go to TRL's
  callbacks (every ``report_to`` tracker) and ``state.log_history`` as ``entropylens/...``, each step's
  values at that step's own index (global_step = step + 1), taken from the writer thread without
  waiting for it: a step's values are logged as soon as the writer has them (all by the last step).
  ``log_histograms`` (default on) and ``log_table_every`` (default 50; 0 never): the step's histograms
  (``train/entropylens/hist/...``) and every N steps a token table (``train/entropylens/tokens``) go to
  the TensorBoard, W&B and Trackio trackers of ``report_to`` through their callbacks' own writer / run, at
  the same global_step (TRL's loggers take scalars only); with ``alarms=`` each finding is also the
  tracker's own alert (``wandb.run.alert``, ``trackio.alert``; TensorBoard: a text summary).
- Texts: each sequence's decoded completion goes to ``sequences.text``; run.json names the tokenizer,
  and one built in memory is saved with the run (``<run>/tokenizer/``).
- ``accelerator.clip_grad_norm_`` is wrapped to record the global grad norm before clipping.
- Each checkpoint TRL saves commits the recorded steps (``Recorder.commit``: their files are on disk
  when ``on_save`` returns), so a job killed after a checkpoint loses none of the steps before it.
  Resuming from ``checkpoint-N`` (``trainer.train(resume_from_checkpoint=...)``): pass the same ``run``
  and ``resume=".../checkpoint-N"`` (the checkpoint's directory: its trainer_state.json says N), or
  ``resume=N - 1`` (steps are TRL's optimizer steps from 0): the run continues after step N - 1. ``train``
  refuses, before training, a checkpoint that is not the one ``resume`` named.

Where TRL's fused head is not on the model (a model TRL did not patch), the passes fall back to the
backbone's hidden states and :func:`entropylens.stats.head_stats` (a warning says so once).

``attribution=True`` records the entropy attribution (``entropy_effect`` = g_t s_t / T^2 per token and
the steps' budget sums; DESIGN.md): TRL's fused head gives sum_j p_j^2 but not sum_j p_j^2 log p_j,
so every pass then goes through :func:`entropylens.stats.head_stats` on the backbone's hidden states
(tiled, no [b, K, V] logits either), which also returns s_t in the training pass. With ``loss=...``
``entropy_effect_dropped`` (what clipping / beta / ERC took away) is recorded too; with TRL's own loss
it stays null (the unclipped coefficient of TRL's loss is not known).

entropylens step = optimizer step (``state.global_step``), update = micro-batch within it.
"""

from __future__ import annotations

import copy
import functools
import types
import warnings

import torch

from ..losses import METHODS, policy_loss
from ._version import require_tested
from ..recorder import Recorder
from ..stats import clip_region, clipped_mask, head_stats, logit_grad_norm_from_sum_p2
from ..token_text import save_tokenizer as save_tokenizer_copy  # the trainer's argument is save_tokenizer
from ..token_text import tokenizer_info
from ..trackers import SUMMARY_NAMES as _SUMMARY_NAMES, step_metrics  # shared with Recorder(log_to=)
from ..trackers import EXTRA_NAMES, StepLog, trl_trackers

TRL_TESTED = ("1.16",)  # major.minor releases whose private GRPOTrainer methods this was tested against
_MM_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
            "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")
PPO_CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")  # TRL loss types that clip like PPO


def check_trl_version(version: str | None = None) -> str:
    """Raise a clear error on a TRL release this integration was not tested with
    (ENTROPYLENS_TRL_UNSAFE=1 skips the check)."""
    if version is None:
        import trl

        version = trl.__version__
    return require_tested("TRL", version, TRL_TESTED, "ENTROPYLENS_TRL_UNSAFE",
                          "It overrides private GRPOTrainer methods that move between releases.")


# How TRL 1.16's ``_compute_loss`` normalises each loss_type (training; GA = current gradient
# accumulation steps, m = completion_mask * tool_mask, B = the micro-batch's completions):
TRL_NORMALISATION: dict[str, str] = {
    "grpo": "per completion: sum_t m l / max(L_i, 1), mean over the B completions, / GA",
    "sapo": "per completion: sum_t m l / max(L_i, 1), mean over the B completions, / GA",
    "bnpo": "sum m l / max(sum m, 1) over the micro-batch, / GA",
    "dr_grpo": "sum m l / (B * max_completion_length), / GA",
    "dapo": "sum m l / the accumulation window's completion tokens "
            "(num_items_in_batch / processes * GA / steps_per_generation)",
    "cispo": "sum m l / the accumulation window's completion tokens "
             "(num_items_in_batch / processes * GA / steps_per_generation)",
    "vespo": "sum m l / the accumulation window's completion tokens "
             "(num_items_in_batch / processes * GA / steps_per_generation)",
    "luspo": "per completion: sum_t m l, mean over the B completions, / GA",
}
WINDOW_LOSS_TYPES = ("dapo", "cispo", "vespo")  # normalised by the whole accumulation window's tokens


def trl_loss_weights(loss_type: str, mask: torch.Tensor, *, ga: int, num_items_in_batch=None,
                     num_processes: int = 1, steps_per_generation: int = 1,
                     max_completion_length: int | None = None) -> torch.Tensor:
    """Aggregation weights w [B, T] (gradient accumulation included) with which TRL 1.16 normalises
    ``loss_type`` in training: TRL's loss == sum(w * per_token_loss) (see :data:`TRL_NORMALISATION`).
    ``num_items_in_batch`` (a 0-dim tensor: the generation batch's completion tokens over all
    processes) stays on the device: no host sync."""
    if loss_type not in TRL_NORMALISATION:
        raise ValueError(f"loss_type {loss_type!r}: entropylens knows TRL's normalisation of "
                         f"{', '.join(TRL_NORMALISATION)}")
    m = mask.float()  # [B, T]
    b = m.shape[0]
    if loss_type in ("grpo", "sapo"):
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * b * ga)
    if loss_type == "bnpo":
        return m / (m.sum().clamp(min=1.0) * ga)
    if loss_type == "dr_grpo":
        return m / (b * float(max_completion_length) * ga)
    if loss_type == "luspo":
        return m / (b * ga)
    if num_items_in_batch is None:
        raise ValueError(f"loss_type {loss_type!r} needs num_items_in_batch (TRL's batch carries it)")
    n = torch.as_tensor(num_items_in_batch, device=m.device).float().clamp(min=1.0)
    return m / (n / num_processes * ga / steps_per_generation)


def unsupported_trl_options(args, aux_loss_enabled: bool = False) -> list[str]:
    """The GRPOConfig options ``loss=...`` cannot honour. Every option of TRL 1.16's ``_compute_loss``
    composes with entropylens' losses (KL with or without bias correction, the vLLM importance-sampling
    weight, the top-entropy mask, the off-policy mask, delta, sequence-level importance sampling, the
    static or adaptive entropy bonus, the MoE router aux loss); what remains is a loss_type whose
    normalisation entropylens does not know."""
    loss_type = getattr(args, "loss_type", "dapo")
    if loss_type not in TRL_NORMALISATION:
        return [f"loss_type={loss_type!r} (its normalisation is unknown to entropylens)"]
    return []


def _active_options(trainer) -> dict:
    """The GRPOConfig options that shape the objective, as this run used them (run.json)."""
    a = trainer.args
    out = {"beta": trainer.beta, "use_bias_correction_kl": bool(getattr(a, "use_bias_correction_kl", False)),
           "top_entropy_quantile": getattr(a, "top_entropy_quantile", 1.0), "delta": getattr(a, "delta", None),
           "off_policy_mask_threshold": getattr(a, "off_policy_mask_threshold", None),
           "importance_sampling_level": trainer.importance_sampling_level,
           "entropy_coef": getattr(a, "entropy_coef", 0.0),
           "use_adaptive_entropy": bool(getattr(a, "use_adaptive_entropy", False)),
           "vllm_importance_sampling_correction": bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
           "router_aux_loss_coef": getattr(a, "router_aux_loss_coef", None) if trainer.aux_loss_enabled else None}
    if out["vllm_importance_sampling_correction"]:
        out["vllm_importance_sampling_mode"] = getattr(a, "vllm_importance_sampling_mode", None)
    return out


def completion_texts(completions) -> list[str]:
    """TRL's decoded completions as plain strings: a conversational completion (a list of messages) is
    its messages' contents joined."""
    out = []
    for c in completions:
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.append("".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in c))
        else:
            out.append(str(c))
    return out


def checkpoint_last_step(path) -> int:
    """The last step a TRL checkpoint directory holds: its trainer_state.json's ``global_step`` N
    (optimizer steps done) covers steps 0..N-1."""
    import json
    from pathlib import Path

    try:
        n = int(json.loads((Path(path) / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"resume={str(path)!r} is not a TRL checkpoint directory (no trainer_state.json with a "
                         f"global_step: {type(e).__name__}: {e})") from None
    if n < 1:
        raise ValueError(f"resume={str(path)!r}: the checkpoint holds no step (global_step {n})")
    return n - 1


def _check_resume_step(resume: int, output_dir) -> None:
    """``resume=K`` must be the last step of a checkpoint: where ``output_dir`` holds checkpoints and none
    ends at step K, refuse (an off-by-one K would remove recorded steps the checkpoint covers, or keep
    one the resumed job records again)."""
    from pathlib import Path

    ends = {}
    for d in sorted(Path(output_dir).glob("checkpoint-*")) if output_dir else []:
        try:
            ends[d.name] = checkpoint_last_step(d)
        except ValueError:
            continue
    if ends and resume not in ends.values():
        listed = ", ".join(f"{name}: steps 0-{last}" for name, last in sorted(ends.items(), key=lambda kv: kv[1]))
        raise ValueError(f"resume={resume}: no checkpoint in {output_dir} ends at step {resume} ({listed}); pass "
                         "resume=<the checkpoint's directory> (or its last step)")


def _refuse(loss: str, options: list[str]) -> None:
    if options:
        raise ValueError(
            f"loss={loss!r} replaces TRL's loss and cannot honour: " + "; ".join(options)
            + ". Keep TRL's loss (loss=None), which is recorded as it is."
        )


def trl_clip_columns(loss_type: str, level: str, delta, eps_low: float, eps_high: float, logprobs: torch.Tensor,
                     old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> dict:
    """``clip`` / ``clipped`` [B, T] as TRL's own loss defines them (schema: column meanings).

    PPO-clip types (grpo, bnpo, dr_grpo, dapo, luspo): region of the ratio TRL clips (the token ratio, or
    the sequence ratio exp(mean_t log r) with importance_sampling_level='sequence'); clipped = the
    advantage-gated PPO rule, plus A < 0 and r > delta when ``delta`` clamps the ratio (zero gradient; also ``dual_clipped``).
    cispo: +1 where the detached weight is capped (r > epsilon_high, an absolute cap), never clipped
    (its gradient is never removed). sapo, vespo: no hard clip (0 / False)."""
    m = mask.bool()
    a = advantages.detach().float()
    a = a.unsqueeze(1).expand(m.shape) if a.dim() == 1 else a
    log_r = torch.where(m, logprobs.detach().float() - old_logprobs.detach().float(), torch.zeros_like(a))
    if level == "sequence":
        log_r = (log_r.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)).expand(m.shape)
    r = torch.exp(log_r)  # [B, T]: the ratio TRL's loss uses
    zero = torch.zeros(m.shape, dtype=torch.int8, device=m.device)
    if loss_type in PPO_CLIP_LOSS_TYPES:
        region = clip_region(r, eps_low, eps_high)
        clipped = clipped_mask(region, a)
        if delta is not None:
            dual = (a < 0) & (r > delta)
            clipped = clipped | dual
    elif loss_type == "cispo":
        region = (r > eps_high).to(torch.int8)
        clipped = torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    else:
        region, clipped = zero, torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    out = {"clip": region, "clipped": clipped & m}
    if loss_type in PPO_CLIP_LOSS_TYPES and delta is not None:
        out["dual_clipped"] = dual & m  # TRL's delta: the capped ratio's tokens (dual_clip_frac)
    return out


closed_form_logit_grad_norm = logit_grad_norm_from_sum_p2  # the name this module exported before


class _LossColumns:
    """What ``Recorder.record_update(loss=...)`` reads: per-token columns, the loss value, settings."""

    def __init__(self, columns: dict, loss=None, config: dict | None = None):
        self.columns, self.loss, self.config = columns, loss, config or {}


def _trainer_class():
    check_trl_version()
    from accelerate.utils import is_peft_model
    from transformers import TrainerCallback
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    class _Callback(TrainerCallback):
        def __init__(self, owner):
            self.owner = owner

        def on_step_end(self, args, state, control, **kwargs):
            self.owner._el_step_end()
            if self.owner.recorder._stop_on and self.owner._el_should_stop():  # a stop_on alarm fired
                if not control.should_training_stop:
                    why = self.owner.recorder.stop_reason or "a stop_on alarm fired on another process"
                    warnings.warn(f"entropylens: stopping training: {why}", stacklevel=2)
                control.should_training_stop = True

        def on_save(self, args, state, control, **kwargs):
            # a checkpoint was saved: every step recorded so far reaches the disk with it (a job killed
            # after this checkpoint has lost none of the steps before it; Recorder.commit)
            self.owner.recorder.commit()

    class EntropyLensGRPOTrainer(GRPOTrainer):
        """GRPOTrainer + entropylens recording (+ optionally entropylens' losses). See the module docstring."""

        def __init__(self, *args, entropylens_root="entropylens-runs", run=None, loss=None, beta1=0.5, beta2=1.0,
                     erc=None, dual_clip=None, tau=0.5, sample=1.0, record_texts=True, attribution=False,
                     resume=None, save_tokenizer=None, alarms=None, stop_on=(), log_histograms=True,
                     log_table_every=50, **kwargs):
            if loss is not None and loss not in METHODS:
                raise ValueError(f"loss: unknown {loss!r}; valid: {', '.join(METHODS)} (or None for TRL's own)")
            if erc is not None and loss is None:
                raise ValueError("erc needs loss=... (ERC is part of entropylens' losses, not TRL's)")
            cfg_args = kwargs.get("args", args[2] if len(args) > 2 else None)
            if loss is not None and cfg_args is not None:
                _refuse(loss, unsupported_trl_options(cfg_args))  # before TRL builds anything (vLLM, ...)
            super().__init__(*args, **kwargs)
            if loss is not None:
                _refuse(loss, unsupported_trl_options(self.args, self.aux_loss_enabled))
            self._el_loss = loss
            self._el_loss_kw = dict(beta1=beta1, beta2=beta2, erc=tuple(erc) if erc else None, dual_clip=dual_clip,
                                    tau=tau)
            self._el_texts = record_texts
            cfg = {
                "method": loss or f"trl-{self.loss_type}", "framework": "trl",
                "trl_loss_type": self.loss_type, "eps_low": self.epsilon_low, "eps_high": self.epsilon_high,
                "trl_importance_sampling_level": self.importance_sampling_level,
                "beta1": beta1 if loss == "ce_gppo" else None, "beta2": beta2 if loss == "ce_gppo" else None,
                "erc": erc, "dual_clip": dual_clip, "lr": self.args.learning_rate, "seed": self.args.seed,
                "num_generations": self.num_generations, "num_iterations": self.num_iterations,
                "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                "temperature": self.temperature, "kl_beta": self.beta, "attribution": bool(attribution),
                "model": getattr(self.model.config, "_name_or_path", None) or type(self.model).__name__,
                "trl_normalisation": TRL_NORMALISATION.get(self.loss_type),
                "trl_options": _active_options(self),
                "tokenizer": tokenizer_info(self.processing_class, save_tokenizer),
            }
            if resume is not None and not isinstance(resume, int):  # a checkpoint directory: its last step
                resume = checkpoint_last_step(resume)
            elif resume is not None:  # before the recorder removes the steps after it
                _check_resume_step(resume, self.args.output_dir)
            self._el_resume = resume
            # histograms, the token table and alerts: to report_to's TensorBoard / W&B / Trackio (rank 0)
            extras = trl_trackers(self.callback_handler.callbacks) if self.accelerator.is_main_process else []
            hist_on = bool(log_histograms) and bool(extras)
            table_every = int(log_table_every or 0) if any(t.has_tables for t in extras) else 0
            self.recorder = Recorder(entropylens_root, run, config=cfg, tau=tau, sample=sample,
                                     rank=self.accelerator.process_index, world_size=self.accelerator.num_processes,
                                     resume=resume, alarms=alarms, stop_on=stop_on,
                                     log_histograms=hist_on, log_table_every=table_every)
            self._el_extras = StepLog(extras, self.recorder.run, cfg, step_offset=1) if extras else None
            self._el_names = _SUMMARY_NAMES + EXTRA_NAMES if hist_on or table_every else _SUMMARY_NAMES
            if alarms and self._el_extras is not None:  # findings as the trackers' own alerts
                self.recorder.on_alarm(lambda finding: self._el_extras.alert(finding, self.recorder._stop_on))
            if self.accelerator.is_main_process:
                save_tokenizer_copy(self.processing_class, self.recorder.dir, save_tokenizer)
            self._el_micro = 0
            self._el_seq_count = 0  # sequences generated on this rank so far
            self._el_group_base = 0
            self._el_rewards = None
            self._el_grad_norm = None
            self._el_kl_ref = None  # [sum of k3(ref || theta), tokens] of the step's micro-batches (beta > 0)
            self._el_lr = None  # the learning rate of the optimizer step in progress
            self._el_capture = None  # list while a pass runs: log_sum_sq_probs of each fused forward
            self._el_passes = None  # list during generation: (logps, entropies) of each no-grad pass
            self._el_train = None  # the training pass of the current micro-batch
            self._el_rec = None  # the update waiting for its backward
            self._el_masks = None  # dict while TRL's own loss runs: the token / sequence masks it computed
            self._el_summaries: list = []  # step summaries asked of the writer thread, not yet logged
            self._el_warned: set[str] = set()
            self._el_attribution = bool(attribution)  # head_stats in every pass, s_t in the training pass
            self._el_fused = False if attribution else self._el_patch_fused_head()
            acc = self.accelerator
            orig_clip = acc.clip_grad_norm_

            def clip_grad_norm_(*a, **k):  # the norm before clipping, as the optimizer step sees it
                norm = orig_clip(*a, **k)
                self._el_grad_norm = norm
                return norm

            acc.clip_grad_norm_ = clip_grad_norm_
            self.add_callback(_Callback(self))

        # -- TRL's fused head, asked for sum p^2 too --------------------------------------------------
        def _el_base_model(self):
            return self.model.get_base_model() if is_peft_model(self.model) else self.model

        def _el_patch_fused_head(self) -> bool:
            """Re-add TRL's fused head with log_sum_sq_probs and capture that output. False when TRL did
            not patch the model (then the passes use entropylens' head_stats)."""
            base = self._el_base_model()
            if "forward" not in vars(base) or base.get_output_embeddings() is None:
                return False
            trl_fused = base.forward  # TRL's own head (log-probs and entropy): the no-grad passes need no more
            add_fused_lm_head(base, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
                              outputs=("log_probs", "entropy", "log_sum_sq_probs"))
            fused = base.forward  # sum_j p_j^2 too (one more reduction per tile): only the training pass uses it
            owner = self

            @functools.wraps(type(base).forward)
            def forward(self_, *a, **k):
                if not (k.get("fused_lm_head") and owner._el_capture is not None and torch.is_grad_enabled()):
                    return trl_fused(*a, **k)
                out = fused(*a, **k)
                owner._el_capture.append(getattr(out, "log_sum_sq_probs", None))
                return out

            base.forward = types.MethodType(forward, base)
            return True

        def _el_should_stop(self) -> bool:
            """Any process's stop_on alarm stops every process (each rank's rules see its own steps; a
            stop on one rank alone would leave the others waiting in a collective)."""
            flag = float(self.recorder.should_stop)
            if self.accelerator.num_processes > 1:
                t = torch.tensor([flag], device=self.accelerator.device)
                flag = float(self.accelerator.reduce(t, reduction="sum").item())
            return flag > 0

        def _el_warn_once(self, key: str, msg: str) -> None:
            if key not in self._el_warned:
                self._el_warned.add(key)
                warnings.warn(f"entropylens: {msg}", stacklevel=3)

        # -- training entry: the recorder's status follows the run ---------------------------------
        def train(self, *args, **kwargs):
            try:
                self._el_check_resume(kwargs.get("resume_from_checkpoint", args[0] if args else None))
                out = super().train(*args, **kwargs)
            except BaseException:
                self.recorder.close(status="failed", _raise=False)
                raise
            self.recorder.close()
            return out

        def _el_check_resume(self, checkpoint) -> None:
            """A resumed run must continue after the checkpoint's last step: an off-by-one ``resume=`` would
            record a step twice (too high) or leave steps missing (too low), so it is refused here."""
            if self._el_resume is None or not checkpoint:
                return
            if checkpoint is True:  # TRL's own choice: the last checkpoint in output_dir
                from transformers.trainer_utils import get_last_checkpoint

                checkpoint = get_last_checkpoint(self.args.output_dir)
                if checkpoint is None:
                    return  # TRL raises its own error
            last = checkpoint_last_step(checkpoint)
            if last != self._el_resume:
                raise ValueError(f"resume={self._el_resume} but {checkpoint} holds steps 0-{last}: build the trainer "
                                 f"with resume={last} (or resume={str(checkpoint)!r})")

        # -- log-probs, entropies and sum p^2 from TRL's fused head ---------------------------------
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **mm):
            k = logits_to_keep
            sens = None  # the entropy sensitivity s_t: only from head_stats in a training pass with attribution
            if self.ref_model is not None and model is self.ref_model:  # the KL reference: TRL's own pass
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, k, batch_size=batch_size, compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss, **mm)
            if self._el_fused:
                self._el_capture = []
                try:
                    logps, ents, aux = super()._get_per_token_logps_and_entropies(
                        model, input_ids, attention_mask, k, batch_size=batch_size, compute_entropy=True,
                        compute_aux_loss=compute_aux_loss, **mm)
                    caps = self._el_capture
                finally:
                    self._el_capture = None
                sq = None  # the no-grad passes (old policy, reference) capture nothing: no sum p^2 asked
                if caps and all(c is not None for c in caps):
                    sq = torch.cat([c[:, -k:] for c in caps]).float().exp()  # sum_j p_j^2 [b, K]
                    if sq.shape != logps.shape:
                        sq = None
                if sq is None and torch.is_grad_enabled():
                    self._el_warn_once("sq", "TRL's fused head returned no log_sum_sq_probs for a batch; its "
                                             "logit_grad_norm is left empty")
            elif any(mm.get(key) is not None for key in _MM_KEYS):
                self._el_warn_once("mm", "a multimodal batch on a model without TRL's fused head is not recorded")
                self._el_train = None
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, k, batch_size=batch_size, compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss, **mm)
            else:
                logps, ents, sq, sens, aux = self._el_head_stats_pass(model, input_ids, attention_mask, k,
                                                                      batch_size, compute_aux_loss)
            if torch.is_grad_enabled() and logps.requires_grad:
                box: dict = {}

                def hook(grad):  # dLoss/dlogp [b, K] of the back-propagated loss
                    box["g"] = grad.detach()

                logps.register_hook(hook)
                self._el_train = {"lp": logps, "h": ents, "sq": sq, "box": box,
                                  "sens": sens}
            elif self._el_passes is not None:
                self._el_passes.append((logps, ents))
            return logps, (ents if compute_entropy else None), aux

        def _el_head_stats_pass(self, model, input_ids, attention_mask, k, batch_size, compute_aux_loss):
            """The backbone's last hidden states through head_stats (``attribution=True``, or no TRL fused
            head on the model): (logps, entropies, sum p^2, s_t or None, aux). s_t only in a training pass
            with ``attribution``."""
            if not self._el_attribution:
                self._el_warn_once("fallback", "TRL's fused LM head is not on this model; log-probs, entropies and "
                                               "sum p^2 come from entropylens.stats.head_stats on the hidden states")
            want_sens = self._el_attribution and torch.is_grad_enabled()
            base = self._el_base_model()
            backbone = getattr(base, base.base_model_prefix)
            head = base.get_output_embeddings()
            batch_size = batch_size or input_ids.size(0)
            lps, hs, sqs, sens, auxes = [], [], [], [], []
            for s in range(0, input_ids.size(0), batch_size):
                ids = input_ids[s : s + batch_size]
                kw = {"output_router_logits": True} if compute_aux_loss else {}
                with self.accelerator.autocast():
                    out = backbone(input_ids=ids, attention_mask=attention_mask[s : s + batch_size], use_cache=False,
                                   **kw)
                hidden = out.last_hidden_state[:, -k - 1 : -1]  # [b, K, H]: predicts the K completion tokens
                lp, h, sq, *s = head_stats(hidden, head.weight, ids[:, -k:], bias=head.bias,
                                           temperature=self.temperature, sensitivity=want_sens)
                sens += s
                lps.append(lp)
                hs.append(h)
                sqs.append(sq)
                if compute_aux_loss:
                    auxes.append(getattr(out, "aux_loss", None))
            aux = torch.stack(auxes).mean() if compute_aux_loss and auxes and auxes[0] is not None else None
            return torch.cat(lps), torch.cat(hs), torch.cat(sqs), (torch.cat(sens) if sens else None), aux

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            w = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
            self._el_rewards = (rewards_per_func * w).nansum(dim=1)  # [global B], as TRL weighs them
            self._el_completions = completions
            return rewards_per_func

        def _generate_and_score_completions(self, inputs):
            self._el_passes = []
            try:
                out = super()._generate_and_score_completions(inputs)
                passes = self._el_passes
            finally:
                self._el_passes = None
            old = out.get("old_per_token_logps")
            if old is not None:  # the entropies of exactly the pass that became old_per_token_logps
                match = [h for lp, h in passes if lp is old]
                if match and match[0] is not None:
                    out["old_entropies"] = match[0]
            b = out["completion_ids"].size(0)
            dev = out["completion_ids"].device
            world, pi = self.accelerator.num_processes, self.accelerator.process_index
            ids = (self._el_seq_count + torch.arange(b, device=dev)) * world + pi  # unique across ranks and steps
            self._el_seq_count += b
            out["el_seq_ids"] = ids
            if self.model.training and self._el_rewards is not None:
                rewards = self._el_rewards[pi * b : (pi + 1) * b]
                texts = None
                if self._el_texts:
                    texts = completion_texts(self._el_completions[:b])
                gidx = self._el_group_base + torch.arange(pi * b, (pi + 1) * b) // self.num_generations
                self._el_group_base += -(-b * world // self.num_generations)
                self.recorder.record_sequences(self.state.global_step, seq_ids=ids, rewards=rewards,
                                               advantages=out["advantages"], lengths=out["completion_mask"].sum(1),
                                               group_ids=gidx, texts=texts)
            return out

        # -- the loss ------------------------------------------------------------------------------
        def _compute_loss(self, model, inputs):
            mode = "train" if self.model.training else "eval"
            if mode != "train":
                return super()._compute_loss(model, inputs)
            self._el_train = None  # never another micro-batch's values
            completion_ids = inputs["completion_ids"]
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            out = None
            modifiers = {}
            if self._el_loss is None:
                self._el_masks = {}
                try:
                    loss = super()._compute_loss(model, inputs)
                    modifiers = self._el_masks
                finally:
                    self._el_masks = None
                if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":
                    modifiers["is_weight"] = inputs["importance_sampling_ratio"].detach().float()
                train = self._el_train
            else:
                out, loss = self._el_policy_loss(model, inputs, mask)
                train = self._el_train
            self._el_train = None
            if train is None:
                self._el_warn_once("norec", "a micro-batch without log-probs from this trainer's pass is not recorded")
                return loss
            self._el_rec = {**train, "mask": mask, "adv": inputs["advantages"], "tokens": completion_ids,
                            "old_lp": inputs.get("old_per_token_logps"), "old_h": inputs.get("old_entropies"),
                            "seq": inputs.get("el_seq_ids"), "out": out, "loss": loss.detach(),
                            "modifiers": modifiers}
            if self.beta and inputs.get("ref_per_token_logps") is not None:  # KL to the reference, this step
                m = mask.float()
                d = inputs["ref_per_token_logps"].detach().float() - train["lp"].detach().float()  # ref - logp
                part = torch.stack([((torch.exp(d) - d - 1.0) * m).sum(), m.sum()])  # on the device, no sync
                self._el_kl_ref = part if self._el_kl_ref is None else self._el_kl_ref + part
            return loss

        def get_high_entropy_mask(self, entropies, mask, threshold):
            """TRL's top-entropy token mask; kept for the tokens' ``token_kept`` column with TRL's own loss."""
            keep = super().get_high_entropy_mask(entropies, mask, threshold)
            if self._el_masks is not None:
                self._el_masks["token_kept"] = keep.detach()
            return keep

        def get_off_policy_mask(self, advantages, per_token_logps, sampling_per_token_logps, mask,
                                off_policy_threshold):
            """TRL's off-policy sequence mask; kept for ``seq_kept`` with TRL's own loss."""
            keep = GRPOTrainer.get_off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                                                   off_policy_threshold)
            if self._el_masks is not None:
                self._el_masks["seq_kept"] = keep.detach().bool()
            return keep

        def _el_policy_loss(self, model, inputs, mask):
            """entropylens' ``policy_loss`` with every option of TRL's ``_compute_loss`` composed as TRL
            applies it, normalised as TRL normalises ``self.loss_type`` (:func:`trl_loss_weights`):
            policy term x off-policy sequence mask x top-entropy token mask x vLLM IS weight, + beta KL
            (times the ratio with ``use_bias_correction_kl``), - the entropy bonus (TRL's own coefficient
            and gating, adaptive controller included), + the MoE router aux loss. (out, loss)."""
            completion_ids = inputs["completion_ids"]
            input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
            attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            mm = {key: inputs.get(key) for key in _MM_KEYS if inputs.get(key) is not None}
            lp, h, aux = self._get_per_token_logps_and_entropies(model, input_ids, attn, completion_ids.size(1),
                                                                 compute_entropy=True,
                                                                 compute_aux_loss=self.aux_loss_enabled, **mm)
            args, ga = self.args, self.current_gradient_accumulation_steps
            adv = inputs["advantages"]
            adv2 = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [B, 1] or [B, T], as TRL's masks take it
            old_lp = inputs.get("old_per_token_logps")
            old_lp = lp.detach() if old_lp is None else old_lp
            old_h = inputs.get("old_entropies")
            old_h = h.detach() if old_h is None else old_h
            token_mask = seq_mask = is_w = None
            if self.top_entropy_quantile < 1.0:  # TRL's own method: the quantile over all processes
                token_mask = self.get_high_entropy_mask(h.detach(), mask, 1 - self.top_entropy_quantile)
            if self.off_policy_mask_threshold is not None:
                sampling = inputs.get("sampling_per_token_logps", old_lp)
                seq_mask = self.get_off_policy_mask(adv2, lp, sampling, mask, self.off_policy_mask_threshold)
            if self.use_vllm and self.vllm_importance_sampling_correction:
                is_w = inputs["importance_sampling_ratio"].expand(mask.shape)  # [B, T] or [B, 1] -> [B, T]
            w = trl_loss_weights(self.loss_type, mask, ga=ga, num_items_in_batch=inputs.get("num_items_in_batch"),
                                 num_processes=self.accelerator.num_processes,
                                 steps_per_generation=args.steps_per_generation,
                                 max_completion_length=self.max_completion_length)
            bonus = {}
            if self._entropy_bonus_enabled:
                eff = mask.float() if token_mask is None else mask.float() * token_mask.float()  # [B, T]
                coef = self.entropy_coef
                if self.use_adaptive_entropy:  # the gate of the previous optimizer step, as TRL applies it
                    coef = self.entropy_coef if self._last_world_entropy <= args.entropy_target else 0.0
                bonus = dict(entropy_coef=float(coef), entropy_weights=eff / (eff.sum().clamp(min=1.0) * ga))
                if self.use_adaptive_entropy:
                    self._el_adapt_entropy(h.detach(), eff)
            kl = {}
            if self.beta:
                kl = dict(ref_logprobs=inputs["ref_per_token_logps"], kl_coef=self.beta,
                          kl_bias_correction=bool(args.use_bias_correction_kl))
            out = policy_loss(lp, old_lp, adv, mask, method=self._el_loss, eps_low=self.epsilon_low,
                              eps_high=self.epsilon_high, entropy=h, old_entropy=old_h, weights=w,
                              token_mask=token_mask, seq_mask=seq_mask, is_weight=is_w, delta=args.delta,
                              ratio_level="token" if self._el_loss == "gspo" else self.importance_sampling_level,
                              **self._el_loss_kw, **kl, **bonus)
            loss = out.loss
            if self.aux_loss_enabled:  # TRL's MoE router aux loss, scaled for accumulation as TRL does
                loss = loss + self.router_aux_loss_coef * aux / ga
                self._metrics["train"]["aux_loss"].append(self.accelerator.gather_for_metrics(aux).mean().item())
            self._el_trl_metrics(out, lp, h, mask, inputs.get("ref_per_token_logps"), old_lp)
            return out, loss

        def _el_adapt_entropy(self, h, eff) -> None:
            """TRL's adaptive entropy controller, stepped as TRL steps it: the window's token-weighted
            entropy over all processes moves entropy_coef by entropy_coef_delta at each optimizer step."""
            args = self.args
            stats = torch.stack([(h * eff).sum(), eff.sum()])
            self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
            if self.accelerator.sync_gradients:
                total = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world = (total[0] / total[1].clamp(min=1.0)).item()
                if world <= args.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
                else:
                    self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
                self._last_world_entropy = world
                self._entropy_window_stats = None

        def _el_trl_metrics(self, out, lp, h, mask, ref, old_lp) -> None:
            """The metrics TRL's own loss logs (entropy, kl, clip_ratio/*, entropy_coef), from the same
            tensors, so a dashboard keeps its curves when ``loss=...`` replaces TRL's loss."""
            m = mask.float()
            metrics = {"entropy": h.detach().float()}
            if self.beta:
                d = ref.float() - lp.detach().float()  # ref - logp
                kl = torch.exp(d) - d - 1.0  # [B, T] k3, as TRL logs it
                if self.args.use_bias_correction_kl:
                    log_r = (lp.detach().float() - old_lp.float()) * m
                    if self.importance_sampling_level == "sequence":
                        log_r = log_r.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
                    kl = kl * torch.exp(log_r)
                metrics["kl"] = kl
            c = out.columns
            if self.loss_type in PPO_CLIP_LOSS_TYPES:
                low = (c["clip"] < 0) & (c["advantage"] < 0)
                high = (c["clip"] > 0) & (c["advantage"] > 0)
                metrics.update({"clip_ratio/low_mean": low.float(), "clip_ratio/high_mean": high.float(),
                                "clip_ratio/region_mean": (low | high).float()})
            names = list(metrics)
            local = torch.stack([s for k in names for s in ((metrics[k] * m).sum(), m.sum())])
            totals = self.accelerator.reduce(local, reduction="sum").view(-1, 2).tolist()  # one sync
            for k, (total, count) in zip(names, totals):
                self._metrics["train"][k].append(total / max(count, 1.0))
            if self._entropy_bonus_enabled and self.accelerator.sync_gradients:
                self._metrics["train"]["entropy_coef"].append(self.entropy_coef)

        def training_step(self, model, inputs, num_items_in_batch=None):
            self._el_rec = None
            if self._el_micro == 0:  # the learning rate this optimizer step uses (the scheduler steps after it)
                self._el_lr = (self._get_learning_rate() if hasattr(self, "_get_learning_rate")
                               else self.args.learning_rate)
            result = super().training_step(model, inputs, num_items_in_batch)
            rec, self._el_rec = self._el_rec, None
            if rec is not None:  # the backward has run: the hook holds dLoss/dlogp
                self._el_record(rec)
            return result

        def _el_record(self, rec: dict) -> None:
            lp, mask, adv = rec["lp"].detach(), rec["mask"], rec["adv"]
            h = rec["h"].detach() if rec["h"] is not None else None
            old_lp = rec["old_lp"] if rec["old_lp"] is not None else lp
            old_h = rec["old_h"] if rec["old_h"] is not None else h  # on-policy micro-batch: rho = 1
            g = rec["box"].get("g")
            out = rec["out"]
            if out is not None:
                cols, config = dict(out.columns), out.config
            else:
                cols = trl_clip_columns(self.loss_type, self.importance_sampling_level, self.args.delta,
                                        self.epsilon_low, self.epsilon_high, lp, old_lp, adv, mask)
                if g is not None:
                    cols["grad_coef"] = torch.where(mask.bool(), g.float(), torch.zeros_like(g, dtype=torch.float32))
                for name, t in rec.get("modifiers", {}).items():  # what TRL's own options did to each token
                    cols[name] = t.expand(mask.shape)
                # TRL's entropy bonus reaches the logits through H: the recorder leaves entropy_effect null
                config = {"entropy_coef": float(self.entropy_coef)} if self._entropy_bonus_enabled else {}
            # TRL's entropy bonus reaches the logits through H too: the closed form would not be the norm
            if g is not None and rec["sq"] is not None and not self._entropy_bonus_enabled:
                cols["logit_grad_norm"] = closed_form_logit_grad_norm(g, lp, rec["sq"], self.temperature)
            self.recorder.record_update(self.state.global_step, self._el_micro, mask=mask, advantages=adv,
                                        logprobs=lp, old_logprobs=old_lp, entropy=h, old_entropy=old_h,
                                        tokens=rec["tokens"], seq_ids=rec["seq"],
                                        loss=_LossColumns(cols, rec["loss"], config),
                                        entropy_sensitivity=rec.get("sens"), temperature=self.temperature)
            self._el_micro += 1

        def _el_step_end(self) -> None:
            step = self.state.global_step - 1  # the optimizer step that just finished
            gn = self._el_grad_norm
            lr = self._el_lr if self._el_lr is not None else self.args.learning_rate  # read before the scheduler stepped
            kl = {}
            if self._el_kl_ref is not None:  # a device scalar: the writer thread reads it, no sync here
                kl["kl_ref"] = self._el_kl_ref[0] / self._el_kl_ref[1].clamp(min=1.0)
            self.recorder.record_step(step, grad_norm=float(gn) if gn is not None else None, lr=float(lr), **kl)
            # the summary comes from the writer thread once it has taken in the step: asking without
            # waiting keeps the training thread off the writer's disk work (the previous step's files,
            # fsync included); answers are logged as they arrive, all of them by the last step
            self._el_summaries.append((step, self.recorder.step_summary_later(step, self._el_names)))
            self.recorder.end_step(step)  # written now, not when the next step (after its generation) begins
            last = self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps
            if last and self._el_extras is not None:  # findings reach the trackers before on_train_end closes them
                self.recorder.observe_alarms()
            while self._el_summaries and (last or self._el_summaries[0][1].ready()):
                done, pending = self._el_summaries.pop(0)
                self._el_log_summary(done, pending.result())
            self._el_micro = 0
            self._el_grad_norm = None
            self._el_kl_ref = None
            self._el_lr = None

        def _el_log_summary(self, step: int, summary: dict) -> None:
            """Logs one step's aggregates as ``entropylens/...`` at that step's own index (TRL's global_step
            after it: step + 1), through TRL's callbacks, so every ``report_to`` tracker (TensorBoard, W&B,
            Trackio, ...) gets them at the step they describe, whenever the writer thread answers; and in
            ``state.log_history`` as a row of its own. Rank 0's summary (the trackers log on rank 0)."""
            logs = step_metrics(summary)
            if not logs or not self.accelerator.is_main_process:
                return
            at = copy.copy(self.state)  # the trackers take the step from state.global_step
            at.global_step = step + 1
            self.state.log_history.append({**logs, "step": step + 1})
            should_log = self.control.should_log  # the handler's on_log clears it: TRL's own log of this
            self.control = self.callback_handler.on_log(self.args, at, self.control, logs)  # step must stay due
            self.control.should_log = should_log
            if self._el_extras is not None:  # histograms / table through the trackers' own objects
                self._el_extras.write(step, summary, scalars=False)

    return EntropyLensGRPOTrainer


def __getattr__(name):
    if name == "EntropyLensGRPOTrainer":
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


__all__ = ["EntropyLensGRPOTrainer", "check_trl_version", "unsupported_trl_options", "trl_clip_columns",
           "closed_form_logit_grad_norm", "TRL_TESTED"]
