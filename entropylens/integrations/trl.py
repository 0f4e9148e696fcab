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
  ``is_weight``); ``loss="ce_gppo"`` (or any method of ``entropylens.rl.losses``) replaces it with
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
backbone's hidden states and :func:`entropylens.rl.stats.head_stats` (a warning says so once).

``attribution=True`` records the entropy attribution (``entropy_effect`` = g_t s_t / T^2 per token and
the steps' budget sums; DESIGN.md): TRL's fused head gives sum_j p_j^2 but not sum_j p_j^2 log p_j,
so every pass then goes through :func:`entropylens.rl.stats.head_stats` on the backbone's hidden states
(tiled, no [b, K, V] logits either), which also returns s_t in the training pass. With ``loss=...``
``entropy_effect_dropped`` (what clipping / beta / ERC took away) is recorded too; with TRL's own loss
it stays null (the unclipped coefficient of TRL's loss is not known).

entropylens step = optimizer step (``state.global_step``), update = micro-batch within it.

The code: :mod:`.trl_trainer` (the trainer; importing it imports TRL, after the version check),
:mod:`.trl_loss` (TRL's normalisations, its clip columns and metrics), :mod:`.trl_passes` (sum p^2 from the
fused head, the head_stats fallback), :mod:`.trl_run` (version, run.json's config, resume, texts). This
module imports no TRL until ``EntropyLensGRPOTrainer`` is asked for.
"""

from __future__ import annotations

from ..rl.stats import logit_grad_norm_from_sum_p2
from .trl_loss import (
    PPO_CLIP_LOSS_TYPES,
    TRL_NORMALISATION,
    WINDOW_LOSS_TYPES,
    trl_clip_columns,
    trl_loss_weights,
    unsupported_trl_options,
)
from .trl_run import TRL_TESTED, check_trl_version, checkpoint_last_step, completion_texts

closed_form_logit_grad_norm = logit_grad_norm_from_sum_p2  # the name this module exported before


def __getattr__(name):
    if name == "EntropyLensGRPOTrainer":  # TRL is imported (and its version checked) on first use
        from .trl_trainer import EntropyLensGRPOTrainer

        globals()[name] = EntropyLensGRPOTrainer
        return EntropyLensGRPOTrainer
    raise AttributeError(name)


__all__ = [
    "EntropyLensGRPOTrainer",  # noqa: F822 - resolved lazily by __getattr__ above
    "check_trl_version",
    "unsupported_trl_options",
    "trl_clip_columns",
    "closed_form_logit_grad_norm",
    "TRL_TESTED",
    "TRL_NORMALISATION",
    "WINDOW_LOSS_TYPES",
    "PPO_CLIP_LOSS_TYPES",
    "trl_loss_weights",
    "completion_texts",
    "checkpoint_last_step",
]
