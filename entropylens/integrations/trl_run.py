"""The run around the TRL trainer, with no TRL import: the version gate, run.json's config, the resume
checks against TRL's checkpoints, and the completions' texts."""

from __future__ import annotations

import json
from pathlib import Path

from ..token_text import tokenizer_info
from ._version import require_tested
from .trl_loss import TRL_NORMALISATION

TRL_TESTED = ("1.16",)  # major.minor releases whose private GRPOTrainer methods this was tested against


def check_trl_version(version: str | None = None) -> str:
    """Raise a clear error on a TRL release this integration was not tested with
    (ENTROPYLENS_TRL_UNSAFE=1 skips the check)."""
    if version is None:
        import trl

        version = trl.__version__
    return require_tested(
        "TRL",
        version,
        TRL_TESTED,
        "ENTROPYLENS_TRL_UNSAFE",
        "It overrides private GRPOTrainer methods that move between releases.",
    )


def active_options(trainer) -> dict:
    """The GRPOConfig options that shape the objective, as this run used them (run.json)."""
    a = trainer.args
    out = {
        "beta": trainer.beta,
        "use_bias_correction_kl": bool(getattr(a, "use_bias_correction_kl", False)),
        "top_entropy_quantile": getattr(a, "top_entropy_quantile", 1.0),
        "delta": getattr(a, "delta", None),
        "off_policy_mask_threshold": getattr(a, "off_policy_mask_threshold", None),
        "importance_sampling_level": trainer.importance_sampling_level,
        "entropy_coef": getattr(a, "entropy_coef", 0.0),
        "use_adaptive_entropy": bool(getattr(a, "use_adaptive_entropy", False)),
        "vllm_importance_sampling_correction": bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
        "router_aux_loss_coef": getattr(a, "router_aux_loss_coef", None) if trainer.aux_loss_enabled else None,
    }
    if out["vllm_importance_sampling_correction"]:
        out["vllm_importance_sampling_mode"] = getattr(a, "vllm_importance_sampling_mode", None)
    return out


def on_policy(trainer) -> bool:
    """Whether TRL trains on-policy: it keeps no old log-probs (grpo_trainer: gradient_accumulation_steps is a
    multiple of steps_per_generation x num_iterations, and no vLLM importance-sampling correction), so every
    ratio is exactly 1 and clipping, CE-GPPO's beta1 / beta2 and ERC never act."""
    a = trainer.args
    every = a.steps_per_generation * trainer.num_iterations
    vllm_is = bool(
        getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False)
    )
    return a.gradient_accumulation_steps % every == 0 and not vllm_is


def run_config(trainer, *, loss, beta1, beta2, erc, dual_clip, attribution, save_tokenizer) -> dict:
    """run.json's ``config`` for a built trainer: the method, TRL's loss settings and options, the
    generation and accumulation settings, the model and the tokenizer."""
    return {
        "method": loss or f"trl-{trainer.loss_type}",
        "framework": "trl",
        "trl_loss_type": trainer.loss_type,
        "eps_low": trainer.epsilon_low,
        "eps_high": trainer.epsilon_high,
        "trl_importance_sampling_level": trainer.importance_sampling_level,
        "beta1": beta1 if loss == "ce_gppo" else None,
        "beta2": beta2 if loss == "ce_gppo" else None,
        "erc": erc,
        "dual_clip": dual_clip,
        "lr": trainer.args.learning_rate,
        "seed": trainer.args.seed,
        "num_generations": trainer.num_generations,
        "num_iterations": trainer.num_iterations,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "temperature": trainer.temperature,
        "kl_beta": trainer.beta,
        "attribution": bool(attribution),
        "model": getattr(trainer.model.config, "_name_or_path", None) or type(trainer.model).__name__,
        "trl_normalisation": TRL_NORMALISATION.get(trainer.loss_type),
        "trl_options": active_options(trainer),
        "tokenizer": tokenizer_info(trainer.processing_class, save_tokenizer),
    }


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
    try:
        n = int(json.loads((Path(path) / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"resume={str(path)!r} is not a TRL checkpoint directory (no trainer_state.json with a "
            f"global_step: {type(e).__name__}: {e})"
        ) from None
    if n < 1:
        raise ValueError(f"resume={str(path)!r}: the checkpoint holds no step (global_step {n})")
    return n - 1


def check_resume_step(resume: int, output_dir) -> None:
    """``resume=K`` must be the last step of a checkpoint: where ``output_dir`` holds checkpoints and none
    ends at step K, refuse (an off-by-one K would remove recorded steps the checkpoint covers, or keep
    one the resumed job records again)."""
    ends = {}
    for d in sorted(Path(output_dir).glob("checkpoint-*")) if output_dir else []:
        try:
            ends[d.name] = checkpoint_last_step(d)
        except ValueError:
            continue
    if ends and resume not in ends.values():
        listed = ", ".join(f"{name}: steps 0-{last}" for name, last in sorted(ends.items(), key=lambda kv: kv[1]))
        raise ValueError(
            f"resume={resume}: no checkpoint in {output_dir} ends at step {resume} ({listed}); pass "
            "resume=<the checkpoint's directory> (or its last step)"
        )


def resume_step(resume, output_dir) -> int | None:
    """The last recorded step a resumed run continues after: ``resume`` itself (checked against the
    checkpoints in ``output_dir``: :func:`check_resume_step`), or a checkpoint directory's last step."""
    if resume is not None and not isinstance(resume, int):  # a checkpoint directory: its last step
        return checkpoint_last_step(resume)
    if resume is not None:  # before the recorder removes the steps after it
        check_resume_step(resume, output_dir)
    return resume
