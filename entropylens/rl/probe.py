"""The parameter-space entropy probe: which tokens' gradients move the entropy through the real,
shared parameters and the real optimizer (opt-in, every K steps).

Logit-space attribution (tokens.entropy_effect) treats every position as if it had its own logits.
The probe measures the parameter-shared effect on the update's batch:

    H_bar        = mean over the batch's masked-in positions of the full-vocabulary entropy
    g_part       = d/dtheta sum_{t in part} grad_coef_t * logp_t      (a quadrant's kept gradient;
                   'Q dropped': sum (grad_coef_unclipped - grad_coef)_t logp_t over Q's changed tokens)
    step(g)      = the optimizer's update for gradient g with its state frozen at this step:
                   Adam / AdamW: -lr (1 - beta1) / (1 - beta1^t) * g / (sqrt(v_t / (1 - beta2^t)) + eps)
                   (v_t the second moment after this step, read from the optimizer's state);
                   SGD: -lr (1 - dampening) g (plain: -lr g); both after the update's grad clipping c
    predicted_dH = grad(H_bar) . step(c g_part)
    measured     = H_bar after the real optimizer step minus before, on the same positions.

The real step decomposes exactly as sum_parts step(c g_part) + momentum + other (Adam's update is
linear in g once its preconditioner is fixed): 'momentum' is the optimizer's history
(-lr beta1 m_{t-1} / ((1 - beta1^t)(sqrt(v_hat) + eps))), 'other' what the parts do not explain
(entropy bonus, KL through the reference, weight decay). The 'step' row holds grad(H_bar) . (theta_after -
theta_before) and the measured change.

Cost (the probed update against a plain one): one forward with the entropy graph, one backward for
grad(H_bar), one backward per non-empty part (at most 8 quadrant parts + ZA), the real backward and
step, and one no-grad forward after the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..schema import QUADRANT_NAMES


@dataclass
class ProbeForward:
    """What ``loss_fn(model, batch)`` returns: the update's loss and the tensors the probe differentiates.
    logprobs / entropy [B, T] carry the graph to the parameters (entropy: logprobs_and_entropy(...,
    entropy_grad=True)); columns: a policy_loss output's columns (grad_coef, quadrant, and for the
    dropped parts grad_coef_unclipped, grad_changed)."""

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    columns: dict


def _mean_entropy(f: ProbeForward) -> torch.Tensor:
    m = f.mask.bool()
    return torch.where(m, f.entropy.float(), torch.zeros_like(f.entropy, dtype=torch.float32)).sum() / m.sum().clamp(
        min=1
    )


def _dot(a: Sequence[torch.Tensor | None], b: Sequence[torch.Tensor | None]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b) if x is not None and y is not None))


def _norm(a: Sequence[torch.Tensor | None]) -> float:
    return float(sum((x.double() ** 2).sum() for x in a if x is not None)) ** 0.5


class _Direction:
    """The optimizer's linear map g -> step(g) for this step, and its momentum part, from its state
    after the real step (so the preconditioner is exactly the one the step used)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], first: list[bool]):
        self.kind = type(optimizer).__name__
        self.scale: list[torch.Tensor | float] = []  # step(g) = scale * g, per parameter
        self.momentum: list[torch.Tensor | None] = []
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for p, was_first in zip(params, first):
            g = group_of[id(p)]
            st = optimizer.state.get(p, {})
            if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
                if g.get("maximize"):
                    raise ValueError("probe: Adam with maximize=True is not supported")
                b1, b2 = g["betas"]
                t = float(st["step"])
                bc1, bc2 = 1 - b1**t, 1 - b2**t
                v = st["max_exp_avg_sq"] if g.get("amsgrad") else st["exp_avg_sq"]
                precond = 1.0 / ((v.sqrt() / bc2**0.5) + g["eps"])  # elementwise
                self.scale.append(-g["lr"] * (1 - b1) / bc1 * precond)
                g_used = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                self.momentum.append(-g["lr"] / bc1 * precond * (st["exp_avg"] - (1 - b1) * g_used))
            elif isinstance(optimizer, torch.optim.SGD):
                if g.get("nesterov") or g.get("maximize"):
                    raise ValueError("probe: SGD with nesterov or maximize is not supported")
                mu, damp = g.get("momentum", 0.0), g.get("dampening", 0.0)
                if mu and not was_first:
                    self.scale.append(-g["lr"] * (1 - damp))
                    g_used = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
                    self.momentum.append(-g["lr"] * (st["momentum_buffer"] - (1 - damp) * g_used))
                else:
                    self.scale.append(-g["lr"])
                    self.momentum.append(None)
            else:
                raise ValueError(f"probe: optimizer {self.kind} is not supported (Adam, AdamW or SGD)")

    def step(self, grads: Sequence[torch.Tensor | None], c: float) -> list[torch.Tensor | None]:
        return [None if x is None else s * (c * x) for s, x in zip(self.scale, grads)]


def probe_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.nn.Module, object], ProbeForward],
    batch,
    *,
    max_grad_norm: float | None = None,
) -> list[dict]:
    """Run ONE real update on ``batch`` (forward, backward, optional grad-norm clipping, optimizer step)
    and measure its entropy effect per gradient part (module docstring). Returns one dict per part:
    part, tokens, grad_norm, predicted_dh, measured_dh (the 'step' row only), entropy_before,
    optimizer, lr; the 'step' row also carries grad_norm_before_clip. The caller does not step the
    optimizer again for this batch."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params:
        raise ValueError("probe: the optimizer holds no parameters that require grad")
    optimizer.zero_grad(set_to_none=True)
    fwd = loss_fn(model, batch)
    if not (fwd.logprobs.requires_grad and fwd.entropy.requires_grad):
        raise ValueError(
            "probe: loss_fn must return logprobs and entropy with grad (logprobs_and_entropy(..., entropy_grad=True))"
        )
    m = fwd.mask.bool()
    h_bar = _mean_entropy(fwd)
    grad_h = list(torch.autograd.grad(h_bar, params, retain_graph=True, allow_unused=True))

    cols = fwd.columns
    quad = cols["quadrant"]
    coef = cols["grad_coef"].detach().float()
    parts: list[tuple[str, torch.Tensor]] = []
    for code, name in QUADRANT_NAMES.items():
        parts.append((name, torch.where(m & (quad == code), coef, 0.0)))
    if "grad_coef_unclipped" in cols and "grad_changed" in cols:
        lost = cols["grad_coef_unclipped"].detach().float() - coef
        for code, name in QUADRANT_NAMES.items():
            parts.append((f"{name} dropped", torch.where(m & cols["grad_changed"] & (quad == code), lost, 0.0)))
    grads: dict[str, tuple[int, list[torch.Tensor | None]]] = {}
    for name, c in parts:
        n_tok = int(((c != 0) & m).sum())
        if n_tok == 0:
            continue
        part_grads = torch.autograd.grad((c * fwd.logprobs.float()).sum(), params, retain_graph=True, allow_unused=True)
        grads[name] = (n_tok, list(part_grads))

    # the real update
    fwd.loss.backward()
    clip = 1.0
    total = _norm([p.grad for p in params])  # before clipping (what a trainer logs as grad_norm)
    if max_grad_norm is not None:
        total = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
        clip = min(1.0, max_grad_norm / (total + 1e-6))  # the factor clip_grad_norm_ applied
    first = [not optimizer.state.get(p) for p in params]
    before = [p.detach().clone() for p in params]
    optimizer.step()
    direction = _Direction(optimizer, params, first)
    actual = [p.detach() - b for p, b in zip(params, before)]
    with torch.no_grad():
        h_after = float(_mean_entropy(loss_fn(model, batch)))
    h0 = float(h_bar.detach())
    lr = float(optimizer.param_groups[0]["lr"])
    base = {"entropy_before": h0, "optimizer": direction.kind, "lr": lr, "measured_dh": None}
    rows = []
    explained = 0.0
    for name, (n_tok, g) in grads.items():
        pred = _dot(grad_h, direction.step(g, clip))
        if not name.endswith("dropped"):
            explained += pred
        rows.append({**base, "part": name, "tokens": n_tok, "grad_norm": clip * _norm(g), "predicted_dh": pred})
    mom = _dot(grad_h, direction.momentum)
    step_pred = _dot(grad_h, actual)
    rows.append({**base, "part": "momentum", "tokens": 0, "grad_norm": None, "predicted_dh": mom})
    rows.append({**base, "part": "other", "tokens": 0, "grad_norm": None, "predicted_dh": step_pred - explained - mom})
    rows.append(
        {
            **base,
            "part": "step",
            "tokens": int(m.sum()),
            "grad_norm": _norm([p.grad for p in params]),
            "predicted_dh": step_pred,
            "measured_dh": h_after - h0,
            "grad_norm_before_clip": total,
        }
    )
    return rows


__all__ = ["ProbeForward", "probe_update"]
