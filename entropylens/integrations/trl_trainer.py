"""``EntropyLensGRPOTrainer``: TRL's GRPOTrainer, recording every update (what it changes in TRL, and why:
:mod:`entropylens.integrations.trl`). Importing this module imports TRL, after checking its version.

The trainer is GRPOTrainer with one mixin per job, each overriding the TRL methods of its job:
``_Passes`` (the per-token passes: TRL's fused head asked for sum p^2, or the head_stats fallback),
``_Loss`` (TRL's own loss with its masks kept, or entropylens' ``policy_loss`` composed with TRL's options),
``_Recording`` (a generation batch's sequences, an update after its backward, a step at its end) and
``_Logging`` (the step aggregates to TRL's trackers); the trainer's own class builds the run and its
Recorder. The maths without TRL: :mod:`.trl_loss`, :mod:`.trl_passes`; the run's config, resume checks
and texts: :mod:`.trl_run`."""

from __future__ import annotations

import copy
import functools
import os
import types
import warnings
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..record.recorder import PendingSummary, Recorder
from ..record.trackers import EXTRA_NAMES, SUMMARY_NAMES, StepLog, step_metrics, trl_trackers
from ..rl.cov import COV_METHODS
from ..rl.losses import METHODS, policy_loss
from ..rl.stats import logit_grad_norm_from_sum_p2
from ..token_text import save_tokenizer as save_tokenizer_copy  # the trainer's argument is save_tokenizer
from .trl_loss import (
    LossColumns,
    refuse_unsupported,
    trl_loss_metrics,
    trl_loss_weights,
    trl_own_loss_columns,
    unsupported_trl_options,
)
from .trl_passes import MM_KEYS, captured_sum_sq, head_stats_pass
from .trl_run import check_trl_version, checkpoint_last_step, completion_texts, on_policy, resume_step, run_config

check_trl_version()  # before TRL's private methods are imported: they move between releases

from accelerate.utils import is_peft_model  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

if TYPE_CHECKING:
    from collections import defaultdict

    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import CallbackHandler
    from transformers.trainer_utils import TrainOutput

    from ..alarms import Thresholds


def _check_arguments(loss: str | None, erc: Sequence[float] | None, config: Any) -> None:
    """The trainer's own arguments, refused before TRL builds anything (vLLM, ...)."""
    if loss is not None and loss not in METHODS:
        raise ValueError(f"loss: unknown {loss!r}; valid: {', '.join(METHODS)} (or None for TRL's own)")
    if erc is not None and loss is None:
        raise ValueError("erc needs loss=... (ERC is part of entropylens' losses, not TRL's)")
    if loss is not None and config is not None:
        refuse_unsupported(loss, unsupported_trl_options(config))


def cov_kwargs(loss: str | None, cov: dict[str, float] | None, seed: int) -> dict[str, Any]:
    """policy_loss's Clip-Cov / KL-Cov settings for ``loss`` clip_cov / kl_cov: ``cov`` (a dict of
    clip_cov_ratio, clip_cov_lb, clip_cov_ub / kl_cov_ratio, ppo_kl_coef; missing: verl's defaults) and
    Clip-Cov's random draw on a CPU generator seeded with the run's seed (+ the process index is not
    added: each process draws over its own micro-batch)."""
    if loss not in COV_METHODS:
        if cov:
            raise ValueError(f"cov: settings of clip_cov / kl_cov, but loss={loss!r}")
        return {}
    keys = ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub") if loss == "clip_cov" else ("kl_cov_ratio", "ppo_kl_coef")
    unknown = set(cov or {}) - set(keys)
    if unknown:
        raise ValueError(f"cov: unknown {', '.join(sorted(unknown))} for loss={loss!r}; valid: {', '.join(keys)}")
    out: dict[str, Any] = dict(cov or {})
    if loss == "clip_cov":
        out["generator"] = torch.Generator().manual_seed(int(seed))
    return out


def _entropies_of_pass(logps, passes: list):
    """The entropies of the no-grad pass whose log-probs are ``logps`` (the pass that became
    ``old_per_token_logps``, never the reference pass); None where no pass gave them."""
    if logps is None:
        return None
    match = [h for lp, h in passes if lp is logps]
    return match[0] if match else None


def _warn_once(warned: set, key: str, msg: str) -> None:
    """Warns about ``key`` once per trainer (``warned``: the keys warned about), at the caller's caller
    (the TRL code that called the override)."""
    if key not in warned:
        warned.add(key)
        warnings.warn(f"entropylens: {msg}", stacklevel=3)


class _StepCallback(TrainerCallback):
    """Ends each optimizer step's recording (and stops training on a ``stop_on`` alarm); commits the
    recorded steps at each checkpoint."""

    def __init__(self, owner: EntropyLensGRPOTrainer) -> None:
        self.owner = owner

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.owner._el_step_end()
        if self.owner.recorder._stop_on and self.owner._el_should_stop():  # a stop_on alarm fired
            if not control.should_training_stop:
                why = self.owner.recorder.stop_reason or "a stop_on alarm fired on another process"
                warnings.warn(f"entropylens: stopping training: {why}", stacklevel=2)
            control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        # a checkpoint was saved: every step recorded so far reaches the disk with it (a job killed
        # after this checkpoint has lost none of the steps before it; Recorder.commit)
        self.owner.recorder.commit()


class _State:
    """The state EntropyLensGRPOTrainer's mixins hand each other between TRL's calls (set by the trainer's
    ``__init__``; declarations only: a class annotation creates no attribute)."""

    recorder: Recorder
    _el_loss: str | None  # None: TRL's own loss
    _el_loss_kw: dict[str, Any]  # policy_loss's settings besides the tensors
    _el_texts: bool
    _el_resume: int | None
    _el_attribution: bool
    _el_fused: bool
    _el_extras: StepLog | None
    _el_names: tuple[str, ...]
    _el_micro: int
    _el_seq_count: int
    _el_group_base: int
    _el_rewards: torch.Tensor | None
    _el_completions: list[Any] | None
    _el_grad_norm: torch.Tensor | float | None
    _el_kl_ref: torch.Tensor | None
    _el_lr: float | None
    _el_capture: list[torch.Tensor | None] | None
    _el_passes: list[tuple[torch.Tensor, torch.Tensor | None]] | None
    _el_train: dict[str, Any] | None
    _el_rec: dict[str, Any] | None
    _el_masks: dict[str, torch.Tensor] | None
    _el_summaries: list[tuple[int, PendingSummary]]
    _el_warned: set[str]


if TYPE_CHECKING:

    class _Host(_State):
        """GRPOTrainer as the mixins use it, for the type checker only: the attributes TRL's ``__init__``
        sets, typed as the mixins use them (mypy infers TRL's from its ``__init__``, some too loosely for
        the mixins: ``args`` is a GRPOConfig, not TrainingArguments), and the methods the mixins call on
        ``super()`` or on each other. Each type fits TRL's own, which the trainer's class is checked
        against. At run time the mixins derive from :class:`_State` alone."""

        args: Any  # GRPOConfig
        model: Any
        ref_model: Any
        accelerator: Any
        processing_class: Any
        state: TrainerState
        control: TrainerControl
        callback_handler: CallbackHandler
        temperature: float
        beta: float
        loss_type: str
        importance_sampling_level: str
        epsilon_low: float
        epsilon_high: float
        top_entropy_quantile: float
        off_policy_mask_threshold: float | None
        use_vllm: bool
        vllm_importance_sampling_correction: bool
        vllm_importance_sampling_mode: str
        num_generations: int | None  # GRPOConfig's type; an int once GRPOConfig.__post_init__ has run
        num_iterations: int
        max_completion_length: int | None
        current_gradient_accumulation_steps: int
        aux_loss_enabled: bool
        router_aux_loss_coef: float
        reward_weights: torch.Tensor
        entropy_coef: float
        use_adaptive_entropy: bool
        _entropy_bonus_enabled: bool
        _last_world_entropy: float
        _entropy_window_stats: Any  # a tensor or None; TRL's __init__ (None) makes mypy infer None there
        _metrics: dict[str, defaultdict[str, list[float]]]

        def _get_learning_rate(self) -> float: ...
        def _get_per_token_logps_and_entropies(
            self,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=None,
            compute_entropy=False,
            compute_aux_loss=False,
            **mm,
        ) -> Any: ...
        def get_high_entropy_mask(self, entropies, mask, threshold) -> Any: ...
        def _compute_loss(self, model, inputs) -> Any: ...
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list) -> Any: ...
        def _generate_and_score_completions(self, inputs) -> Any: ...
        def training_step(self, model, inputs, num_items_in_batch=None) -> Any: ...
        def _el_log_ready_summaries(self, wait: bool) -> None: ...
else:
    _Host = _State


class _Passes(_Host):
    """The per-token passes (mixed into EntropyLensGRPOTrainer, before GRPOTrainer): TRL's fused head asked
    for sum p^2 in the training pass, or the head_stats fallback; the training pass's log-probs get the
    hook that keeps dLoss/dlogp. Sets ``_el_train`` (the training pass, for the loss) and fills
    ``_el_passes`` (the no-grad passes, while a generation batch is scored)."""

    def _el_base_model(self):
        return self.model.get_base_model() if is_peft_model(self.model) else self.model

    def _el_patch_fused_head(self) -> bool:
        """Re-add TRL's fused head with log_sum_sq_probs and capture that output. False when TRL did
        not patch the model (then the passes use entropylens' head_stats)."""
        base = self._el_base_model()
        if "forward" not in vars(base) or base.get_output_embeddings() is None:
            return False
        trl_fused = base.forward  # TRL's own head (log-probs and entropy): the no-grad passes need no more
        add_fused_lm_head(
            base,
            temperature=self.temperature,
            cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
            outputs=("log_probs", "entropy", "log_sum_sq_probs"),
        )
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

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **mm,
    ):
        k = logits_to_keep
        sens = None  # the entropy sensitivity s_t: only from head_stats in a training pass with attribution
        if self.ref_model is not None and model is self.ref_model:  # the KL reference: TRL's own pass
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                k,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **mm,
            )
        if self._el_fused:
            logps, ents, aux, sq = self._el_fused_pass(
                model, input_ids, attention_mask, k, batch_size, compute_aux_loss, mm
            )
            if sq is None and torch.is_grad_enabled():
                _warn_once(
                    self._el_warned,
                    "sq",
                    "TRL's fused head returned no log_sum_sq_probs for a batch; its logit_grad_norm is left empty",
                )
        elif any(mm.get(key) is not None for key in MM_KEYS):
            _warn_once(self._el_warned, "mm", "a multimodal batch on a model without TRL's fused head is not recorded")
            self._el_train = None
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                k,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **mm,
            )
        else:
            logps, ents, sq, sens, aux = self._el_head_stats_pass(
                model, input_ids, attention_mask, k, batch_size, compute_aux_loss
            )
        self._el_keep_pass(logps, ents, sq, sens)
        return logps, (ents if compute_entropy else None), aux

    def _el_fused_pass(self, model, input_ids, attention_mask, k, batch_size, compute_aux_loss, mm):
        """TRL's own pass through its fused head, entropies always on: (logps, entropies, aux, sum p^2),
        sum p^2 as captured in a training pass (None in the no-grad passes, which ask for none)."""
        self._el_capture = []
        try:
            logps, ents, aux = super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                k,
                batch_size=batch_size,
                compute_entropy=True,
                compute_aux_loss=compute_aux_loss,
                **mm,
            )
            caps = self._el_capture
        finally:
            self._el_capture = None
        return logps, ents, aux, captured_sum_sq(caps, k, logps.shape)

    def _el_head_stats_pass(self, model, input_ids, attention_mask, k, batch_size, compute_aux_loss):
        """The backbone's last hidden states through head_stats (``attribution=True``, or no TRL fused
        head on the model): (logps, entropies, sum p^2, s_t or None, aux). s_t only in a training pass
        with ``attribution``."""
        if not self._el_attribution:
            _warn_once(
                self._el_warned,
                "fallback",
                "TRL's fused LM head is not on this model; log-probs, entropies "
                "and sum p^2 come from entropylens.rl.stats.head_stats on the hidden "
                "states",
            )
        return head_stats_pass(
            self._el_base_model(),
            self.accelerator.autocast,
            input_ids,
            attention_mask,
            k,
            batch_size,
            compute_aux_loss=compute_aux_loss,
            temperature=self.temperature,
            sensitivity=self._el_attribution and torch.is_grad_enabled(),
        )

    def _el_keep_pass(self, logps, ents, sq, sens) -> None:
        """A training pass: a hook keeps dLoss/dlogp [b, K] of the back-propagated loss, and the pass waits
        for the loss (``_el_train``). A no-grad pass during generation: kept to find the old policy's."""
        if torch.is_grad_enabled() and logps.requires_grad:
            box: dict = {}

            def hook(grad):  # dLoss/dlogp [b, K] of the back-propagated loss
                box["g"] = grad.detach()

            logps.register_hook(hook)
            self._el_train = {"lp": logps, "h": ents, "sq": sq, "box": box, "sens": sens}
        elif self._el_passes is not None:
            self._el_passes.append((logps, ents))


class _Loss(_Host):
    """The loss (mixed into EntropyLensGRPOTrainer): TRL's own, keeping the masks its options computed, or
    entropylens' ``policy_loss`` with TRL's options composed as TRL applies them, TRL's metrics logged from
    the same tensors. Takes ``_el_train`` (the training pass) and leaves the update waiting for its
    backward in ``_el_rec``."""

    def _compute_loss(self, model, inputs):
        if not self.model.training:
            return super()._compute_loss(model, inputs)
        self._el_train = None  # never another micro-batch's values
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        out = None
        modifiers = {}
        coef = self._el_coef_now()  # before the loss: TRL's adaptive controller moves at the step's last micro-batch
        if self._el_loss is None:
            loss, modifiers = self._el_trl_loss(model, inputs)
        else:
            out, loss = self._el_policy_loss(model, inputs, mask)
        train, self._el_train = self._el_train, None
        if train is None:
            _warn_once(
                self._el_warned, "norec", "a micro-batch without log-probs from this trainer's pass is not recorded"
            )
            return loss
        self._el_rec = {
            **train,
            "mask": mask,
            "adv": inputs["advantages"],
            "tokens": completion_ids,
            "old_lp": inputs.get("old_per_token_logps"),
            "old_h": inputs.get("old_entropies"),
            "seq": inputs.get("el_seq_ids"),
            "out": out,
            "loss": loss.detach(),
            "modifiers": modifiers,
            "coef": coef,
            "sampler_lp": inputs.get("sampling_per_token_logps"),
            "is_masked": self._el_is_masked(inputs),
        }
        self._el_add_kl_ref(inputs.get("ref_per_token_logps"), train["lp"], mask)
        return loss

    def _el_trl_loss(self, model, inputs):
        """TRL's own loss, keeping what its options did to each token (the masks it computed, the vLLM
        weight) for ``token_kept`` / ``seq_kept`` / ``is_weight``: (loss, modifiers)."""
        self._el_masks = {}
        try:
            loss = super()._compute_loss(model, inputs)
            modifiers = self._el_masks
        finally:
            self._el_masks = None
        if self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo":
            modifiers["is_weight"] = inputs["importance_sampling_ratio"].detach().float()
        return loss, modifiers

    def _el_coef_now(self) -> dict:
        """The entropy bonus's steps columns for this micro-batch: the coefficient the loss applies (TRL's gate
        of the previous optimizer step when adaptive) and, when adaptive, the controller's own coefficient."""
        if not self._entropy_bonus_enabled:
            return {}
        if not self.use_adaptive_entropy:
            return {"entropy_coef": float(self.entropy_coef)}
        shut = self._last_world_entropy > self.args.entropy_target
        return {
            "entropy_coef": 0.0 if shut else float(self.entropy_coef),
            "entropy_coef_adaptive": float(self.entropy_coef),
        }

    def _el_is_masked(self, inputs):
        """The tokens TRL's vLLM IS correction masked ([B, T], or [B, 1] at sequence level): in its
        token_mask / sequence_mask modes it sets the weight of a ratio outside [clip_min, clip_max] to 0.
        None without a masking correction (truncate modes, no vLLM weight)."""
        w = inputs.get("importance_sampling_ratio")
        if (
            w is None
            or not (self.use_vllm and self.vllm_importance_sampling_correction)
            or self.vllm_importance_sampling_mode not in ("token_mask", "sequence_mask")
        ):
            return None
        return w.detach() == 0

    def _el_add_kl_ref(self, ref, lp, mask) -> None:
        """Adds the micro-batch's KL to the reference (k3, and its tokens) to the step's, on the device."""
        if not self.beta or ref is None:
            return
        m = mask.float()
        d = ref.detach().float() - lp.detach().float()  # ref - logp
        part = torch.stack([((torch.exp(d) - d - 1.0) * m).sum(), m.sum()])  # on the device, no sync
        self._el_kl_ref = part if self._el_kl_ref is None else self._el_kl_ref + part

    def get_high_entropy_mask(self, entropies, mask, threshold):
        """TRL's top-entropy token mask; kept for the tokens' ``token_kept`` column with TRL's own loss."""
        keep = super().get_high_entropy_mask(entropies, mask, threshold)
        if self._el_masks is not None:
            self._el_masks["token_kept"] = keep.detach()
        return keep

    def get_off_policy_mask(self, advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        """TRL's off-policy sequence mask; kept for ``seq_kept`` with TRL's own loss."""
        keep = GRPOTrainer.get_off_policy_mask(
            advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold
        )
        if self._el_masks is not None:
            self._el_masks["seq_kept"] = keep.detach().bool()
        return keep

    def _el_policy_loss(self, model, inputs, mask):
        """entropylens' ``policy_loss`` with every option of TRL's ``_compute_loss`` composed as TRL
        applies it, normalised as TRL normalises ``self.loss_type`` (:func:`trl_loss_weights`):
        policy term x off-policy sequence mask x top-entropy token mask x vLLM IS weight, + beta KL
        (times the ratio with ``use_bias_correction_kl``), - the entropy bonus (TRL's own coefficient
        and gating, adaptive controller included), + the MoE router aux loss. (out, loss)."""
        lp, h, aux = self._el_policy_pass(model, inputs)
        args, ga = self.args, self.current_gradient_accumulation_steps
        adv = inputs["advantages"]
        old_lp = inputs.get("old_per_token_logps")
        old_lp = lp.detach() if old_lp is None else old_lp
        old_h = inputs.get("old_entropies")
        old_h = h.detach() if old_h is None else old_h
        token_mask, seq_mask, is_w = self._el_trl_masks(inputs, lp, h, mask, adv, old_lp)
        w = trl_loss_weights(
            self.loss_type,
            mask,
            ga=ga,
            num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=args.steps_per_generation,
            max_completion_length=self.max_completion_length,
        )
        bonus = self._el_entropy_bonus(h, mask, token_mask, ga)
        kl = {}
        if self.beta:
            kl = dict(
                ref_logprobs=inputs["ref_per_token_logps"],
                kl_coef=self.beta,
                kl_bias_correction=bool(args.use_bias_correction_kl),
            )
        method = self._el_loss
        assert method is not None  # _compute_loss calls this only with loss=...
        out = policy_loss(
            lp,
            old_lp,
            adv,
            mask,
            method=method,
            eps_low=self.epsilon_low,
            eps_high=self.epsilon_high,
            entropy=h,
            old_entropy=old_h,
            weights=w,
            token_mask=token_mask,
            seq_mask=seq_mask,
            is_weight=is_w,
            delta=args.delta,
            ratio_level="token" if method == "gspo" else self.importance_sampling_level,
            **self._el_loss_kw,
            **kl,
            **bonus,
        )
        loss = out.loss
        if self.aux_loss_enabled:  # TRL's MoE router aux loss, scaled for accumulation as TRL does
            loss = loss + self.router_aux_loss_coef * aux / ga
            self._metrics["train"]["aux_loss"].append(self.accelerator.gather_for_metrics(aux).mean().item())
        self._el_trl_metrics(out, lp, h, mask, inputs.get("ref_per_token_logps"), old_lp)
        return out, loss

    def _el_policy_pass(self, model, inputs):
        """The training pass over prompt + completion (multimodal inputs included): (logps, entropies, aux)."""
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mm = {key: inputs.get(key) for key in MM_KEYS if inputs.get(key) is not None}
        return self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attn,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **mm,
        )

    def _el_trl_masks(self, inputs, lp, h, mask, adv, old_lp):
        """What TRL's options do to each token, computed by TRL's own methods: the top-entropy token mask
        (the quantile over all processes), the off-policy sequence mask, the vLLM importance-sampling
        weight [B, T]; each None where its option is off."""
        adv2 = adv.unsqueeze(1) if adv.dim() == 1 else adv  # [B, 1] or [B, T], as TRL's masks take it
        token_mask = seq_mask = is_w = None
        if self.top_entropy_quantile < 1.0:  # TRL's own method: the quantile over all processes
            token_mask = self.get_high_entropy_mask(h.detach(), mask, 1 - self.top_entropy_quantile)
        if self.off_policy_mask_threshold is not None:
            sampling = inputs.get("sampling_per_token_logps", old_lp)
            seq_mask = self.get_off_policy_mask(adv2, lp, sampling, mask, self.off_policy_mask_threshold)
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_w = inputs["importance_sampling_ratio"].expand(mask.shape)  # [B, T] or [B, 1] -> [B, T]
        return token_mask, seq_mask, is_w

    def _el_entropy_bonus(self, h, mask, token_mask, ga) -> dict:
        """``policy_loss``'s entropy-bonus arguments as TRL applies its bonus (its coefficient, gated by the
        previous optimizer step's entropy when adaptive; normalised over the kept tokens); {} when off."""
        if not self._entropy_bonus_enabled:
            return {}
        eff = mask.float() if token_mask is None else mask.float() * token_mask.float()  # [B, T]
        coef = self.entropy_coef
        if self.use_adaptive_entropy:  # the gate of the previous optimizer step, as TRL applies it
            coef = self.entropy_coef if self._last_world_entropy <= self.args.entropy_target else 0.0
        bonus = dict(entropy_coef=float(coef), entropy_weights=eff / (eff.sum().clamp(min=1.0) * ga))
        if self.use_adaptive_entropy:
            self._el_adapt_entropy(h.detach(), eff)
        return bonus

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
        metrics = trl_loss_metrics(
            out,
            lp,
            h,
            mask,
            ref,
            old_lp,
            kl=bool(self.beta),
            kl_bias_correction=bool(self.beta) and bool(self.args.use_bias_correction_kl),
            level=self.importance_sampling_level,
            loss_type=self.loss_type,
        )
        m = mask.float()
        names = list(metrics)
        local = torch.stack([s for k in names for s in ((metrics[k] * m).sum(), m.sum())])
        totals = self.accelerator.reduce(local, reduction="sum").view(-1, 2).tolist()  # one sync
        for k, (total, count) in zip(names, totals):
            self._metrics["train"][k].append(total / max(count, 1.0))
        if self._entropy_bonus_enabled and self.accelerator.sync_gradients:
            self._metrics["train"]["entropy_coef"].append(self.entropy_coef)


class _Recording(_Host):
    """What is recorded (mixed into EntropyLensGRPOTrainer): each generation batch's sequences (with
    run-unique ids and the old policy's entropies put in the batch), each update once its backward has run
    (``_el_rec``), each optimizer step's scalars at its end."""

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
        old_h = _entropies_of_pass(out.get("old_per_token_logps"), passes)
        if old_h is not None:  # the entropies of exactly the pass that became old_per_token_logps
            out["old_entropies"] = old_h
        ids = self._el_new_seq_ids(out["completion_ids"])
        out["el_seq_ids"] = ids
        if self.model.training and self._el_rewards is not None:
            self._el_record_sequences(out, ids)
        return out

    def _el_new_seq_ids(self, completion_ids) -> torch.Tensor:
        """Run-unique ids of this rank's new sequences: local index * world_size + rank."""
        b = completion_ids.size(0)
        world, pi = self.accelerator.num_processes, self.accelerator.process_index
        ids = (self._el_seq_count + torch.arange(b, device=completion_ids.device)) * world + pi
        self._el_seq_count += b
        return ids

    def _el_record_sequences(self, out, ids) -> None:
        """This rank's sequences of the generation batch: reward (as TRL weighs them), advantage, length,
        group and text."""
        b = out["completion_ids"].size(0)
        world, pi = self.accelerator.num_processes, self.accelerator.process_index
        g = self.num_generations
        # the caller checks _el_rewards; _calculate_rewards sets _el_completions with it; GRPOConfig sets g
        assert self._el_rewards is not None and self._el_completions is not None and g is not None
        rewards = self._el_rewards[pi * b : (pi + 1) * b]
        texts = None
        if self._el_texts:
            texts = completion_texts(self._el_completions[:b])
        gidx = self._el_group_base + torch.arange(pi * b, (pi + 1) * b) // g
        self._el_group_base += -(-b * world // g)
        self.recorder.record_sequences(
            self.state.global_step,
            seq_ids=ids,
            rewards=rewards,
            advantages=out["advantages"],
            lengths=out["completion_mask"].sum(1),
            group_ids=gidx,
            texts=texts,
        )

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._el_rec = None
        if self._el_micro == 0:  # the learning rate this optimizer step uses (the scheduler steps after it)
            self._el_lr = self._get_learning_rate() if hasattr(self, "_get_learning_rate") else self.args.learning_rate
        result = super().training_step(model, inputs, num_items_in_batch)
        rec, self._el_rec = self._el_rec, None
        if rec is not None:  # the backward has run: the hook holds dLoss/dlogp
            self._el_record(rec)
        return result

    def _el_record(self, rec: dict) -> None:
        """Records the micro-batch whose backward has run (``rec``: what ``_compute_loss`` kept)."""
        lp, mask, adv = rec["lp"].detach(), rec["mask"], rec["adv"]
        h = rec["h"].detach() if rec["h"] is not None else None
        old_lp = rec["old_lp"] if rec["old_lp"] is not None else lp
        old_h = rec["old_h"] if rec["old_h"] is not None else h  # on-policy micro-batch: rho = 1
        g = rec["box"].get("g")
        cols, config = self._el_update_columns(rec, lp, old_lp, g)
        # TRL's entropy bonus reaches the logits through H too: the closed form would not be the norm
        if g is not None and rec["sq"] is not None and not self._entropy_bonus_enabled:
            cols["logit_grad_norm"] = logit_grad_norm_from_sum_p2(g, lp, rec["sq"], self.temperature)
        self.recorder.record_update(
            self.state.global_step,
            self._el_micro,
            mask=mask,
            advantages=adv,
            logprobs=lp,
            old_logprobs=old_lp,
            entropy=h,
            old_entropy=old_h,
            tokens=rec["tokens"],
            seq_ids=rec["seq"],
            loss=LossColumns(cols, rec["loss"], config),
            entropy_sensitivity=rec.get("sens"),
            temperature=self.temperature,
            sampler_logprobs=rec.get("sampler_lp"),
            is_masked=rec.get("is_masked"),
        )
        self._el_micro += 1

    def _el_update_columns(self, rec: dict, lp, old_lp, g) -> tuple[dict, dict]:
        """The update's loss columns and settings: entropylens' loss gave them (``rec["out"]``), or they are
        derived for TRL's own loss (:func:`trl_own_loss_columns`)."""
        out = rec["out"]
        if out is not None:
            return dict(out.columns), {**out.config, **rec.get("coef", {})}
        cols = trl_own_loss_columns(
            self.loss_type,
            self.importance_sampling_level,
            self.args.delta,
            self.epsilon_low,
            self.epsilon_high,
            lp,
            old_lp,
            rec["adv"],
            rec["mask"],
            g,
            rec.get("modifiers", {}),
        )
        # TRL's entropy bonus reaches the logits through H: the recorder leaves entropy_effect null
        return cols, dict(rec.get("coef", {}))

    def _el_step_end(self) -> None:
        """The optimizer step that just finished: its scalars recorded, its files written, and the step
        aggregates the writer thread has ready logged."""
        step = self.state.global_step - 1  # the optimizer step that just finished
        self._el_record_step(step)
        # the summary comes from the writer thread once it has taken in the step: asking without
        # waiting keeps the training thread off the writer's disk work (the previous step's files,
        # fsync included); answers are logged as they arrive, all of them by the last step
        self._el_summaries.append((step, self.recorder.step_summary_later(step, self._el_names)))
        self.recorder.end_step(step)  # written now, not when the next step (after its generation) begins
        last = self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps
        if last and self._el_extras is not None:  # findings reach the trackers before on_train_end closes them
            self.recorder.observe_alarms()
        self._el_log_ready_summaries(wait=last)
        self._el_micro = 0
        self._el_grad_norm = None
        self._el_kl_ref = None
        self._el_lr = None

    def _el_record_step(self, step: int) -> None:
        """The step's scalars: the grad norm before clipping, the learning rate it used, the KL to the reference."""
        gn = self._el_grad_norm
        lr = self._el_lr if self._el_lr is not None else self.args.learning_rate  # read before the scheduler stepped
        kl: dict[str, Any] = {}  # record_step's **metrics
        if self._el_kl_ref is not None:  # a device scalar: the writer thread reads it, no sync here
            kl["kl_ref"] = self._el_kl_ref[0] / self._el_kl_ref[1].clamp(min=1.0)
        self.recorder.record_step(step, grad_norm=float(gn) if gn is not None else None, lr=float(lr), **kl)


class _Logging(_Host):
    """The step aggregates to TRL's trackers (mixed into EntropyLensGRPOTrainer): each step's summary,
    asked of the writer thread at the step's end (``_el_summaries``), logged when it is ready."""

    def _el_log_ready_summaries(self, wait: bool) -> None:
        """Logs the asked step summaries in step order, as far as the writer thread has them (all of them,
        waiting for the writer, where ``wait``)."""
        while self._el_summaries and (wait or self._el_summaries[0][1].ready()):
            done, pending = self._el_summaries.pop(0)
            self._el_log_summary(done, pending.result())

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


class EntropyLensGRPOTrainer(_Passes, _Loss, _Recording, _Logging, GRPOTrainer):
    """GRPOTrainer + entropylens recording (+ optionally entropylens' losses). See
    :mod:`entropylens.integrations.trl`. Its arguments are GRPOTrainer's plus the ones below (``loss`` and
    ``erc`` are checked before TRL builds anything). ``train`` closes the recorder (status "failed" when it
    raised).

    Args:
        *args: GRPOTrainer's positional arguments (model, reward_funcs, args, ...), passed on.
        entropylens_root: the directory (or object-store URL) the run is recorded under (the Recorder's
            ``root``). Default "entropylens-runs".
        run: the run id; None (default): a new one.
        loss: None (default): TRL's own loss, recorded (the run's method is ``trl-<loss_type>``). A method of
            ``entropylens.rl.losses`` (grpo, dapo, gppo, ce_gppo, cispo, gspo, sapo, clip_cov, kl_cov): trains
            with ``policy_loss`` instead, every GRPOConfig option composed as TRL applies it, normalised as the
            configured ``loss_type`` (eps from GRPOConfig's epsilon / epsilon_high; sapo takes TRL's
            sapo_temperature_pos / _neg and no clamp of log r).
        beta1: CE-GPPO's low-side scale (``policy_loss``'s beta1) with ``loss=...``; written to run.json for
            loss="ce_gppo". Default 0.5.
        beta2: CE-GPPO's high-side scale (``policy_loss``'s beta2) with ``loss=...``; written to run.json for
            loss="ce_gppo". Default 1.0.
        erc: (low, high): the ERC band (``policy_loss``'s erc). Needs ``loss=...``. None (default): off.
        dual_clip: ``policy_loss``'s dual_clip with ``loss=...``; with ``loss=None`` TRL's loss does not apply
            it (it is only written to run.json's config). None (default): off.
        tau: the HP / LP threshold of the quadrants (the Recorder's and ``policy_loss``'s tau). Default 0.5.
        sample: the share of sequences whose token rows are kept (the Recorder's ``sample``). Default 1.0.
        record_texts: each sequence's decoded completion goes to ``sequences.text`` (TRL's decoding, special
            tokens skipped). Default True.
        attribution: also record the entropy attribution (``entropy_effect``, and with ``loss=...``
            ``entropy_effect_dropped``): every pass then runs through entropylens' tiled ``head_stats`` in
            place of TRL's fused head. Default False.
        resume: continue a killed job's run (the same ``run``): a TRL checkpoint directory (its
            trainer_state.json's global_step N: the run continues after step N - 1), or that step as an int
            (checked against the checkpoints in ``output_dir``). ``train`` refuses, before training, a
            ``resume_from_checkpoint`` that is not that checkpoint. None (default): a new run.
        save_tokenizer: True: always keep a copy of the tokenizer in ``<run>/tokenizer/``; False: never; None
            (default): only a tokenizer that has no name to load (built in memory).
        alarms: the Recorder's ``alarms`` (True, or an ``alarms.Thresholds``): live alarm rules on each step;
            with trackers each finding is also their alert. None (default): off.
        stop_on: the rules (names, or "all") whose finding stops training, through the trainer's callback, on
            every process. Needs ``alarms``. Default: none.
        log_histograms: each step's histograms to the TensorBoard, W&B and Trackio trackers of ``report_to``
            (rank 0; none without such a tracker). Default True.
        log_table_every: every N steps a token table to the trackers that have tables (W&B, Trackio); 0 or
            None: never. Default 50.
        cov: with loss="clip_cov" / "kl_cov": a dict of clip_cov_ratio, clip_cov_lb, clip_cov_ub / kl_cov_ratio,
            ppo_kl_coef (missing: verl's defaults); Clip-Cov draws on a CPU generator seeded with
            ``args.seed``. None (default): verl's defaults.
        **kwargs: GRPOTrainer's keyword arguments (model, reward_funcs, args, train_dataset,
            processing_class, ...), passed on.

    Raises:
        ValueError: when loss is not a method, erc comes without loss, loss comes with a GRPOConfig
            loss_type whose normalisation entropylens does not know, cov names keys of another method or
            comes with another loss, resume is not a TRL checkpoint (or an int that ends none of
            ``output_dir``'s checkpoints), or the Recorder refuses its arguments.
    """

    def __init__(
        self,
        *args: Any,
        entropylens_root: str | os.PathLike[str] = "entropylens-runs",
        run: str | None = None,
        loss: str | None = None,
        beta1: float = 0.5,
        beta2: float = 1.0,
        erc: Sequence[float] | None = None,
        dual_clip: float | None = None,
        tau: float = 0.5,
        sample: float = 1.0,
        record_texts: bool = True,
        attribution: bool = False,
        resume: int | str | os.PathLike[str] | None = None,
        save_tokenizer: bool | None = None,
        alarms: bool | Thresholds | None = None,
        stop_on: str | Iterable[str] = (),
        log_histograms: bool = True,
        log_table_every: int | None = 50,
        cov: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        _check_arguments(loss, erc, kwargs.get("args", args[2] if len(args) > 2 else None))
        super().__init__(*args, **kwargs)
        if loss is not None:
            refuse_unsupported(loss, unsupported_trl_options(self.args, self.aux_loss_enabled))
        self._el_loss = loss
        self._el_loss_kw = dict(
            beta1=beta1,
            beta2=beta2,
            erc=tuple(erc) if erc else None,
            dual_clip=dual_clip,
            tau=tau,
            **cov_kwargs(loss, cov, self.args.seed),
        )
        if loss == "sapo":  # TRL's own gate temperatures; TRL does not clamp log r (verl does)
            self._el_loss_kw.update(
                sapo_tau_pos=float(self.args.sapo_temperature_pos),
                sapo_tau_neg=float(self.args.sapo_temperature_neg),
                sapo_log_ratio_clamp=None,
            )
        self._el_texts = record_texts
        cfg = run_config(
            self,
            loss=loss,
            beta1=beta1,
            beta2=beta2,
            erc=erc,
            dual_clip=dual_clip,
            attribution=attribution,
            save_tokenizer=save_tokenizer,
        )
        self._el_resume = resume_step(resume, self.args.output_dir)
        self._el_open_recorder(
            entropylens_root,
            run,
            cfg,
            tau=tau,
            sample=sample,
            alarms=alarms,
            stop_on=stop_on,
            log_histograms=log_histograms,
            log_table_every=log_table_every,
        )
        if self.accelerator.is_main_process:
            save_tokenizer_copy(self.processing_class, self.recorder.dir, save_tokenizer)
        self._el_init_state()
        self._el_attribution = bool(attribution)  # head_stats in every pass, s_t in the training pass
        self._el_fused = False if attribution else self._el_patch_fused_head()
        self._el_wrap_clip_grad_norm()
        self.add_callback(_StepCallback(self))
        if on_policy(self) and self.accelerator.is_main_process:  # once, before the first step
            from ..report.run_findings import ON_POLICY_TEXT, OnPolicyWarning

            warnings.warn(
                f"entropylens: on_policy: {ON_POLICY_TEXT} (TRL keeps no old log-probs: "
                f"gradient_accumulation_steps {self.args.gradient_accumulation_steps} is a multiple of "
                f"steps_per_generation {self.args.steps_per_generation} x num_iterations "
                f"{self.num_iterations})",
                OnPolicyWarning,
                stacklevel=2,
            )

    def _el_open_recorder(
        self, root, run, cfg, *, tau, sample, alarms, stop_on, log_histograms, log_table_every
    ) -> None:
        """The run's Recorder, and what goes to report_to's TensorBoard / W&B / Trackio (rank 0) besides
        TRL's scalars: histograms, the token table and alerts."""
        extras = trl_trackers(self.callback_handler.callbacks) if self.accelerator.is_main_process else []
        hist_on = bool(log_histograms) and bool(extras)
        table_every = int(log_table_every or 0) if any(t.has_tables for t in extras) else 0
        self.recorder = Recorder(
            root,
            run,
            config=cfg,
            tau=tau,
            sample=sample,
            rank=self.accelerator.process_index,
            world_size=self.accelerator.num_processes,
            resume=self._el_resume,
            alarms=alarms,
            stop_on=stop_on,
            log_histograms=hist_on,
            log_table_every=table_every,
        )
        log = StepLog(extras, self.recorder.run, cfg, step_offset=1) if extras else None
        self._el_extras = log
        self._el_names = SUMMARY_NAMES + EXTRA_NAMES if hist_on or table_every else SUMMARY_NAMES
        if alarms and log is not None:  # findings as the trackers' own alerts
            self.recorder.on_alarm(lambda finding: log.alert(finding, self.recorder._stop_on))

    def _el_init_state(self) -> None:
        """What the overrides hand each other between TRL's calls."""
        self._el_micro = 0
        self._el_seq_count = 0  # sequences generated on this rank so far
        self._el_group_base = 0
        self._el_rewards = None
        self._el_completions = None  # the generation batch's decoded completions (with _el_rewards)
        self._el_grad_norm = None
        self._el_kl_ref = None  # [sum of k3(ref || theta), tokens] of the step's micro-batches (beta > 0)
        self._el_lr = None  # the learning rate of the optimizer step in progress
        self._el_capture = None  # list while a pass runs: log_sum_sq_probs of each fused forward
        self._el_passes = None  # list during generation: (logps, entropies) of each no-grad pass
        self._el_train = None  # the training pass of the current micro-batch
        self._el_rec = None  # the update waiting for its backward
        self._el_masks = None  # dict while TRL's own loss runs: the token / sequence masks it computed
        self._el_summaries = []  # step summaries asked of the writer thread, not yet logged
        self._el_warned = set()

    def _el_wrap_clip_grad_norm(self) -> None:
        """Keeps the global grad norm before clipping, as the optimizer step sees it."""
        acc = self.accelerator
        orig_clip = acc.clip_grad_norm_

        def clip_grad_norm_(*a, **k):
            norm = orig_clip(*a, **k)
            self._el_grad_norm = norm
            return norm

        acc.clip_grad_norm_ = clip_grad_norm_

    def _el_should_stop(self) -> bool:
        """Any process's stop_on alarm stops every process (each rank's rules see its own steps; a
        stop on one rank alone would leave the others waiting in a collective)."""
        flag = float(self.recorder.should_stop)
        if self.accelerator.num_processes > 1:
            t = torch.tensor([flag], device=self.accelerator.device)
            flag = float(self.accelerator.reduce(t, reduction="sum").item())
        return flag > 0

    def train(self, *args: Any, **kwargs: Any) -> TrainOutput:
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
            raise ValueError(
                f"resume={self._el_resume} but {checkpoint} holds steps 0-{last}: build the trainer "
                f"with resume={last} (or resume={str(checkpoint)!r})"
            )
