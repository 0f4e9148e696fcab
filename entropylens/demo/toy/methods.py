"""The toy lab's methods: one entry a method. Adding a method to `entropylens demo --methods` and to the
claims lab is one entry here.

An entry names the method, the ToyConfig fields it sets (``options``; ``loss_options`` are further
keyword arguments of ``entropylens.rl.losses.policy_loss``, passed as they are), one line saying what
it does, its paper, and where the toy's setting differs from the paper's (``toy``). A *family* is a
parametrised name (``entropy_bonus_<coef>``): a pattern and the options it makes from the match.

:func:`settings` turns a run's config into the settings its loss used (method defaults resolved, only
what applies), and :func:`differs` says which of them differ from a baseline's: the claims table's
"settings" and "what differs" columns are made from the recorded run.json, never from this file.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Method:
    name: str
    options: dict  # ToyConfig fields; "loss_options": extra policy_loss kwargs
    description: str  # one line: what it does
    paper: str  # where it comes from
    toy: str = ""  # where the toy's setting differs from the paper's ("" : as in the paper)


@dataclass(frozen=True)
class Family:
    template: str  # the name a user types, e.g. "entropy_bonus_<coef>"
    pattern: re.Pattern
    make: Callable[[re.Match], dict]
    description: str
    paper: str
    toy: str = ""


GRPO = "Shao et al. 2024, DeepSeekMath (arXiv 2402.03300)"
DAPO = "Yu et al. 2025, DAPO (arXiv 2503.14476)"
GPPO = "Su et al. 2025, Klear-Reasoner (arXiv 2508.07629)"
CE_GPPO = "Su et al. 2025, CE-GPPO (arXiv 2509.20712)"
ERC = "Su et al. 2025, ERC (arXiv 2512.05591)"
CISPO = "MiniMax 2025, MiniMax-M1 (arXiv 2506.13585)"
GSPO = "Zheng et al. 2025, GSPO (arXiv 2507.18071)"
CUI = "Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs (arXiv 2505.22617)"
FORKING = "Wang et al. 2025, Beyond the 80/20 Rule (arXiv 2506.01939)"
SKYWORK = "He et al. 2025, Skywork Open Reasoner 1 (arXiv 2505.22312)"
SAPO = "Qwen team 2025, SAPO: Soft Adaptive Policy Optimization (arXiv 2511.20347)"

_ONLY_CLIP = "clip-higher only: DAPO's dynamic sampling and overlong shaping are not in the toy"

_ENTRIES: tuple[Method, ...] = (
    Method(
        "grpo",
        dict(method="grpo"),
        "PPO-clip on group-normalised advantages, eps 0.2 / 0.2",
        GRPO,
        "no KL to a reference (as the CE-GPPO / ERC papers)",
    ),
    Method("dapo", dict(method="dapo"), "clip-higher: eps 0.2 / 0.28", DAPO, _ONLY_CLIP),
    Method("gppo", dict(method="gppo"), "gradient-preserving clip: clipped tokens keep a bounded gradient", GPPO),
    Method(
        "ce_gppo",
        dict(method="ce_gppo", beta1=0.5, beta2=1.0),
        "GPPO with the low side scaled by beta1 = 0.5, the high side by beta2 = 1 (the paper's 1.5B setting)",
        CE_GPPO,
    ),
    Method(
        "ce_gppo_b0",
        dict(method="ce_gppo", beta1=0.0, beta2=1.0),
        "CE-GPPO with beta1 = 0: no gradient for low-side clipped tokens",
        CE_GPPO,
    ),
    Method(
        "ce_gppo_switch",
        dict(method="ce_gppo", beta1=0.0, beta2=1.0, beta1_schedule=((-1, 0.0), (60, 0.5))),
        "CE-GPPO, beta1 switched from 0 to 0.5 at step 60",
        CE_GPPO,
        "the paper switches at step 585",
    ),
    Method(
        "cispo", dict(method="cispo"), "clipped, detached importance weight times log pi: never a zero gradient", CISPO
    ),
    Method("gspo", dict(method="gspo"), "sequence-level ratio clipped at 3e-4 / 4e-4, seq-mean-token-mean", GSPO),
    Method(
        "sapo",
        dict(method="sapo"),
        "a soft sigmoid gate on the ratio in place of the hard clip (tau 1.0 for A > 0, 1.05 otherwise), "
        "seq-mean-token-mean",
        SAPO,
        "verl 0.9.1's defaults (tau_pos 1.0, tau_neg 1.05, log-ratio clamp 20)",
    ),
    Method(
        "clip_cov",
        dict(method="clip_cov"),
        "Clip-Cov: PPO-clip, and no gradient for a random 2e-4 of the tokens whose covariance "
        "(A - mean A)(log pi - mean log pi) lies in (1, 5)",
        CUI,
        "verl 0.9.1's defaults; an update of the toy holds 512 tokens, so the share selects max(int(0.1), 1) = 1 "
        "token (0.2%, 10x the ratio): clip_cov_<ratio> scales it",
    ),
    Method(
        "kl_cov",
        dict(method="kl_cov"),
        "KL-Cov: the unclipped surrogate plus 0.1 |log r| on the top 2e-4 of the tokens by covariance",
        CUI,
        "verl 0.9.1's defaults (kl_cov_ratio 2e-4, ppo_kl_coef 0.1); on the toy's 512 tokens an update penalises "
        "max(int(0.1), 1) = 1 token: kl_cov_<ratio> scales it",
    ),
    Method(
        "forking",
        dict(method="dapo", top_entropy_quantile=0.2),
        "the 80/20 rule on DAPO: the policy gradient only on the top 20% of each update's tokens by entropy",
        FORKING,
        "the top 20% of one update's 512 tokens (the paper: of a batch of long reasoning traces)",
    ),
    Method(
        "adaptive_entropy",
        dict(
            method="grpo",
            entropy_target=0.2,
            entropy_coef=0.0,
            entropy_coef_delta=0.005,
            entropy_coef_min=0.0,
            entropy_coef_max=1.0,
        ),
        "GRPO with an entropy bonus whose coefficient steps by 0.005 towards keeping entropy above 0.2 nats",
        SKYWORK,
        "TRL's defaults (target 0.2, delta 0.005, coefficient from 0 in [0, 1]); the toy starts near "
        "1.1 nats, so the coefficient only moves once entropy has fallen below 0.2",
    ),
    Method(
        "grpo_mismatch",
        dict(method="grpo", mismatch="temp:1.5"),
        "GRPO trained on samples from a mismatched sampler (temperature 1.5 x the trainer's), no IS correction",
        "Yao et al. 2025, Your Efficient RL Framework Secretly Brings You Off-Policy RL Training (the TIS blog)",
        "a controlled mismatch (sampler.py: temp:1.5) in place of vLLM's bf16 / kernel differences",
    ),
    Method(
        "grpo_mismatch_tis",
        dict(method="grpo", mismatch="temp:1.5", tis=2.0),
        "grpo_mismatch with TIS: each token's policy term times min(pi_old / pi_sampler, 2)",
        "Yao et al. 2025, Your Efficient RL Framework Secretly Brings You Off-Policy RL Training (the TIS blog)",
        "a controlled mismatch (sampler.py: temp:1.5); TIS cap 2 (verl's rollout_is_threshold default)",
    ),
    Method(
        "erc_dapo",
        dict(method="dapo", erc=(0.95, 1.05)),
        "DAPO plus Entropy Ratio Clipping: no gradient where H / H_old leaves (0.95, 1.05)",
        ERC,
    ),
    Method(
        "erc_gppo", dict(method="gppo", erc=(0.95, 1.05)), "GPPO plus Entropy Ratio Clipping, band (0.95, 1.05)", ERC
    ),
)

FAMILIES: tuple[Family, ...] = (
    Family(
        "entropy_bonus_<coef>",
        re.compile(r"entropy_bonus_([0-9.]+)"),
        lambda m: dict(method="grpo", entropy_coef=float(m.group(1))),
        "GRPO minus coef x mean token entropy (the bonus's gradient reaches the logits through H)",
        "the CE-GPPO / ERC papers' baseline (0.001, 0.003)",
    ),
    Family(
        "ce_gppo_<beta1>_<beta2>",
        re.compile(r"ce_gppo_([0-9.]+)_([0-9.]+)"),
        lambda m: dict(method="ce_gppo", beta1=float(m.group(1)), beta2=float(m.group(2))),
        "CE-GPPO at the given (beta1, beta2)",
        CE_GPPO,
    ),
    Family(
        "forking_<quantile>",
        re.compile(r"forking_([0-9.]+)"),
        lambda m: dict(method="dapo", top_entropy_quantile=float(m.group(1))),
        "the forking rule on DAPO keeping the given top share of tokens by entropy",
        FORKING,
    ),
    Family(
        "adaptive_entropy_<target>",
        re.compile(r"adaptive_entropy_([0-9.]+)"),
        lambda m: dict(method="grpo", entropy_target=float(m.group(1))),
        "GRPO with the adaptive entropy coefficient steering towards the given target entropy",
        SKYWORK,
    ),
    Family(
        "clip_cov_<ratio>",
        re.compile(r"clip_cov_([0-9.]+)"),
        lambda m: dict(method="clip_cov", loss_options=dict(clip_cov_ratio=float(m.group(1)))),
        "Clip-Cov with the given share of tokens selected",
        CUI,
    ),
    Family(
        "kl_cov_<ratio>",
        re.compile(r"kl_cov_([0-9.]+)"),
        lambda m: dict(method="kl_cov", loss_options=dict(kl_cov_ratio=float(m.group(1)))),
        "KL-Cov with the given share of tokens penalised",
        CUI,
    ),
    Family(
        "dual_clip_<c>",
        re.compile(r"dual_clip_([0-9.]+)"),
        lambda m: dict(method="grpo", dual_clip=float(m.group(1))),
        "GRPO with dual-clip c: A < 0 tokens capped at -c A",
        "Ye et al. 2020, dual-clip PPO (arXiv 1912.09729)",
        "verl's default c is 3, the CE-GPPO scripts' 10",
    ),
)

REGISTRY: dict[str, Method] = {m.name: m for m in _ENTRIES}


def register(method: Method) -> Method:
    """Add ``method`` to :data:`REGISTRY` (a name taken is refused)."""
    if method.name in REGISTRY or any(f.pattern.fullmatch(method.name) for f in FAMILIES):
        raise ValueError(f"method {method.name!r} is registered already")
    REGISTRY[method.name] = method
    return method


def names() -> list[str]:
    """Every name `--methods` accepts: the methods, then the families' templates."""
    return [*REGISTRY, *(f.template for f in FAMILIES)]


def lookup(name: str) -> Method:
    """The entry of ``name`` (a family's name gets an entry made for it). Unknown: ValueError
    'unknown run NAME; known: ...' listing every name."""
    if name in REGISTRY:
        return REGISTRY[name]
    for fam in FAMILIES:
        m = fam.pattern.fullmatch(name)
        if m:
            return Method(name, fam.make(m), fam.description, fam.paper, fam.toy)
    raise ValueError(f"unknown run {name!r}; known: {', '.join(names())}")


# ------------------------------------------------------------------ settings of a recorded run
# The training settings every run of a regime shares (shown once per regime; a run that changed one
# shows it under "what differs").
TRAINING = ("lr", "steps", "prompts", "group", "minibatches", "epochs", "grad_clip", "temperature", "sft_steps", "tau")


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join(_fmt(x) for x in v) + ")"
    return str(v)


def loss_settings(cfg: dict) -> dict[str, str]:
    """The loss settings a run's config (ToyConfig.to_dict(), as in run.json) used, as text: the loss
    method, eps_low / eps_high and agg with the method's defaults resolved (losses.resolve_eps,
    DEFAULT_AGG), beta1 / beta2 (and a beta1 schedule) for ce_gppo only, and dual_clip, erc,
    entropy_coef and each loss option only where set."""
    from ...rl import losses

    method = cfg.get("loss_method") or cfg["method"]
    out = {"loss": method}
    options = dict(cfg.get("loss_options") or ())
    if method == "sapo":  # no clip band: its gate's temperatures instead of eps
        pos = options.pop("sapo_tau_pos", losses.SAPO_TAUS[0])
        neg = options.pop("sapo_tau_neg", losses.SAPO_TAUS[1])
        out["sapo_tau"] = f"{_fmt(float(pos))} / {_fmt(float(neg))}"
        import inspect

        clamp = inspect.signature(losses.policy_loss).parameters["sapo_log_ratio_clamp"].default
        out["sapo_log_ratio_clamp"] = _fmt(options.pop("sapo_log_ratio_clamp", clamp))
    if method in ("clip_cov", "kl_cov"):  # the covariance controls' settings, verl's defaults resolved
        from ...rl import cov

        keys = (
            dict(clip_cov_ratio=cov.CLIP_COV_RATIO, clip_cov_lb=cov.CLIP_COV_LB, clip_cov_ub=cov.CLIP_COV_UB)
            if method == "clip_cov"
            else dict(kl_cov_ratio=cov.KL_COV_RATIO, ppo_kl_coef=cov.PPO_KL_COEF)
        )
        for k, default in keys.items():
            v = options.pop(k, None)
            out[k] = _fmt(float(default if v is None else v))
    try:
        lo, hi = losses.resolve_eps(method, cfg.get("eps_low"), cfg.get("eps_high"))
        if method not in ("sapo", "kl_cov"):  # no clip band: sapo's gate, kl_cov's unclipped surrogate
            out["eps"] = f"{lo:g} / {hi:g}"
    except KeyError:  # a method without PPO-style eps defaults
        if cfg.get("eps_low") is not None or cfg.get("eps_high") is not None:
            out["eps"] = f"{_fmt(cfg.get('eps_low'))} / {_fmt(cfg.get('eps_high'))}"
    out["agg"] = cfg.get("agg") or losses.DEFAULT_AGG.get(method, "token-mean")
    if method == "ce_gppo":
        out["beta1"], out["beta2"] = _fmt(float(cfg["beta1"])), _fmt(float(cfg["beta2"]))
        if cfg.get("beta1_schedule"):
            out["beta1_schedule"] = ", ".join(f"step {s}: {b:g}" for s, b in cfg["beta1_schedule"] if s >= 0)
    if cfg.get("dual_clip") is not None:
        out["dual_clip"] = _fmt(cfg["dual_clip"])
    if cfg.get("erc") is not None:
        out["erc"] = _fmt(tuple(cfg["erc"]))
    if cfg.get("entropy_target") is not None:  # the adaptive coefficient (rl.forking.AdaptiveEntropyCoef)
        out["entropy_coef"] = (
            f"adaptive: target {_fmt(cfg['entropy_target'])}, step "
            f"{_fmt(cfg.get('entropy_coef_delta', 0.005))} in [{_fmt(cfg.get('entropy_coef_min', 0.0))}, "
            f"{_fmt(cfg.get('entropy_coef_max', 1.0))}], from {_fmt(cfg.get('entropy_coef', 0.0))}"
        )
    elif cfg.get("entropy_coef"):
        out["entropy_coef"] = _fmt(cfg["entropy_coef"])
    if cfg.get("mismatch"):  # the toy's mismatched sampler (sampler.py) and its IS correction
        out["sampler"] = cfg["mismatch"]
        out["tis"] = _fmt(cfg["tis"]) if cfg.get("tis") else "none"
    if cfg.get("top_entropy_quantile", 1.0) < 1.0:
        out["top_entropy_quantile"] = _fmt(cfg["top_entropy_quantile"])
    for k, v in options.items():
        out[k] = _fmt(v)
    return out


def settings(cfg: dict) -> dict[str, str]:
    """loss_settings plus the training settings (:data:`TRAINING`) of a run's config."""
    return {**loss_settings(cfg), **{k: _fmt(cfg[k]) for k in TRAINING if k in cfg}}


def loss_part(settings_: dict[str, str]) -> dict[str, str]:
    """The loss settings of a :func:`settings` dict (everything but :data:`TRAINING`)."""
    return {k: v for k, v in settings_.items() if k not in TRAINING}


def differs(mine: dict[str, str], base: dict[str, str]) -> dict[str, tuple[str, str]]:
    """{setting: (this run's value, the baseline's)} for every setting that is not the same ("-": not set)."""
    keys = [*mine, *(k for k in base if k not in mine)]
    return {k: (mine.get(k, "-"), base.get(k, "-")) for k in keys if mine.get(k) != base.get(k)}


def differs_text(mine: dict[str, str], base: dict[str, str], base_name: str) -> str:
    """'eps 0.2 / 0.28 (grpo: 0.2 / 0.2); erc (0.95, 1.05) (grpo: -)', or 'the baseline' when nothing differs."""
    d = differs(mine, base)
    if not d:
        return "nothing (same settings)"
    return "; ".join(f"{k} {a} ({base_name}: {b})" for k, (a, b) in d.items())


@dataclass(frozen=True)
class Listed:
    """One line of `entropylens demo --list-methods`."""

    name: str
    options: str
    description: str
    paper: str
    toy: str = field(default="")


def listing() -> list[Listed]:
    """Every method and family, with the options it sets."""
    rows = [
        Listed(m.name, ", ".join(f"{k}={_fmt(v)}" for k, v in m.options.items()), m.description, m.paper, m.toy)
        for m in REGISTRY.values()
    ]
    rows += [Listed(f.template, "(from the name)", f.description, f.paper, f.toy) for f in FAMILIES]
    return rows


__all__ = [
    "Method",
    "Family",
    "REGISTRY",
    "FAMILIES",
    "TRAINING",
    "register",
    "names",
    "lookup",
    "loss_settings",
    "settings",
    "loss_part",
    "differs",
    "differs_text",
    "listing",
]
