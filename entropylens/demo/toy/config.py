"""One frozen config for a toy run, the named regimes, and the named runs (toy/methods.py's registry)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ...rl.losses import AGGS, METHODS
from . import methods as _methods

# policy_loss arguments a ToyConfig field (or the training loop) already sets: not a loss option
_SET_BY_CONFIG = (
    "logprobs",
    "old_logprobs",
    "advantages",
    "mask",
    "method",
    "eps_low",
    "eps_high",
    "beta1",
    "beta2",
    "dual_clip",
    "entropy",
    "old_entropy",
    "erc",
    "agg",
    "entropy_coef",
    "tau",
    "generator",
)


@dataclass(frozen=True)
class ToyConfig:
    # model: a Qwen2-style causal LM built from a config (no download)
    hidden: int = 64  # width
    layers: int = 2  # transformer blocks
    heads: int = 4  # attention heads (2 key/value heads)
    # warm start: supervised steps on noisy targets, so the policy starts uncertain
    sft_steps: int = 150
    sft_lr: float = 3e-3
    # RL
    steps: int = 120  # rollout steps
    prompts: int = 16  # prompts per step
    group: int = 8  # responses per prompt (G)
    minibatches: int = 4  # mini-batches per epoch
    epochs: int = 2  # passes over the rollout batch (updates per step = minibatches x epochs)
    lr: float = 7e-4  # Adam learning rate of the RL phase
    grad_clip: float = 1.0  # global grad-norm clip (the norm before clipping is recorded)
    temperature: float = 1.0  # sampling temperature
    mismatch: str = ""  # a sampler that differs from the trainer (sampler.py): '', 'bf16' or 'temp:S'
    tis: float = 0.0  # TIS: the policy term times min(pi_old / pi_sampler, tis); 0: no IS correction
    # loss
    method: str = "grpo"
    eps_low: float | None = None  # None: the method's default (0.2; dapo 0.2/0.28; gspo 3e-4/4e-4)
    eps_high: float | None = None
    beta1: float = 0.5  # CE-GPPO low side (r < 1-eps, A < 0)
    beta2: float = 1.0  # CE-GPPO high side (r > 1+eps, A > 0)
    beta1_schedule: tuple[tuple[int, float], ...] = ()  # ((step, beta1), ...): from that step on
    dual_clip: float | None = None
    erc: tuple[float, float] | None = None  # Entropy Ratio Clipping band
    entropy_coef: float = 0.0  # entropy bonus (with entropy_target: the adaptive coefficient's start)
    entropy_target: float | None = None  # adaptive entropy coefficient (rl.forking.AdaptiveEntropyCoef): target H
    entropy_coef_delta: float = 0.005  # its step per optimizer step (TRL's / Skywork-OR1's defaults)
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    top_entropy_quantile: float = 1.0  # the 80/20 forking rule: policy gradient on the top share by entropy
    agg: str | None = None
    tau: float = 0.5  # HP / LP threshold on the sampling probability
    loss_options: tuple[tuple[str, object], ...] = ()  # ((name, value), ...): further policy_loss kwargs
    # recording
    sample: float = 1.0  # token-row keep fraction
    probe_every: int = 0  # parameter-space entropy probe on update 0 of every K-th step (0: off)
    seed: int = 0
    name: str = ""
    regime: str = "fast"  # the named regime (REGIMES) these settings came from

    def validate(self) -> None:
        """Fails before training, with the field that is wrong."""
        if self.regime not in REGIMES:
            raise ValueError(f"regime: unknown {self.regime!r}; valid regimes: {', '.join(REGIMES)}")
        if self.method not in METHODS:
            raise ValueError(f"method: unknown {self.method!r}; valid methods: {', '.join(METHODS)}")
        if self.agg is not None and self.agg not in AGGS:
            raise ValueError(f"agg: unknown {self.agg!r}; valid: {', '.join(AGGS)}")
        for k in ("hidden", "layers", "heads", "steps", "prompts", "group", "minibatches", "epochs"):
            if getattr(self, k) < 1:
                raise ValueError(f"{k} must be >= 1, got {getattr(self, k)}")
        if self.sft_steps < 0:
            raise ValueError(f"sft_steps must be >= 0, got {self.sft_steps}")
        if self.group < 2:
            raise ValueError(f"group must be >= 2 (advantages are normalised within a group), got {self.group}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if (self.prompts * self.group) % self.minibatches:
            raise ValueError(
                f"prompts x group ({self.prompts * self.group}) must split into {self.minibatches} mini-batches"
            )
        if not (self.lr > 0 and self.sft_lr > 0 and self.temperature > 0):
            raise ValueError("lr, sft_lr and temperature must be > 0")
        from .sampler import check_mismatch

        check_mismatch(self.mismatch)
        if not self.tis >= 0:
            raise ValueError(f"tis must be >= 0 (0: no IS correction), got {self.tis}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.probe_every < 0:
            raise ValueError(f"probe_every must be >= 0, got {self.probe_every}")
        if not 0 < self.sample <= 1:
            raise ValueError(f"sample must be in (0, 1], got {self.sample}")
        _check_loss_options(self.loss_options)
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must lie in [0, 1], got {self.top_entropy_quantile}")
        if self.entropy_target is not None:
            if not self.entropy_target >= 0:
                raise ValueError(f"entropy_target must be >= 0, got {self.entropy_target}")
            if not (self.entropy_coef_delta >= 0 and 0 <= self.entropy_coef_min <= self.entropy_coef_max):
                raise ValueError("entropy_coef_delta must be >= 0 and 0 <= entropy_coef_min <= entropy_coef_max")
        if self.probe_every and (self.top_entropy_quantile < 1.0 or self.entropy_target is not None):
            raise ValueError(
                "probe_every: the probe's update does not apply top_entropy_quantile or the adaptive "
                "entropy coefficient; run these methods without the probe"
            )

    @property
    def updates(self) -> int:
        """Policy updates (optimizer steps) per rollout step."""
        return self.minibatches * self.epochs

    def beta1_at(self, step: int) -> float:
        b = self.beta1
        for s, v in sorted(self.beta1_schedule):
            if step >= s:
                b = v
        return b

    def to_dict(self) -> dict:
        return asdict(self)


# Named regimes: the training scale every named run starts from (a run's own preset and explicit
# overrides come on top). Measured on one GRPO seed (OMP_NUM_THREADS=1; reports/paper-claims.md has the
# five-seed values beside the papers'):
# - fast: the original lab. 4 mini-batches x 2 epochs = 8 updates per step at lr 7e-4: KL(old || new)
#   ~1e-2 per update, clip fraction ~4e-2 low / 2e-2 high, the grad-norm clip at 1.0 active on 15% of
#   updates in the first 20 steps and on most later ones. Collapses within ~40 steps.
# - paper: towards the papers' order of magnitude (KL ~1e-5 per update, PPO-clip ~2e-4 of tokens, grad
#   norm ~0.05-0.10 under a clip of 1.0, i.e. the clip ~10-20x above the typical norm and almost never
#   active) within a CPU budget. One pass over the rollout batch in 4 mini-batches (verl's usual
#   ppo_epochs 1), Adam lr 2e-4, 200 steps. Probes over 300 steps: at lr 2e-4 KL mean 4.0e-4 (median
#   9e-5), clip 1.0e-3 low / 3.7e-4 high, entropy 1.15 -> 0.16 by step 200 (collapsed below 0.25 x the
#   initial entropy by ~step 120); lr 1e-4 came closer (KL 1.4e-4, clip 2.8e-4 / 1.1e-4) but needs
#   ~350 steps to collapse (twice the CPU), lr 5e-5 with 64 prompts KL 1.1e-4 and hardly moved in 30 steps.
#   The toy's pre-clip grad norm is ~10x the papers' (median 0.64, p99 2.2): a clip of 1.0 would be active
#   on 16% of updates, so the clip sits at 3.0 (active on 0.4%), a rare safety net as in the papers.
REGIMES: dict[str, dict] = {
    "fast": {},
    "paper": dict(lr=2e-4, minibatches=4, epochs=1, steps=200, grad_clip=3.0),
}

# Named runs: toy/methods.py's registry (one entry a method). RUNS: name -> the options it sets.
RUNS: dict[str, dict] = {name: m.options for name, m in _methods.REGISTRY.items()}
DEMO_DEFAULT = ("grpo", "dapo", "ce_gppo", "erc_dapo")


def run_names() -> list[str]:
    return _methods.names()


def _check_loss_options(options) -> None:
    """Each loss option names a keyword argument of policy_loss that no ToyConfig field sets and that
    is not a tensor (a config holds numbers and names; tensors come from the training loop)."""
    import inspect

    from ...rl.losses import policy_loss

    valid = [
        n
        for n, p in inspect.signature(policy_loss).parameters.items()
        if n not in _SET_BY_CONFIG and "Tensor" not in str(p.annotation)
    ]
    for item in options:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"loss_options: each item must be a (name, value) pair, got {item!r}")
        if item[0] not in valid:
            raise ValueError(f"loss_options: {item[0]!r} is not a policy_loss option; valid: {', '.join(valid)}")


def _preset(name: str) -> dict:
    """A named run's options as ToyConfig fields (loss_options as sorted (name, value) pairs)."""
    opts = dict(_methods.lookup(name).options)
    if isinstance(opts.get("loss_options"), dict):
        opts["loss_options"] = tuple(sorted(opts["loss_options"].items()))
    return opts


def config_for(name: str, regime: str = "fast", **overrides) -> ToyConfig:
    """The config of a named run, e.g. 'grpo', 'ce_gppo', 'entropy_bonus_0.003', 'ce_gppo_0.75_1', in a named
    regime ('fast', the default, or 'paper'): regime settings, then the run's preset, then ``overrides``."""
    if regime not in REGIMES:
        raise ValueError(f"unknown regime {regime!r}; known: {', '.join(REGIMES)}")
    preset = _preset(name)
    cfg = replace(ToyConfig(), **{**REGIMES[regime], **preset, **overrides}, name=name, regime=regime)
    cfg.validate()
    return cfg


__all__ = ["ToyConfig", "REGIMES", "RUNS", "DEMO_DEFAULT", "config_for", "run_names"]
