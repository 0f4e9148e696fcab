"""One loss-level hook: record a policy update where any trainer computes its policy loss.

Most RL trainers compute the log-probs in their own model wrapper and then call a policy-loss
function of one shape, ``(log_probs, old_log_probs, advantages, mask[, rollout_log_probs]) -> loss``.
:class:`LossHook` takes those tensors by the trainer's own names (``names``: trainer name -> role, or a
preset of :data:`NAMES`) and records what is knowable at that level::

    hook = LossHook(rec, names="areal", eps_low=0.2, eps_high=0.2)      # once
    loss_fn = hook.wrap(ppo_actor_loss_fn)                               # the trainer's own loss
    loss, stats = loss_fn(logprobs=lp, proximal_logprobs=prox, ..., step=s, update=u)

or beside the call: ``hook.watch(step, update, **the_loss_kwargs)`` just before it. The log-probs must be
the very tensor the loss uses (the gradient hook sits on it); packed 1-D tensors [N] are one row [1, N].

What it records per token: prob, advantage (sign), quadrant, ratio r = exp(logp - logp_old), clip
region / clipped (from the trainer's eps_low / eps_high / dual_clip, or the ``clip_mask`` its loss
returns), ``grad_coef`` = d loss / d logp_t from a tensor hook on the log-probs (the trainer's OWN
gradient, whatever its loss is; the hook returns None, so the gradient is unchanged), entropy and
entropy_ratio when handed ``entropy`` (and ``old_entropy``), logit_grad_norm when handed
``sum_pi_squared`` (closed form |g| / T * sqrt(1 - 2 p + sum_j p_j^2)) or the ``logits`` (a logit hook).
Anything else is NULL. The update is recorded when the backward reaches the log-probs (or, without a
backward, at the next call / :meth:`LossHook.flush`, with grad_coef NULL).

A recording failure never stops the trainer with ``on_error="warn"`` (the default): one warning, and
recording stops; only the recorder's ``stop_on`` (read by the loop) stops a run. An update whose inputs
hold NaN or Inf at masked-in positions is the exception: that update alone is not recorded (the first one
warns; :attr:`LossHook.skipped` lists them all) and recording goes on.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

import torch

from ..record.training.inputs import NonFiniteInput
from ..rl.stats import clip_region, clipped_mask, logit_grad_norm_from_sum_p2
from .trl_loss import LossColumns

ROLES = (
    "logprobs",
    "old_logprobs",
    "advantages",
    "mask",
    "sampler_logprobs",
    "entropy",
    "old_entropy",
    "sum_pi_squared",
    "logits",
    "clip_mask",
    "clip_ratio",
    "tokens",
    "seq_ids",
    "group_ids",
)
REQUIRED = ("logprobs", "old_logprobs", "advantages", "mask")
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)

# trainer name -> role, per trainer (their loss functions' argument names)
NAMES: dict[str, dict[str, str]] = {
    "openrlhf": {
        "log_probs": "logprobs",
        "old_log_probs": "old_logprobs",
        "advantages": "advantages",
        "action_mask": "mask",
        "rollout_log_probs": "sampler_logprobs",
    },
    # AReaL's decoupled PPO: the clip is against the proximal policy; old_logprobs are the sampler's
    "areal": {
        "logprobs": "logprobs",
        "proximal_logprobs": "old_logprobs",
        "old_logprobs": "sampler_logprobs",
        "advantages": "advantages",
        "loss_mask": "mask",
    },
    "skyrl": {
        "log_probs": "logprobs",
        "old_log_probs": "old_logprobs",
        "advantages": "advantages",
        "loss_mask": "mask",
        "rollout_logprobs": "sampler_logprobs",
    },
    "slime": {
        "log_probs": "logprobs",
        "old_log_probs": "old_logprobs",
        "advantages": "advantages",
        "loss_mask": "mask",
        "rollout_log_probs": "sampler_logprobs",
    },
}


def resolve_names(names) -> dict[str, str]:
    """``names`` (a preset of :data:`NAMES`, a dict trainer name -> role, or None: the role names
    themselves) -> trainer name -> role. Roles are checked against :data:`ROLES`."""
    if names is None:
        return {r: r for r in ROLES}
    if isinstance(names, str):
        if names not in NAMES:
            raise ValueError(f"names={names!r}: presets are {', '.join(NAMES)} (or pass a dict trainer name -> role)")
        names = NAMES[names]
    out = {r: r for r in ROLES if r not in set(names.values())}  # a role not renamed keeps its own name
    for theirs, role in dict(names).items():
        if role not in ROLES:
            raise ValueError(f"names: {theirs!r} -> {role!r}: a role must be one of {', '.join(ROLES)}")
        out[theirs] = role
    return out


def bind(names: dict[str, str], given: dict) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors ``given`` by the trainer's names -> (role -> tensor, role -> the trainer's name).
    A required role missing (or None) is an error naming the trainer's name for it."""
    tensors, theirs = {}, {}
    for name, value in given.items():
        role = names.get(name)
        if role is not None and value is not None:
            tensors[role], theirs[role] = value, name
    for role in REQUIRED:
        if role not in tensors:
            name = next((n for n, r in names.items() if r == role), role)
            raise ValueError(f"loss hook: missing required tensor {name!r} (the {role} role)")
    return tensors, theirs


def _label(role: str, theirs: dict[str, str]) -> str:
    name = theirs.get(role, role)
    return f"{name!r}" if name == role else f"{name!r} (the {role} role)"


def validate(t: dict[str, torch.Tensor], theirs: dict[str, str]) -> None:
    """Shapes and dtypes of the bound tensors: [B, T] like the mask (advantages [B] or [B, T], seq_ids /
    group_ids [B], logits [B, T, V]; advantages [B, 1] too); the mask bool, integer or floating; log-probs floating. One-line
    errors naming the trainer's argument. Values (NaN) are the recorder's check (it names the role)."""
    m = t["mask"]
    if not isinstance(m, torch.Tensor) or m.dim() != 2:
        raise ValueError(
            f"loss hook: {_label('mask', theirs)} must be a [B, T] tensor, got "
            f"{tuple(getattr(m, 'shape', ())) or type(m).__name__}"
        )
    if not (m.dtype == torch.bool or m.dtype.is_floating_point or m.dtype in _INT_DTYPES):
        raise ValueError(f"loss hook: {_label('mask', theirs)} must be bool, integer or float 0/1, got {m.dtype}")
    shape = tuple(m.shape)
    for role, x in t.items():
        if role == "mask" or role in ("seq_ids", "group_ids"):
            continue
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"loss hook: {_label(role, theirs)} must be a tensor, got {type(x).__name__}")
        want = shape + (x.shape[-1],) if role == "logits" and x.dim() == 3 else shape
        ok = tuple(x.shape) == want or (role == "advantages" and tuple(x.shape) in (shape[:1], (shape[0], 1)))
        if not ok:
            raise ValueError(
                f"loss hook: {_label(role, theirs)} has shape {tuple(x.shape)}, the mask "
                f"{_label('mask', theirs)} {shape}"
            )
        if (
            role
            in (
                "logprobs",
                "old_logprobs",
                "sampler_logprobs",
                "entropy",
                "old_entropy",
                "advantages",
                "sum_pi_squared",
                "logits",
                "clip_ratio",
            )
            and not x.dtype.is_floating_point
        ):
            raise ValueError(f"loss hook: {_label(role, theirs)} must be floating, got {x.dtype}")
    if m.dtype.is_floating_point and m.device.type == "cpu" and not ((m == 0) | (m == 1)).all():
        raise ValueError(f"loss hook: {_label('mask', theirs)} must hold only 0 and 1")
    for role in ("seq_ids", "group_ids"):
        if role in t and tuple(t[role].shape) != shape[:1]:
            raise ValueError(f"loss hook: {_label(role, theirs)} has shape {tuple(t[role].shape)}, want {shape[:1]}")


def clip_columns(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float | None,
    eps_high: float | None,
    dual_clip: float | None = None,
    clip_mask: torch.Tensor | None = None,
    ratio: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``clip`` (int8 region: -1 r < 1 - eps_low, +1 r > 1 + eps_high) and ``clipped`` (bool: PPO-clip
    removed the token's gradient: region -1 and A < 0, or +1 and A > 0), with ``dual_clip`` c also
    ``dual_clipped`` (A < 0 and r > c: tokens PPO-clip did not clip, as the schema keeps the two apart),
    r = exp(logp - logp_old) per token [B, T]. With the loss's own
    ``clip_mask`` [B, T] (True: clipped), clipped = clip_mask and its side is sign(r - 1). eps None and no
    clip_mask: {} (the columns stay NULL). ``ratio`` [B, T]: the ratio the loss clips where it is not the
    token's (GSPO's sequence ratio, broadcast); the ratio column itself stays the token's."""
    m = mask.bool()
    a = advantages.detach().float()
    a = a.unsqueeze(1).expand(m.shape) if a.dim() == 1 else a
    r = (
        torch.exp(logprobs.detach().float() - old_logprobs.detach().float())
        if ratio is None
        else ratio.detach().float()
    )  # [B, T]
    out: dict[str, torch.Tensor] = {}
    if clip_mask is not None:
        c = clip_mask.detach().bool() & m
        side = torch.where(r > 1.0, 1, -1).to(torch.int8)
        region = (
            clip_region(r, eps_low, eps_high)
            if eps_low is not None and eps_high is not None
            else torch.zeros(m.shape, dtype=torch.int8, device=m.device)
        )
        out["clip"] = torch.where(c, side, region)
        out["clipped"] = c
        return out
    if eps_low is None or eps_high is None:
        return out
    region = clip_region(r, eps_low, eps_high)
    clipped = clipped_mask(region, a)
    if dual_clip is not None:
        out["dual_clipped"] = (a < 0) & (r > dual_clip) & m  # disjoint from clipped: A < 0 is clipped only below 1
    out["clip"], out["clipped"] = region, clipped & m
    return out


class LossHook:
    """Records one policy update per call of the trainer's policy loss (module docstring). ``names``:
    a preset of :data:`NAMES` or trainer name -> role; ``eps_low`` / ``eps_high`` / ``dual_clip``: the
    trainer's own clip settings (None: clip columns from the loss's ``clip_mask`` only, else NULL);
    ``temperature``: the sampling temperature the log-probs were computed at."""

    def __init__(
        self,
        recorder,
        *,
        names=None,
        eps_low: float | None = None,
        eps_high: float | None = None,
        dual_clip: float | None = None,
        temperature: float = 1.0,
        on_error: str = "warn",
        config: dict | None = None,
    ):
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        self.recorder, self.names = recorder, resolve_names(names)
        self.eps_low, self.eps_high, self.dual_clip = eps_low, eps_high, dual_clip
        self.temperature, self.on_error = float(temperature), on_error
        self.config = dict(config or {})
        self.failed: str | None = None  # the first recording error (on_error="warn"), then recording stops
        # updates not recorded because an input held NaN / Inf (on_error="warn"): (step, update, role)
        self.skipped: list[tuple[int, int, str]] = []
        self._pending: dict | None = None
        self._sampler_arg = (
            recorder is not None and "sampler_logprobs" in inspect.signature(recorder.record_update).parameters
        )

    # -- the trainer-facing calls -------------------------------------------------------------------
    def wrap(self, loss_fn):
        """``loss_fn`` with the hook beside it: the wrapper takes ``step=`` and ``update=`` (keyword only)
        besides the loss function's own arguments, binds them by name (positional ones too) and returns
        exactly what ``loss_fn`` returns. Keyword tensors ``loss_fn`` does not take (``entropy=``, ``logits=``,
        ``seq_ids=``, ...) are the hook's alone: loss_fn never sees them. The loss's ``clip_mask`` (a dict output's key) is used when given."""
        sig = inspect.signature(loss_fn)
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())

        @functools.wraps(loss_fn)
        def wrapped(*args, step: int, update: int, **kwargs):
            # tensors only the hook reads (entropy, logits, tokens, seq_ids, ... that loss_fn does not take)
            # go to the hook, not to loss_fn
            own = kwargs if takes_any else {k: v for k, v in kwargs.items() if k in sig.parameters}
            try:
                given = {**kwargs, **sig.bind_partial(*args, **own).arguments}
            except TypeError:
                given = dict(kwargs)
            self.watch(step, update, **given)
            result = loss_fn(*args, **own)
            self._take_clip_mask(result)
            return result

        return wrapped

    def _take_clip_mask(self, result) -> None:
        """The loss's own ``clip_mask`` [B, T] (a key of a dict it returns, alone or in a tuple: AReaL's
        stats) for the pending update, when the caller handed none."""
        pending = self._pending
        if pending is None or "clip_mask" in pending["t"]:
            return
        for part in (result, *(result if isinstance(result, tuple) else ())):
            cm = part.get("clip_mask") if isinstance(part, dict) else None
            if isinstance(cm, torch.Tensor) and tuple(cm.shape) == tuple(pending["t"]["mask"].shape):
                pending["t"]["clip_mask"] = cm.detach()
                return

    def watch(self, step: int, update: int, **tensors) -> None:
        """Hook the update whose loss the trainer computes next from ``tensors`` (the trainer's names).
        Unknown names are ignored. The previous update, if its backward never ran, is recorded now."""
        self.flush()
        if self.recorder is None or self.failed is not None:
            return
        try:
            t, theirs = bind(self.names, tensors)
            target = t["logprobs"]  # the very tensor the loss uses: its gradient hook must sit on it
            if isinstance(target, torch.Tensor) and target.dim() == 1:  # packed [N] (slime): one row [1, N]
                t = {
                    k: (
                        v.unsqueeze(0)
                        if isinstance(v, torch.Tensor) and v.dim() == 1 and k not in ("seq_ids", "group_ids")
                        else v
                    )
                    for k, v in t.items()
                }
            validate(t, theirs)
            self._hook(int(step), int(update), t, theirs, target)
        except Exception as err:  # noqa: BLE001 - a recorder failure must not stop the trainer
            self._fail(err)

    def flush(self) -> None:
        """Record an update whose backward did not run (no grad_coef)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending["handle"].remove() if pending["handle"] is not None else None
            self._record(pending, None)

    # -- inside ---------------------------------------------------------------------------------------
    def _hook(self, step: int, update: int, t: dict, theirs: dict, lp: torch.Tensor) -> None:
        pending: dict[str, Any] = {"step": step, "update": update, "t": t, "theirs": theirs, "handle": None}
        if "logits" in t and t["logits"].requires_grad and torch.is_grad_enabled():
            self.recorder.watch_logits(t["logits"])
        if lp.requires_grad and torch.is_grad_enabled():

            def fire(grad):  # d loss / d logp [B, T]: the trainer's own gradient; None: unchanged
                if self._pending is pending:
                    self._pending = None
                    pending["handle"].remove()
                    self._record(pending, grad.detach().reshape(pending["t"]["mask"].shape))
                return None

            pending["handle"] = lp.register_hook(fire)
            self._pending = pending
        else:
            self._record(pending, None)

    def _record(self, pending: dict, grad: torch.Tensor | None) -> None:
        for _ in range(2):  # a second try when the NaN was an earlier update's, raised at this call
            if self.failed is not None:
                return
            try:
                self._record_update(pending, grad)
                return
            except NonFiniteInput as err:  # that update is dropped; the recorder goes on
                if self.on_error == "raise":
                    self._fail(err, pending["theirs"])
                self._skip(err, pending["theirs"])
                if (err.step, err.update) == (pending["step"], pending["update"]):
                    return
            except Exception as err:  # noqa: BLE001
                self._fail(err, pending["theirs"])
                return

    def _record_update(self, pending: dict, grad: torch.Tensor | None) -> None:
        t = pending["t"]
        lp, old, adv, mask = (t[r].detach() for r in REQUIRED)
        m = mask.bool()
        adv = adv.expand(m.shape) if adv.dim() == 2 else adv  # [B, 1] broadcast as the loss does
        cols = clip_columns(
            lp,
            old,
            adv,
            m,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            dual_clip=self.dual_clip,
            clip_mask=t.get("clip_mask"),
            ratio=t.get("clip_ratio"),
        )
        if grad is not None:
            g = torch.where(m, grad.float(), torch.zeros((), dtype=torch.float32, device=m.device))
            cols["grad_coef"] = g
            if "sum_pi_squared" in t and "logits" not in t:
                cols["logit_grad_norm"] = logit_grad_norm_from_sum_p2(
                    g, lp, t["sum_pi_squared"].detach(), self.temperature
                )
        config = {
            k: v
            for k, v in (("eps_low", self.eps_low), ("eps_high", self.eps_high), ("dual_clip", self.dual_clip))
            if v is not None
        }
        config.update(self.config)
        extra = {}
        if self._sampler_arg and "sampler_logprobs" in t:
            extra["sampler_logprobs"] = t["sampler_logprobs"].detach()  # Recorder(..., sampler_logprobs=) (mmrec)
        ent = t.get("entropy")
        self.recorder.record_update(
            pending["step"],
            pending["update"],
            mask=m,
            advantages=adv,
            logprobs=lp,
            old_logprobs=old,
            entropy=ent.detach() if ent is not None else None,
            old_entropy=t["old_entropy"].detach() if "old_entropy" in t else None,
            tokens=t.get("tokens"),
            seq_ids=t.get("seq_ids"),
            group_ids=t.get("group_ids"),
            loss=LossColumns(cols, None, config),
            temperature=self.temperature,
            **extra,
        )

    @staticmethod
    def _named(err: Exception, theirs: dict | None) -> str:
        """The recorder's message, with the trainer's own name beside the role it starts with."""
        msg = str(err)
        for role, name in (theirs or {}).items():
            if msg.startswith(f"{role} ") and name != role:
                return f"{role} (the trainer's {name!r}) {msg[len(role) + 1 :]}"
        return msg

    def _skip(self, err: NonFiniteInput, theirs: dict | None) -> None:
        """One update with NaN / Inf inputs is not recorded: warn at the first, count all in ``skipped``."""
        self.skipped.append((err.step, err.update, err.name))
        if len(self.skipped) == 1:
            warnings.warn(
                f"entropylens loss hook: {self._named(err, theirs)}: that update is not recorded, recording "
                "goes on (LossHook.skipped lists every update skipped this way)",
                stacklevel=3,
            )

    def _fail(self, err: Exception, theirs: dict | None = None) -> None:
        msg = self._named(err, theirs)
        if self.on_error == "raise":
            raise ValueError(msg) from err
        self.failed = msg
        warnings.warn(f"entropylens loss hook: recording stopped, training goes on: {msg}", stacklevel=3)


__all__ = ["LossHook", "NAMES", "REQUIRED", "ROLES", "bind", "clip_columns", "resolve_names", "validate"]
