"""Recorder: every update's token rows and exact step aggregates, into crash-safe Parquet.

    with Recorder("runs", config={"method": "grpo", "eps_low": 0.2}) as rec:
        for step in ...:
            for update, mb in enumerate(minibatches):
                logits = model(...).logits[...]                      # [B, T, V]
                rec.watch_logits(logits)                             # exact ||dLoss/dz_t|| from backward
                logp, ent = logprobs_and_entropy(logits, mb.tokens)
                out = policy_loss(logp, mb.old_logp, mb.adv, mb.mask, entropy=ent, old_entropy=mb.old_ent)
                rec.record_update(step, update, mask=mb.mask, advantages=mb.adv, logprobs=logp,
                                  old_logprobs=mb.old_logp, entropy=ent, old_entropy=mb.old_ent,
                                  tokens=mb.tokens, loss=out)
                out.loss.backward()
                rec.record_step(step, update=update, grad_norm=clip_grad_norm_(...), lr=lr)

Layout under ROOT/<run>/: run.json (atomic), tokens/step=S/rank=R/update-U.parquet,
sequences/step=S/rank=R/part-K.parquet, steps/step=S/rank=R/steps.parquet. Every file is
written under a hidden ``.*.tmp`` name and renamed into place when complete. One writer thread per
recorder; a bounded queue blocks (never drops) when the disk falls behind. The steps file of a step
is written after all its token files, so a present ``steps`` row implies all its token rows.

Device work per update (tokenbatch.py): columns, exact aggregates, sample, one packed copy to host.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import secrets
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import tokenbatch as tb
from .schema import QUADRANT_NAMES, SCHEMA_VERSION

_STOP = object()


class RecorderError(RuntimeError):
    """The recorder could not do its job (bad input, unwritable root, writer failure)."""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class _Pending:
    """An update whose host copy waits for the backward pass (watch_logits) or the next call."""

    step: int
    update: int
    cols: dict
    mask: torch.Tensor
    ints: dict
    sel: torch.Tensor
    loss_value: torch.Tensor | None
    finite: torch.Tensor  # [n_inputs] bool, checked after the copy
    finite_names: list


class Recorder:
    """Records policy updates of one run (one rank) to ``root/<run>/``. A context manager.

    ``config`` (method, eps_low, eps_high, beta1, ...) goes into run.json; without a ``loss`` object
    the recorder derives ratio / clip region / quadrant with config's eps_low / eps_high (default
    0.2 / eps_low) and ``tau``. ``sample`` in (0, 1] keeps whole sequences by a hash of
    (run, step, seq id); step aggregates always cover all tokens. ``on_error="warn"`` turns a writer
    failure into one warning (recording stops, training goes on, run.json says so).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        run: str | None = None,
        *,
        config: dict | None = None,
        tau: float = 0.5,
        sample: float = 1.0,
        rank: int | None = None,
        world_size: int | None = None,
        queue_size: int = 16,
        on_error: str = "raise",
        heartbeat_s: float = 10.0,
        rows_per_file: int = 262_144,
    ):
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"sample must be in (0, 1], got {sample}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        if not 0.0 < tau <= 1.0:
            raise ValueError(f"tau must be in (0, 1], got {tau}")
        self.config = dict(config or {})
        self.tau, self.sample, self.on_error = float(tau), float(sample), on_error
        self.eps_low = float(self.config.get("eps_low", 0.2) if self.config.get("eps_low") is not None else 0.2)
        eh = self.config.get("eps_high")
        self.eps_high = float(eh) if eh is not None else self.eps_low
        dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = int(rank if rank is not None else (torch.distributed.get_rank() if dist_on else 0))
        self.world_size = int(
            world_size if world_size is not None else (torch.distributed.get_world_size() if dist_on else 1)
        )
        if run is None:
            run = self._default_run_id(dist_on)
        if not run or "/" in run or run.startswith("."):
            raise ValueError(f"run id must be a plain directory name, got {run!r}")
        self.run = run
        self.root = Path(root)
        self.dir = self.root / run
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{self.rank}.tmp"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise RecorderError(f"cannot write the run directory {self.dir}: {e.strerror or e}") from None
        self._salt = tb.run_hash(run)
        self._started = _now()
        self._status = "running"
        self._error: BaseException | None = None
        self._disabled = False
        self._closed = False
        self._heartbeat_s = heartbeat_s
        self._last_beat = 0.0
        self._seen: set[tuple[int, int]] = set()
        self._flushed_upto = -1  # steps <= this were written to the steps table
        self._last_step = -1
        self._step_rows: dict[tuple[int, int], dict[str, Any]] = {}
        self._step_scalars: dict[int, dict[str, Any]] = {}
        self._seq_parts: dict[int, int] = {}
        self._pending: _Pending | None = None
        self._rows_per_file = max(1, int(rows_per_file))
        self._tok_buf: list[tuple[int, dict]] = []  # (update, host arrays) of the current step
        self._tok_step = -1
        self._loss_config: dict | None = None
        self.last_aggregates: dict[str, float] | None = None  # exact aggregates of the last finalised update
        self._lgn: torch.Tensor | None = None
        self._hook = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._write_run_json()
        self._thread = threading.Thread(target=self._writer, name=f"entropylens-writer-{run}", daemon=True)
        self._thread.start()
        atexit.register(self._atexit)

    # ------------------------------------------------------------------ identity
    def _default_run_id(self, dist_on: bool) -> str:
        method = str(self.config.get("method", "run"))
        rid = f"{method}-{datetime.now().strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
        if dist_on and self.world_size > 1:  # one-time agreement on the id; never per step
            box = [rid]
            torch.distributed.broadcast_object_list(box, src=0)
            rid = box[0]
        return rid

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb_) -> None:
        self.close(status="failed" if exc_type is not None else "finished", _raise=exc_type is None)

    # ------------------------------------------------------------------ public API
    def watch_logits(self, logits: torch.Tensor, tokens: torch.Tensor | None = None) -> None:
        """Hook ``logits`` [B, T, V] so that its backward computes ||dLoss/dz_t||_2 per token (a
        float32 reduction over V on the device) for the next recorded update. The hook removes
        itself after firing; an unfired hook is removed when the update is finalised."""
        self._check_alive()
        self._finalize_pending()  # the previous update's backward is done: its hook has fired
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(f"watch_logits: logits must be [B, T, V], got {getattr(logits, 'shape', type(logits))}")
        if not logits.requires_grad:
            raise ValueError("watch_logits: logits do not require grad (call it on the training forward pass)")
        if tokens is not None and tuple(tokens.shape) != tuple(logits.shape[:2]):
            raise ValueError(f"watch_logits: tokens shape {tuple(tokens.shape)} != logits [B, T] {tuple(logits.shape[:2])}")
        self._remove_hook()
        self._lgn = None
        self._watch_shape = tuple(logits.shape[:2])

        def hook(grad: torch.Tensor) -> None:
            self._lgn = torch.linalg.vector_norm(grad, dim=-1, dtype=torch.float32).detach()  # [B, T]
            self._remove_hook()

        self._hook = logits.register_hook(hook)

    def record_update(
        self,
        step: int,
        update: int,
        *,
        mask: torch.Tensor,
        advantages: torch.Tensor,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        entropy: torch.Tensor | None = None,
        old_entropy: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        seq_ids: torch.Tensor | None = None,
        group_ids: torch.Tensor | None = None,
        loss: Any = None,
    ) -> None:
        """One policy update (a mini-batch). Tensors are [B, T] (advantages [B] or [B, T]; seq_ids,
        group_ids [B]). Only masked-in tokens become rows. ``loss``: a ``policy_loss`` output whose
        columns are stored as they are."""
        self._check_alive()
        step, update = int(step), int(update)
        self._finalize_pending()
        self._validate_update(step, update, mask, advantages, logprobs, old_logprobs, entropy, old_entropy,
                              tokens, seq_ids, group_ids)
        if self._disabled:
            return
        self._advance_to(step)
        self._seen.add((step, update))
        m = mask.bool()
        b, t = m.shape
        dev = m.device
        cfg = getattr(loss, "config", {}) or {}
        if cfg and self._loss_config is None:  # the resolved eps / method, once, into run.json
            self._loss_config = dict(cfg)
            self._put(("heartbeat", 0, 0, None))
        cols = tb.derive_columns(
            mask=m, advantages=advantages, logprobs=logprobs, old_logprobs=old_logprobs, entropy=entropy,
            old_entropy=old_entropy, loss_columns=getattr(loss, "columns", None),
            eps_low=cfg.get("eps_low", self.eps_low), eps_high=cfg.get("eps_high", self.eps_high),
            tau=cfg.get("tau", self.tau),
        )
        seq = (seq_ids.to(dev).long() if seq_ids is not None else torch.arange(b, device=dev))  # [B]
        grp = (group_ids.to(dev).long() if group_ids is not None else torch.full((b,), -1, device=dev))
        ints = {
            "seq": seq.unsqueeze(1).expand(b, t),
            "group": grp.unsqueeze(1).expand(b, t),
            "pos": torch.arange(t, device=dev).unsqueeze(0).expand(b, t),
            "token_id": tokens.to(dev) if tokens is not None else torch.full((b, t), -1, device=dev),
        }
        keep_seq = tb.sample_keep(seq, step, self._salt, self.sample)  # [B]
        sel = m & keep_seq.unsqueeze(1)
        finite_inputs = {"logprobs": logprobs, "old_logprobs": old_logprobs, "advantages": cols["advantage"]}
        if entropy is not None:
            finite_inputs["entropy"] = entropy
        if old_entropy is not None:
            finite_inputs["old_entropy"] = old_entropy
        stacked = torch.stack([x.detach().float().reshape(m.shape) for x in finite_inputs.values()])  # [k, B, T]
        finite = (torch.isfinite(stacked) | ~m).flatten(1).all(dim=1)  # [k]
        loss_value = getattr(loss, "loss", None)
        self._pending = _Pending(step, update, cols, m, ints, sel, loss_value, finite, list(finite_inputs))
        if self._hook is None and self._lgn is None:
            self._finalize_pending()  # nothing to wait for

    def record_step(self, step: int, *, update: int | None = None, grad_norm=None, lr=None, **metrics) -> None:
        """Scalars of a step (update=None: the whole step, e.g. reward mean) or of one update
        (its own optimizer step: grad norm before clipping, lr). Values may be tensors."""
        self._check_alive()
        step = int(step)
        self._finalize_pending()
        if step <= self._flushed_upto:
            raise ValueError(f"step {step} was already written; record_step must come before later steps")
        self._advance_to(step)
        vals = {"grad_norm": grad_norm, "lr": lr, **metrics}
        vals = {k: _scalar(v) for k, v in vals.items() if v is not None}
        for k in vals:
            if not k.replace("_", "").replace("/", "").replace(".", "").replace("-", "").isalnum():
                raise ValueError(f"metric name {k!r}: use letters, digits, '_', '/', '.', '-'")
        vals = {k.replace("/", "_").replace(".", "_").replace("-", "_"): v for k, v in vals.items()}
        if update is None:
            self._step_scalars.setdefault(step, {}).update(vals)
        else:
            self._step_rows.setdefault((step, int(update)), {}).update(vals)

    def record_sequences(self, step: int, *, seq_ids, rewards, advantages, lengths, group_ids=None, texts=None) -> None:
        """One row per sequence: reward, advantage, response length (all [B]); optional group ids and texts."""
        self._check_alive()
        step = int(step)
        self._finalize_pending()
        if step <= self._flushed_upto:
            raise ValueError(f"step {step} was already written; record_sequences must come before later steps")
        self._advance_to(step)
        arrs = {
            "seq": _host(seq_ids, np.int32),
            "reward": _host(rewards, np.float32),
            "advantage": _host(advantages, np.float32),
            "length": _host(lengths, np.int32),
        }
        n = len(arrs["seq"])
        arrs["group"] = _host(group_ids, np.int32) if group_ids is not None else np.full(n, -1, np.int32)
        for k, v in arrs.items():
            if v.ndim != 1 or len(v) != n:
                raise ValueError(f"record_sequences: {k} must be 1-D of length {n}, got shape {v.shape}")
        if not np.isfinite(arrs["reward"]).all():
            raise ValueError("record_sequences: rewards contain NaN or Inf")
        if texts is not None and len(texts) != n:
            raise ValueError(f"record_sequences: texts has {len(texts)} entries for {n} sequences")
        if texts is not None:
            arrs["text"] = list(texts)
        scal = self._step_scalars.setdefault(step, {})
        sums = scal.pop("_reward_sum_n", (0.0, 0))
        total = (sums[0] + float(arrs["reward"].sum()), sums[1] + n)
        scal["_reward_sum_n"] = total
        part = self._seq_parts.get(step, 0)
        self._seq_parts[step] = part + 1
        self._put(("sequences", step, part, arrs))

    def close(self, status: str = "finished", _raise: bool = True) -> None:
        """Flush, wait for the writer, write the final status."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self._disabled and self._error is None:
                try:
                    self._finalize_pending()
                except Exception:
                    status = "failed"
                    raise
                finally:
                    self._flush_steps(upto=None)
        finally:
            self._remove_hook()
            self._queue.put(_STOP)
            self._thread.join()
            if self._error is not None:
                status = "failed"
            self._status = status
            try:
                self._write_run_json()
            except OSError:
                pass
            try:
                atexit.unregister(self._atexit)
            except Exception:
                pass
        if self._error is not None and self.on_error == "raise" and _raise:
            err, self._error = self._error, None
            raise RecorderError(f"the Parquet writer failed: {err}") from err

    def step_summary(self, step: int) -> dict[str, float]:
        """Token-weighted means of the exact aggregates over the updates of ``step`` recorded so far
        (n_* counts summed); empty once the step has been written. For trainer logs."""
        self._finalize_pending()
        rows = [r for (s, _), r in self._step_rows.items() if s == step and "n_tokens" in r]
        n = sum(r["n_tokens"] for r in rows)
        out: dict[str, float] = {"n_tokens": float(n)}
        if not rows or n == 0:
            return out
        for k in tb.AGG_NAMES:
            if k == "n_tokens":
                continue
            if k.startswith("n_"):
                out[k] = float(sum(r[k] for r in rows))
                continue
            vals = [(r[k], r["n_tokens"]) for r in rows if r.get(k) == r.get(k) and r.get(k) is not None]
            w = sum(t for _, t in vals)
            if w:
                out[k] = sum(v * t for v, t in vals) / w
        return out

    @property
    def has_hook(self) -> bool:
        return self._hook is not None

    # ------------------------------------------------------------------ internals
    def _atexit(self) -> None:
        if not self._closed:
            try:
                self.close(status="finished", _raise=False)
            except Exception:
                pass

    def _check_alive(self) -> None:
        if self._closed:
            raise RecorderError(f"recorder for run {self.run!r} is closed")
        err = self._error
        if err is not None and not self._disabled:
            if self.on_error == "warn":
                warnings.warn(f"entropylens: recording stopped, the Parquet writer failed: {err}", stacklevel=3)
                self._disabled = True
                self._status = "failed"
                self._remove_hook()
            else:
                self.close(status="failed", _raise=False)
                raise RecorderError(f"the Parquet writer failed: {err}") from err

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _validate_update(self, step, update, mask, advantages, logprobs, old_logprobs, entropy, old_entropy,
                         tokens, seq_ids, group_ids) -> None:
        if step < 0 or update < 0:
            raise ValueError(f"step and update must be >= 0, got step={step} update={update}")
        if (step, update) in self._seen:
            raise ValueError(f"step {step} update {update} was already recorded")
        if step < self._last_step or step <= self._flushed_upto:
            raise ValueError(f"step {step} comes after step {self._last_step}: steps must not go back")
        if mask.dim() != 2:
            raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
        shape = tuple(mask.shape)
        for name, x in (("logprobs", logprobs), ("old_logprobs", old_logprobs), ("entropy", entropy),
                        ("old_entropy", old_entropy), ("tokens", tokens)):
            if x is not None and tuple(x.shape) != shape:
                raise ValueError(f"{name} shape {tuple(x.shape)} does not match mask shape {shape}")
        if tuple(advantages.shape) not in ((shape[0],), shape):
            raise ValueError(f"advantages must be [B] or [B, T] = {shape}, got {tuple(advantages.shape)}")
        for name, x in (("seq_ids", seq_ids), ("group_ids", group_ids)):
            if x is not None and tuple(x.shape) != (shape[0],):
                raise ValueError(f"{name} must be [B] = ({shape[0]},), got {tuple(x.shape)}")
        if self._hook is not None or self._lgn is not None:
            if self._watch_shape != shape:
                raise ValueError(f"watch_logits was given [B, T] = {self._watch_shape}, the update has {shape}")

    def _advance_to(self, step: int) -> None:
        """A later step closes the earlier ones: their steps rows are written (after their tokens)."""
        if step > self._last_step:
            if self._last_step >= 0:
                self._flush_steps(upto=step - 1)
            self._last_step = step
            self._beat()

    def _finalize_pending(self) -> None:
        p = self._pending
        if p is None:
            return
        self._pending = None
        lgn = self._lgn
        self._lgn = None
        self._remove_hook()
        cols = p.cols
        if lgn is not None:
            cols["logit_grad_norm"] = lgn
        aggs = tb.step_aggregates(cols, p.mask, lgn, p.loss_value)
        packed, fnames, k = tb.pack(cols, p.sel, torch.cat([aggs, p.finite.double()]), p.ints)
        host = packed.cpu().numpy()  # the one device -> host copy of the update
        # aggregates + finite flags ride at the front of the packed block
        n_aggs = len(tb.AGG_NAMES)
        flags = host[2 * n_aggs : 2 * (n_aggs + len(p.finite_names))].view(np.float64)
        for name, ok in zip(p.finite_names, flags):
            if not ok:
                self._seen.discard((p.step, p.update))
                raise ValueError(f"{name} contains NaN or Inf at masked-in positions (step {p.step}, update {p.update})")
        body = np.concatenate([host[: 2 * n_aggs], host[2 * (n_aggs + len(p.finite_names)) :]])
        agg_vals, arrs = tb.unpack(body, fnames, k, "erc_kept" in cols)
        row = self._step_rows.setdefault((p.step, p.update), {})
        self.last_aggregates = dict(zip(tb.AGG_NAMES, agg_vals.tolist()))
        for name, v in self.last_aggregates.items():
            row.setdefault(name, v)
        arrs["update"] = np.full(k, p.update, np.int16)
        self._buffer_tokens(p.step, p.update, arrs)

    def _buffer_tokens(self, step: int, update: int, arrs: dict) -> None:
        """Small updates share a file: rows are buffered until ``rows_per_file`` or the step's end
        (one file per update at scale; a handful of files per step for small batches)."""
        if self._tok_buf and self._tok_step != step:
            self._flush_tokens()
        self._tok_step = step
        self._tok_buf.append((update, arrs))
        if sum(len(a["seq"]) for _, a in self._tok_buf) >= self._rows_per_file:
            self._flush_tokens()

    def _flush_tokens(self) -> None:
        if not self._tok_buf:
            return
        buf, self._tok_buf = self._tok_buf, []
        updates = (buf[0][0], buf[-1][0])
        if len(buf) == 1:
            arrs = buf[0][1]
        else:
            arrs = {k: np.concatenate([a[k] for _, a in buf]) for k in buf[0][1]}
        self._put(("tokens", self._tok_step, updates, arrs))

    def _flush_steps(self, upto: int | None) -> None:
        if self._tok_buf and (upto is None or self._tok_step <= upto):
            self._flush_tokens()  # token files of a step always precede its steps file
        keys = sorted({s for s, _ in self._step_rows} | set(self._step_scalars))
        for s in keys:
            if upto is not None and s > upto:
                continue
            rows = {u: r for (st, u), r in self._step_rows.items() if st == s}
            scal = self._step_scalars.pop(s, {})
            rsn = scal.pop("_reward_sum_n", None)
            if rsn is not None and rsn[1] > 0:
                scal.setdefault("reward_mean", rsn[0] / rsn[1])
            if not rows:
                rows = {0: {}}
            out = []
            for u in sorted(rows):
                r = {"update": u, **{k: v for k, v in scal.items()}, **rows[u]}
                out.append(r)
                self._step_rows.pop((s, u), None)
            self._flushed_upto = max(self._flushed_upto, s)
            self._put(("steps", s, 0, out))

    def _put(self, item) -> None:
        if self._disabled:
            return
        while True:
            try:
                self._queue.put(item, timeout=0.5)  # blocks when full: back-pressure, never a drop
                return
            except queue.Full:
                if self._error is not None or not self._thread.is_alive():
                    self._check_alive()
                    return

    def _beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= self._heartbeat_s:
            self._last_beat = now
            self._put(("heartbeat", 0, 0, None))

    def _run_info(self) -> dict:
        return {
            "run": self.run,
            "method": self.config.get("method") or (self._loss_config or {}).get("method"),
            "config": self.config,
            "model": self.config.get("model"),
            "seed": self.config.get("seed"),
            "schema_version": SCHEMA_VERSION,
            "world_size": self.world_size,
            "started_at": self._started,
            "heartbeat_at": _now(),
            "status": self._status,
            "error": None if self._error is None else str(self._error),
            "loss": self._loss_config,
            "eps_low": (self._loss_config or {}).get("eps_low", self.eps_low),
            "eps_high": (self._loss_config or {}).get("eps_high", self.eps_high),
            "tau": (self._loss_config or {}).get("tau", self.tau),
            "sample": self.sample,
            "quadrants": QUADRANT_NAMES,
        }

    def _write_run_json(self) -> None:
        if self.rank == 0:
            _atomic_write_text(self.dir / "run.json", json.dumps(self._run_info(), indent=2, default=str) + "\n")

    # ------------------------------------------------------------------ writer thread
    def _writer(self) -> None:
        from . import writer as w

        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._error is not None:
                continue  # drain after a failure; the caller sees the error at its next call
            kind, step, part, payload = item
            try:
                if kind == "tokens":
                    w.write_tokens(self.dir, step, self.rank, part, payload)
                elif kind == "sequences":
                    w.write_sequences(self.dir, step, self.rank, part, payload)
                elif kind == "steps":
                    w.write_steps(self.dir, step, self.rank, payload)
                elif kind == "heartbeat":
                    self._write_run_json()
            except BaseException as e:  # surfaced in the caller, never swallowed
                self._error = e


def _scalar(v) -> float:
    if isinstance(v, torch.Tensor):
        return float(v.detach().float().cpu())
    return float(v)


def _host(x, dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(dtype, copy=False)
