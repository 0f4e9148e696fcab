"""The trainer mode ``trainer.v1.trainer_mode=entropylens``: its registration with verl, which imports
the trainer (trainer.py, and with it verl's v1 trainer) only once verl's trainer registry imports."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register_trainer() -> bool:
    """Register ``trainer.v1.trainer_mode=entropylens``; False (logged) when verl's v1 trainer cannot be
    imported here (e.g. TransferQueue missing)."""
    try:
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
        from verl.trainer.ppo.v1.trainer_base import register_trainer as _reg
    except ImportError as e:
        logger.info("entropylens: verl's v1 trainer is not importable (%s); trainer_mode=entropylens unavailable", e)
        return False
    if "entropylens" not in TRAINER_REGISTRY:
        from .trainer import EntropyLensTrainer  # imports verl's v1 trainer: only once it is known to import

        _reg("entropylens")(EntropyLensTrainer)
    return True
