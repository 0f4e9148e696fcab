"""This process's recorders (one per run and worker process, that is per data-parallel rank): opened at
a loss function's first recorded micro-batch, their step ended / committed / closed when the trainer's
shipped loss object is unpickled on the worker, and the step's sequences rows (score, advantage,
length, text) buffered until the step ends.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from .batch import MicroBatch, fit, response_lengths
from .config import eps_from, pl_get
from .names import REWARD_KEYS

logger = logging.getLogger(__name__)

_RECORDERS: dict[tuple[str, str], Any] = {}  # (root, run) -> Recorder, one per process (= one per rank)


def open_recorder(loss, rank: int, world_size: int):
    """This process's Recorder of ``loss``'s run (an :class:`~.loss_fn.EntropyLensLoss` with its run
    agreed), opened at the first call: run.json's config says the method and verl's settings it ran with."""
    key = (str(loss.record_dir), loss.run)
    rec = _RECORDERS.get(key)
    if rec is None:
        from ...record.recorder import Recorder

        rec = Recorder(
            loss.record_dir,
            loss.run,
            config=run_config(loss.config, loss.method, loss.erc),
            tau=loss.tau,
            sample=loss.sample,
            rank=rank,
            world_size=world_size,
            resume=loss.resume,
            tokenizer=loss.tokenizer or None,
        )
        _RECORDERS[key] = rec
    return rec


def run_config(config, method: str, erc) -> dict:
    """run.json's ``config`` of a verl run: the method, its eps, betas, ERC band, dual-clip and verl's
    aggregation, entropy coefficient and epochs (``config``: the actor's ActorConfig)."""
    eps_low, eps_high = eps_from(config, method)
    return {
        "method": method,
        "framework": "verl",
        "eps_low": eps_low,
        "eps_high": eps_high,
        "beta1": pl_get(config, "beta1") if method == "ce_gppo" else None,
        "beta2": pl_get(config, "beta2") if method == "ce_gppo" else None,
        "erc": list(erc) if erc else None,
        "dual_clip": None if method == "cispo" else getattr(config, "clip_ratio_c", 3.0),
        "loss_agg_mode": getattr(config, "loss_agg_mode", None),
        "entropy_coeff": getattr(config, "entropy_coeff", None),
        "ppo_epochs": getattr(config, "ppo_epochs", None),
    }


def close_recorders(status: str = "finished") -> None:
    """Close this process's recorders (flushes the last step's steps file)."""
    while _RECORDERS:
        key, rec = _RECORDERS.popitem()
        try:
            flush_sequences(key, rec)
        finally:
            rec.close(status=status, _raise=False)


def end_step_recorders() -> None:
    """End the step in this process's recorders (:meth:`Recorder.end_step`): their files are written
    now, in the background, not when the next step's first update arrives."""
    for key, rec in _RECORDERS.items():
        flush_sequences(key, rec)
        rec.end_step()


def commit_recorders() -> None:
    """Commit this process's recorders (:meth:`Recorder.commit`): every step they recorded is in whole
    files on disk when this returns, so a job killed later has lost none of them."""
    for key, rec in _RECORDERS.items():
        flush_sequences(key, rec)
        rec.commit()


# ----------------------------------------------------------------------------------- sequences rows
@dataclass
class _StepSequences:
    """A step's sequences rows on this worker, not yet handed to its recorder."""

    step: int
    seen: set = field(default_factory=set)  # sample ids with a row
    parts: list = field(default_factory=list)  # per micro-batch: record_sequences' arguments


_SEQUENCES: dict[tuple[str, str], _StepSequences] = {}  # (root, run) -> the step's rows, per process


def flush_sequences(key, rec) -> None:
    """Hand the buffered step's sequences rows to ``rec`` (one record_sequences call, before the step closes)."""
    pending = _SEQUENCES.pop(key, None)
    if pending is None or not pending.parts:
        return
    parts = pending.parts
    texts = None if any(p["texts"] is None for p in parts) else [t for p in parts for t in p["texts"]]
    rec.record_sequences(
        pending.step,
        **{k: torch.cat([p[k] for p in parts]) for k in ("seq_ids", "rewards", "advantages", "lengths")},
        texts=texts,
    )


def flush_earlier_sequences(key, rec, step: int) -> None:
    """Flush the rows buffered for a step before ``step`` (before an update of ``step`` closes that step)."""
    if key in _SEQUENCES and _SEQUENCES[key].step != step:
        flush_sequences(key, rec)


def add_sequences(
    key, step: int, b: MicroBatch, sid: torch.Tensor, responses: torch.Tensor, *, tokenizer: str | None, warned: set
) -> None:
    """Buffer the sequences rows of micro-batch ``b``'s samples not yet seen in ``step`` (one sequences file
    per step and rank, :func:`flush_sequences`): the score summed over the response, the advantage's mean
    over its tokens, the response's length and text. Without a score in the batch: none (said once, ``warned``)."""
    score_key = next((k for k in REWARD_KEYS if k in b.keys), None)
    if score_key is None:
        if "no_score" not in warned:
            warned.add("no_score")
            logger.info("entropylens: no score (%s) in the actor's batch: no sequences rows", ", ".join(REWARD_KEYS))
        return
    pending = _SEQUENCES.setdefault(key, _StepSequences(step))
    mask, adv = b.mask, b.advantages
    n_tok = mask.sum(dim=1)  # [B]
    ids = sid.tolist()
    new = [i for i, (s, n) in enumerate(zip(ids, n_tok.tolist())) if n > 0 and s not in pending.seen]
    if not new:
        return
    pending.seen.update(ids[i] for i in new)
    pick = torch.tensor(new, device=mask.device)
    lengths = response_lengths(b.data, responses.shape[0], b.width)[pick.cpu()]  # [b]
    score = fit(b.td[score_key], b.width).index_select(0, pick).double().sum(dim=1)  # [b]
    adv_seq = (adv.index_select(0, pick).double() * mask.index_select(0, pick)).sum(dim=1) / n_tok[pick]  # [b]
    texts = _response_texts(tokenizer, responses.index_select(0, pick).cpu(), lengths)
    pending.parts.append(
        {
            "seq_ids": sid.index_select(0, pick).cpu(),
            "rewards": score.cpu(),
            "advantages": adv_seq.cpu(),
            "lengths": lengths,
            "texts": texts,
        }
    )


_TOKENIZERS: dict[str, Any] = {}  # tokenizer name -> the tokenizer (None: it could not be loaded), per worker


def _response_texts(name: str | None, responses: torch.Tensor, lengths: torch.Tensor) -> list[str] | None:
    """Each response's text ([B, T] ids, each cut to its length), special tokens skipped as verl logs them;
    None without a tokenizer. The tokenizer is loaded once per worker process (local files only); one that
    cannot be loaded warns once and leaves the texts out."""
    if not name:
        return None
    if name not in _TOKENIZERS:
        from ...token_text import TokenTextWarning, load_tokenizer

        try:
            _TOKENIZERS[name] = load_tokenizer(name)
        except Exception as e:  # noqa: BLE001 - texts are optional: say why, record the rest
            _TOKENIZERS[name] = None
            warnings.warn(
                f"entropylens: tokenizer {name} could not be loaded on this worker ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); sequences are recorded without texts",
                TokenTextWarning,
                stacklevel=2,
            )
    tok = _TOKENIZERS[name]
    if tok is None:
        return None
    rows = [r[: int(n)].tolist() for r, n in zip(responses, lengths)]
    return list(tok.batch_decode(rows, skip_special_tokens=True))
