"""The names entropylens uses inside verl: its loss modes (and the check that verl has them registered),
the keys the trainer writes into verl's batches, and new run ids.
"""

from __future__ import annotations

import secrets
from datetime import datetime

from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

METHODS = ("gppo", "ce_gppo")  # registered under their own names
PREFIXED = (
    "grpo",
    "dapo",
    "cispo",
    "sapo",
    "clip_cov",
    "kl_cov",
)  # registered as entropylens_<name> (verl has its own)
SAMPLE_ID = "entropylens_sample_id"  # int64 [B] in the batch: run-unique id of the sample
STEP = "entropylens_step"  # int64 [B] in the batch: the trainer step the update belongs to
OLD_ENTROPY_KEYS = ("entropylens_old_entropy", "entropy", "old_entropys", "entropys")  # first found wins
# the response's score as verl's reward step leaves it ([B, T] nested, summed over the response): first found wins
# (token_level_rewards last: it has the in-reward KL penalty subtracted)
REWARD_KEYS = ("token_level_scores", "rm_scores", "token_level_rewards")


def method_of(loss_mode: str) -> str | None:
    """entropylens method behind a verl loss_mode (None: verl's own loss)."""
    if loss_mode in METHODS:
        return loss_mode
    if loss_mode.startswith("entropylens_") and loss_mode[len("entropylens_") :] in (*METHODS, *PREFIXED):
        return loss_mode[len("entropylens_") :]
    return None


def registered_names() -> tuple[str, ...]:
    return (*METHODS, *(f"entropylens_{m}" for m in (*METHODS, *PREFIXED)))


def check_registered() -> None:
    """Loud check: verl logs plug-in load errors only at DEBUG, so the losses are verified here."""
    missing = [
        n for n in registered_names() if getattr(POLICY_LOSS_REGISTRY.get(n), "entropylens_method", None) is None
    ]
    if missing:
        raise RuntimeError(
            f"entropylens losses are not registered in verl: {', '.join(missing)} "
            "(import entropylens.integrations.verl, or check VERL_USE_EXTERNAL_PLUGINS)"
        )


def new_run_id(method: str) -> str:
    """A fresh run id: the method, the local time and 4 random hex digits."""
    return f"{method}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
