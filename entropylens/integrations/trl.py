"""TRL: a GRPOTrainer that records every update with entropylens and can train with CE-GPPO / GPPO / ERC.

    from entropylens.integrations.trl import EntropyLensGRPOTrainer
    trainer = EntropyLensGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                     train_dataset=ds, processing_class=tok,
                                     entropylens_root="runs", loss="ce_gppo", beta1=0.5, beta2=1.0,
                                     erc=(0.95, 1.05))
    trainer.train()

What it changes in TRL (private methods, hence the version check):
- ``_get_per_token_logps_and_entropies``: runs the model's plain forward (not TRL's fused LM head)
  for text-only batches, so the completion logits exist; computes log-probs and full-vocabulary
  entropies with ``entropylens.stats.logprobs_and_entropy`` (temperature applied as TRL does) and, in
  the training pass, hooks the logits for exact logit-gradient norms. In the no-grad old-policy pass
  it keeps the entropies, which TRL throws away, so the entropy ratio exists.
- ``_generate_and_score_completions``: adds ``old_entropies`` and run-unique ``el_seq_ids`` to the
  batch (they are shuffled and split with it) and records the sequences (reward, advantage, length).
- ``_compute_loss``: ``loss=None`` keeps TRL's loss and records the update; ``loss="ce_gppo"`` (or any
  method of ``entropylens.losses``) replaces it with ``policy_loss`` (eps from GRPOConfig's
  epsilon / epsilon_high, TRL's beta as k3 KL), token-mean per micro-batch, scaled for gradient
  accumulation. Step aggregates go to TRL's logs as ``entropylens/...``.
- ``accelerator.clip_grad_norm_`` is wrapped to record the global grad norm before clipping.

entropylens step = optimizer step (``state.global_step``), update = micro-batch within it.
"""

from __future__ import annotations

import os

import torch

from ..losses import METHODS, policy_loss
from ..recorder import Recorder
from ..stats import logprobs_and_entropy

TRL_TESTED = ("1.16",)  # major.minor releases whose private GRPOTrainer methods this was tested against
LOG_KEYS = ("entropy_ratio_p05", "entropy_ratio_p50", "entropy_ratio_p95", "erc_drop_frac", "kl_k3",
            "clip_low_frac", "clip_high_frac", "clip_frac_pa_lp", "clip_frac_na_lp", "lgn_mean_pa_hp",
            "lgn_mean_pa_lp", "lgn_mean_na_hp", "lgn_mean_na_lp")
_MM_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
            "token_type_ids", "mm_token_type_ids", "image_position_ids")


def check_trl_version(version: str | None = None) -> str:
    """Raise a clear error on a TRL release this integration was not tested with
    (ENTROPYLENS_TRL_UNSAFE=1 skips the check)."""
    if version is None:
        import trl

        version = trl.__version__
    mm = ".".join(version.split(".")[:2])
    if mm not in TRL_TESTED and os.environ.get("ENTROPYLENS_TRL_UNSAFE") != "1":
        raise RuntimeError(
            f"entropylens.integrations.trl supports TRL {', '.join(v + '.x' for v in TRL_TESTED)}; found {version}. "
            "It overrides private GRPOTrainer methods that move between releases. "
            "Install a supported TRL, or set ENTROPYLENS_TRL_UNSAFE=1 to try anyway."
        )
    return version


def _trainer_class():
    check_trl_version()
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    class _Callback(TrainerCallback):
        def __init__(self, owner):
            self.owner = owner

        def on_step_end(self, args, state, control, **kwargs):
            self.owner._el_step_end()

    class EntropyLensGRPOTrainer(GRPOTrainer):
        """GRPOTrainer + entropylens recording (+ optionally entropylens' losses). See the module docstring."""

        def __init__(self, *args, entropylens_root="entropylens-runs", run=None, loss=None, beta1=0.5, beta2=1.0,
                     erc=None, dual_clip=None, tau=0.5, sample=1.0, record_texts=False, **kwargs):
            if loss is not None and loss not in METHODS:
                raise ValueError(f"loss: unknown {loss!r}; valid: {', '.join(METHODS)} (or None for TRL's own)")
            if erc is not None and loss is None:
                raise ValueError("erc needs loss=... (ERC is part of entropylens' losses, not TRL's)")
            super().__init__(*args, **kwargs)
            self._el_loss = loss
            self._el_loss_kw = dict(beta1=beta1, beta2=beta2, erc=tuple(erc) if erc else None, dual_clip=dual_clip,
                                    tau=tau)
            self._el_texts = record_texts
            cfg = {
                "method": loss or f"trl-{self.loss_type}", "framework": "trl",
                "trl_loss_type": self.loss_type, "eps_low": self.epsilon_low, "eps_high": self.epsilon_high,
                "beta1": beta1 if loss == "ce_gppo" else None, "beta2": beta2 if loss == "ce_gppo" else None,
                "erc": erc, "dual_clip": dual_clip, "lr": self.args.learning_rate, "seed": self.args.seed,
                "num_generations": self.num_generations, "num_iterations": self.num_iterations,
                "temperature": self.temperature, "kl_beta": self.beta,
                "model": getattr(self.model.config, "_name_or_path", None) or type(self.model).__name__,
            }
            self.recorder = Recorder(entropylens_root, run, config=cfg, tau=tau, sample=sample,
                                     rank=self.accelerator.process_index, world_size=self.accelerator.num_processes)
            self._el_micro = 0
            self._el_seq_base = 0
            self._el_old_entropy = None
            self._el_rewards = None
            self._el_grad_norm = None
            self._el_last = None
            acc = self.accelerator
            orig_clip = acc.clip_grad_norm_

            def clip_grad_norm_(*a, **k):  # the norm before clipping, as the optimizer step sees it
                norm = orig_clip(*a, **k)
                self._el_grad_norm = norm
                return norm

            acc.clip_grad_norm_ = clip_grad_norm_
            self.add_callback(_Callback(self))

        # -- training entry: the recorder's status follows the run ---------------------------------
        def train(self, *args, **kwargs):
            try:
                out = super().train(*args, **kwargs)
            except BaseException:
                self.recorder.close(status="failed", _raise=False)
                raise
            self.recorder.close()
            return out

        # -- log-probs and entropies from the logits ----------------------------------------------
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **mm):
            if any(mm.get(k) is not None for k in _MM_KEYS) or mm.get("num_images") is not None:
                return super()._get_per_token_logps_and_entropies(  # multimodal: TRL's own path, unrecorded
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **mm)
            batch_size = batch_size or input_ids.size(0)
            logps, ents, auxes = [], [], []
            training = torch.is_grad_enabled()
            for start in range(0, input_ids.size(0), batch_size):
                ids = input_ids[start : start + batch_size]
                kw = {"output_router_logits": True} if compute_aux_loss else {}
                with self.accelerator.autocast():
                    out = model(input_ids=ids, attention_mask=attention_mask[start : start + batch_size],
                                logits_to_keep=logits_to_keep + 1, **kw)
                logits = out.logits[:, :-1]  # [b, K, V]: predicts the K completion tokens
                tokens = ids[:, -logits_to_keep:]
                if training and logits.requires_grad and input_ids.size(0) <= batch_size:
                    self.recorder.watch_logits(logits)
                lp, h = logprobs_and_entropy(logits, tokens, temperature=self.temperature)
                logps.append(lp)
                ents.append(h)
                if compute_aux_loss:
                    auxes.append(out.aux_loss)
            logps, ents = torch.cat(logps), torch.cat(ents)
            if not training and model is self.model:
                self._el_old_entropy = ents  # the old policy's entropies (TRL drops them)
            if training:
                self._el_last = (logps, ents)
            aux = torch.stack(auxes).mean() if compute_aux_loss else None
            return logps, (ents if compute_entropy or training else None), aux

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            w = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
            self._el_rewards = (rewards_per_func * w).nansum(dim=1)  # [global B], as TRL weighs them
            self._el_completions = completions
            return rewards_per_func

        def _generate_and_score_completions(self, inputs):
            self._el_old_entropy = None
            out = super()._generate_and_score_completions(inputs)
            b = out["completion_ids"].size(0)
            ids = torch.arange(self._el_seq_base, self._el_seq_base + b, device=out["completion_ids"].device)
            self._el_seq_base += b
            out["el_seq_ids"] = ids
            if self._el_old_entropy is not None and "old_per_token_logps" in out:
                out["old_entropies"] = self._el_old_entropy
            if self.model.training and self._el_rewards is not None:
                pi = self.accelerator.process_index
                rewards = self._el_rewards[pi * b : (pi + 1) * b]
                texts = None
                if self._el_texts:
                    texts = [c if isinstance(c, str) else str(c) for c in self._el_completions[:b]]
                gidx = torch.arange(pi * b, (pi + 1) * b) // self.num_generations
                self.recorder.record_sequences(self.state.global_step, seq_ids=ids, rewards=rewards,
                                               advantages=out["advantages"], lengths=out["completion_mask"].sum(1),
                                               group_ids=gidx, texts=texts)
            return out

        # -- the loss ------------------------------------------------------------------------------
        def _compute_loss(self, model, inputs):
            mode = "train" if self.model.training else "eval"
            if mode != "train":
                return super()._compute_loss(model, inputs)
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            completion_ids = inputs["completion_ids"]
            if self._el_loss is None:
                loss = super()._compute_loss(model, inputs)
                lp, h = self._el_last
                out = None
            else:
                input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
                attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
                lp, h, _ = self._get_per_token_logps_and_entropies(model, input_ids, attn, completion_ids.size(1),
                                                                   compute_entropy=True)
            old_lp = inputs.get("old_per_token_logps")
            old_lp = lp.detach() if old_lp is None else old_lp
            old_h = inputs.get("old_entropies")
            old_h = h.detach() if old_h is None else old_h  # on-policy micro-batch: the ratio is 1
            adv = inputs["advantages"]
            if self._el_loss is not None:
                kl = dict(ref_logprobs=inputs["ref_per_token_logps"], kl_coef=self.beta) if self.beta else {}
                out = policy_loss(lp, old_lp, adv, mask, method=self._el_loss, eps_low=self.epsilon_low,
                                  eps_high=self.epsilon_high, entropy=h, old_entropy=old_h, **self._el_loss_kw,
                                  **kl)
                loss = out.loss / self.current_gradient_accumulation_steps
            self.recorder.record_update(self.state.global_step, self._el_micro, mask=mask, advantages=adv,
                                        logprobs=lp.detach(), old_logprobs=old_lp, entropy=h.detach(),
                                        old_entropy=old_h, tokens=completion_ids, seq_ids=inputs.get("el_seq_ids"),
                                        loss=out)
            self._el_micro += 1
            return loss

        def _el_step_end(self) -> None:
            step = self.state.global_step - 1  # the optimizer step that just finished
            gn = self._el_grad_norm
            lr = self._get_learning_rate() if hasattr(self, "_get_learning_rate") else self.args.learning_rate
            self.recorder.record_step(step, grad_norm=float(gn) if gn is not None else None, lr=float(lr))
            summary = self.recorder.step_summary(step)
            for k, v in summary.items():
                if k in LOG_KEYS and v == v:
                    self._metrics["train"][f"entropylens/{k}"].append(float(v))
            for q in ("pa_hp", "pa_lp", "na_hp", "na_lp"):
                if summary.get("n_tokens"):
                    self._metrics["train"][f"entropylens/share_{q}"].append(summary[f"n_{q}"] / summary["n_tokens"])
            self._el_micro = 0
            self._el_grad_norm = None

    return EntropyLensGRPOTrainer


def __getattr__(name):
    if name == "EntropyLensGRPOTrainer":
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


__all__ = ["EntropyLensGRPOTrainer", "check_trl_version", "TRL_TESTED"]
