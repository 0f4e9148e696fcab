"""The 80/20 forking-token rule (Wang et al. 2025) and the adaptive entropy coefficient (Skywork-OR1), as
TRL 1.16 applies them (its ``top_entropy_quantile`` and ``use_adaptive_entropy`` options): pure tensor
functions and one small stateful controller, shared by the plain loop, TRL and verl.

Forking mask (:func:`top_entropy_mask`), for quantile q in [0, 1] (the share of tokens kept):
  E = the entropies H_t of the valid tokens (m_t = 1) of every process (``all_gather``), as float32;
  thr = torch.quantile(E, 1 - q)   (linear interpolation between order statistics);
  keep_t = m_t and H_t m_t >= thr  (ties at the threshold are kept); no valid token anywhere: none kept.
  q = 1 keeps every token with H_t >= min E (all of them); q = 0 keeps the highest-entropy token(s).

Adaptive coefficient (:class:`AdaptiveEntropyCoef`), with target H*, step delta and clamps [lo, hi]:
  the loss applies   c_applied = c_k if H_{k-1} <= H* else 0   (H_{-1} = inf: off at the first step);
  over an optimizer step's micro-batches (all processes: ``reduce``) it measures the token-weighted mean
  H_k = sum_t e_t H_t / max(sum_t e_t, 1) over the tokens the bonus acts on (e = m, times keep with the
  forking mask), then   c_{k+1} = min(c_k + delta, hi) if H_k <= H* else max(c_k - delta, lo).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Gather = Callable[[torch.Tensor], torch.Tensor]  # [n_local] -> [n_all]: the valid entropies of every process


def gather_valid(local: torch.Tensor, group=None) -> torch.Tensor:
    """The concatenation over the processes of ``group`` (torch.distributed; None: the default group) of each
    one's 1-D ``local`` tensor, whose lengths may differ: [n_local] -> [sum of n]. One all_gather of the
    lengths, one of the padded values. Without an initialised process group: ``local`` itself."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return local
    world = dist.get_world_size(group)
    n = torch.tensor([local.numel()], device=local.device, dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:s] for p, s in zip(parts, lengths)])


def entropy_threshold(valid_entropies: torch.Tensor, quantile: float) -> torch.Tensor | None:
    """thr = torch.quantile(E, 1 - quantile) over the 1-D valid entropies E (float32); None when E is empty."""
    e = valid_entropies.reshape(-1).float()
    if e.numel() == 0:
        return None
    return torch.quantile(e, 1.0 - float(quantile))


def top_entropy_mask(
    entropy: torch.Tensor, mask: torch.Tensor, quantile: float, *, all_gather: Gather | None = None
) -> torch.Tensor:
    """The forking-token mask [B, T] bool: valid tokens whose entropy is at or above the (1 - quantile)
    quantile of the valid tokens' entropies over all processes (module docstring). ``entropy``, ``mask``
    [B, T]; ``all_gather`` maps this process's valid entropies [n] to every process's [N] (e.g.
    :func:`gather_valid`, with verl's data-parallel group); None: this process alone."""
    q = float(quantile)
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"top_entropy_quantile must lie in [0, 1], got {quantile}")
    if tuple(entropy.shape) != tuple(mask.shape):
        raise ValueError(f"entropy shape {tuple(entropy.shape)} does not match mask shape {tuple(mask.shape)}")
    m = mask.bool()
    h = entropy.detach()
    local = h[m].float()  # [n]
    pooled = local if all_gather is None else all_gather(local)
    thr = entropy_threshold(pooled, q)
    if thr is None:
        return torch.zeros(m.shape, dtype=torch.bool, device=m.device)
    return ((h * m.float()) >= thr) & m


def bonus_weights(
    mask: torch.Tensor, keep: torch.Tensor | None, scale: float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """TRL's entropy-bonus weights [B, T] (``dtype``): e_t = scale * m_t k_t / max(sum m k, 1), the mean
    entropy over the tokens the bonus acts on (k = the forking mask, 1 without), never the policy term's
    normaliser."""
    e = mask.to(dtype) if keep is None else mask.to(dtype) * keep.to(dtype)
    return e * (float(scale) / e.sum().clamp(min=1.0))


class AdaptiveEntropyCoef:
    """The adaptive entropy coefficient (module docstring): ``applied`` is what the loss uses now,
    :meth:`observe` takes each micro-batch's entropies, :meth:`step` (once per optimizer step) moves the
    coefficient. ``state_dict`` / ``load_state_dict`` carry it over a resumed run (TRL's
    entropy_ctrl_state.json holds the same two numbers). Defaults are TRL's GRPOConfig defaults."""

    def __init__(
        self,
        target: float = 0.2,
        *,
        coef: float = 0.0,
        delta: float = 0.005,
        coef_min: float = 0.0,
        coef_max: float = 1.0,
    ):
        for name, v in (
            ("target", target),
            ("coef", coef),
            ("delta", delta),
            ("coef_min", coef_min),
            ("coef_max", coef_max),
        ):
            if not math.isfinite(float(v)):
                raise ValueError(f"AdaptiveEntropyCoef {name} must be finite, got {v}")
        if coef_min > coef_max:
            raise ValueError(f"AdaptiveEntropyCoef coef_min {coef_min} > coef_max {coef_max}")
        if delta < 0:
            raise ValueError(f"AdaptiveEntropyCoef delta must be >= 0, got {delta}")
        self.target, self.delta = float(target), float(delta)
        self.coef_min, self.coef_max = float(coef_min), float(coef_max)
        self.coef = float(coef)
        self.last_entropy = float("inf")  # the previous optimizer step's measured entropy
        self._window: torch.Tensor | None = None  # [2]: sum e H, sum e over this step's micro-batches

    @property
    def applied(self) -> float:
        """c_k where the previous step's entropy was at or below the target, else 0."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def observe(self, entropy: torch.Tensor, weights: torch.Tensor) -> None:
        """Adds one micro-batch's sum e H and sum e ([B, T] each; e = the tokens the bonus acts on) to the
        step's window, on the device (no host sync)."""
        e = weights.detach().float()
        part = torch.stack([(entropy.detach().float() * e).sum(), e.sum()])
        self._window = part if self._window is None else self._window + part

    def step(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
        """The optimizer-step boundary: H_k from the window (``reduce`` sums the [2] window over processes,
        e.g. an all_reduce), the coefficient moved by delta within its clamps, the window reset. Returns
        H_k (nan with no window: the coefficient then stays)."""
        if self._window is None:
            return float("nan")
        w = self._window if reduce is None else reduce(self._window)
        self._window = None
        h = float((w[0] / w[1].clamp(min=1.0)).item())
        if h <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = h
        return h

    def settings(self) -> dict[str, float]:
        return {
            "entropy_target": self.target,
            "entropy_coef_delta": self.delta,
            "entropy_coef_min": self.coef_min,
            "entropy_coef_max": self.coef_max,
        }

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["entropy_coef"])
        self.last_entropy = float(state["last_world_entropy"])
        self._window = None

    def __repr__(self) -> str:
        return (
            f"AdaptiveEntropyCoef(target={self.target}, coef={self.coef}, delta={self.delta}, "
            f"coef_min={self.coef_min}, coef_max={self.coef_max})"
        )


def all_reduce_sum(group=None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A ``reduce`` for :meth:`AdaptiveEntropyCoef.step`: the sum over ``group`` (identity without one)."""
    import torch.distributed as dist

    def reduce(t: torch.Tensor) -> torch.Tensor:
        if not (dist.is_available() and dist.is_initialized()):
            return t
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    return reduce


__all__ = [
    "AdaptiveEntropyCoef",
    "all_reduce_sum",
    "bonus_weights",
    "entropy_threshold",
    "gather_valid",
    "top_entropy_mask",
]
