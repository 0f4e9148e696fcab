"""The loss-hook recipes (docs/recipes/) against the trainers' own loss code, where the package gives it.

AReaL 1.0.4 (``pip install --no-deps areal==1.0.4``): ``areal/utils/functional/functional.py`` is loaded by
path, its two imports (``areal.api.cli_args.RejectionSamplingConfig``, ``areal.utils.data.KLEstimator``:
types the PPO loss without rejection sampling never touches) as empty stand-ins for the load only.
SkyRL 0.3.1 (``pip install --no-deps --ignore-requires-python skyrl-train==0.3.1``; it declares Python >= 3.12):
``skyrl_train/utils/ppo_utils.py`` is loaded by path, its top-level imports (ray, jaxtyping, loguru, omegaconf,
``skyrl_train.training_batch``) as small stand-ins for the load only (loguru also around the calls that import
it lazily: TIS, GSPO without sequence_mean). slime's loss lives in its Megatron backend: not tested here
(docs/recipes/slime.md)."""

import contextlib
import importlib.metadata
import importlib.util
import sys
import types

import numpy as np
import pytest
import torch

from entropylens.integrations.loss_hook import LossHook
from entropylens.read.query import connect
from entropylens.record.recorder import Recorder


@contextlib.contextmanager
def _stand_ins(modules: dict[str, dict]):
    """Each name in ``modules`` is a small module with the given attributes in sys.modules for the block only;
    what was there before (or nothing) is put back after."""
    saved = {name: sys.modules.get(name) for name in modules}
    try:
        for name, attrs in modules.items():
            mod = types.ModuleType(name)
            mod.__path__ = []
            mod.__dict__.update(attrs)
            sys.modules[name] = mod
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


def _load_by_path(package: str, relpath: str, name: str, stand_ins: dict[str, dict], install: str):
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed ({install})")
    path = f"{list(spec.submodule_search_locations)[0]}/{relpath}"
    with _stand_ins(stand_ins):
        s = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(s)
        s.loader.exec_module(module)
    return module


def _areal_loss_fn():
    stand_ins = {
        "areal": {},
        "areal.api": {},
        "areal.api.cli_args": {"RejectionSamplingConfig": type("RejectionSamplingConfig", (), {})},
        "areal.utils": {},
        "areal.utils.data": {"KLEstimator": type("KLEstimator", (), {})},
    }
    return _load_by_path(
        "areal",
        "utils/functional/functional.py",
        "_el_areal_functional",
        stand_ins,
        "pip install --no-deps areal==1.0.4",
    ).ppo_actor_loss_fn


@pytest.mark.parametrize("c_clip", [None, 3.0])
def test_areal_recipe_changes_nothing_and_records_arealss_clip_mask(tmp_path, c_clip):
    ppo_actor_loss_fn = _areal_loss_fn()
    g = torch.Generator().manual_seed(0)
    b, t = 6, 8
    prox = torch.log(torch.rand(b, t, generator=g, dtype=torch.float64) * 0.9 + 0.05)  # [B, T]
    lp0 = torch.minimum(prox + 0.4 * torch.randn(b, t, generator=g, dtype=torch.float64), torch.zeros(()))
    behave = torch.minimum(prox + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64), torch.zeros(()))
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, t).contiguous()
    mask = torch.rand(b, t, generator=g) > 0.2
    kw = dict(
        proximal_logprobs=prox,
        old_logprobs=behave,
        advantages=adv,
        eps_clip=0.2,
        loss_mask=mask,
        eps_clip_higher=0.28,
        c_clip=c_clip,
    )
    ref_lp = lp0.clone().requires_grad_(True)
    ref_loss, ref_stat = ppo_actor_loss_fn(logprobs=ref_lp, **kw)
    ref_loss.backward()
    # the recipe's three lines
    rec = Recorder(tmp_path, run="areal")
    hook = LossHook(rec, names="areal", eps_low=0.2, eps_high=0.28, dual_clip=c_clip, on_error="raise")
    loss_fn = hook.wrap(ppo_actor_loss_fn)
    lp = lp0.clone().requires_grad_(True)
    loss, stat = loss_fn(logprobs=lp, **kw, step=0, update=0)
    loss.backward()
    rec.close()
    assert torch.equal(loss, ref_loss) and torch.equal(lp.grad, ref_lp.grad)
    rows = connect(rec.dir).execute("SELECT clipped, grad_coef, ratio FROM tokens ORDER BY seq, pos").df()
    assert len(rows) == int(mask.sum())
    assert (rows["clipped"].to_numpy() == ref_stat["clip_mask"][mask].numpy()).all()  # AReaL's own clip mask
    np.testing.assert_allclose(rows["grad_coef"].to_numpy(), ref_lp.grad[mask].numpy(), rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(rows["ratio"].to_numpy(), (lp0 - prox).exp()[mask].numpy(), rtol=1e-6)


# --- SkyRL 0.3.1 ---------------------------------------------------------------------------------------------


class _Annotation:  # jaxtyping's Float[torch.Tensor, "..."] in ppo_utils' annotations
    def __class_getitem__(cls, item):
        return cls


class _Logger:  # loguru's logger: every call does nothing
    def __getattr__(self, name):
        return lambda *a, **k: None


_LOGURU = {"loguru": {"logger": _Logger()}}
_SKYRL_STAND_INS = {
    "ray": {"is_initialized": lambda: False, "remote": lambda cls: cls, "get": lambda x: x},  # local registry only
    "jaxtyping": {"Float": _Annotation},
    **_LOGURU,
    "omegaconf": {"DictConfig": type("DictConfig", (), {})},
    "skyrl_train": {},
    "skyrl_train.training_batch": {"TrainingInputBatch": type("TrainingInputBatch", (), {})},
}
_SKYRL_INSTALL = "pip install --no-deps --ignore-requires-python skyrl-train==0.3.1"


def _skyrl_ppo_utils():
    if importlib.util.find_spec("skyrl_train") is None:
        pytest.skip(f"skyrl-train is not installed ({_SKYRL_INSTALL})")
    version = importlib.metadata.version("skyrl-train")
    if not version.startswith("0.3."):
        pytest.skip(f"this test pins skyrl-train 0.3.1's ppo_utils.py (installed: {version})")
    return _load_by_path("skyrl_train", "utils/ppo_utils.py", "_el_skyrl_ppo_utils", _SKYRL_STAND_INS, _SKYRL_INSTALL)


def _skyrl_batch(seed, b=8, t=10):
    """float64 [B, T] log-probs, old log-probs, rollout log-probs, advantages (sequence signs +, -, +, ...) and a
    float 0/1 mask (SkyRL's loss_mask). Dual clip (c = 3) acts on several tokens: three of each negative
    sequence at token ratio 5, and the whole of sequence 3 at ratio 4. PPO-clip acts on the token ratios and on
    GSPO's sequence ratios: sequence 4 (A > 0) whole at ratio 2, sequence 7 (A < 0) at ratio 0.1 after its
    first three tokens (its sequence ratio ~0.32)."""
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64
    old = torch.log(torch.rand(b, t, generator=g, dtype=dt) * 0.9 + 0.05)
    lp = torch.minimum(old + 0.4 * torch.randn(b, t, generator=g, dtype=dt), torch.zeros((), dtype=dt))
    rollout = torch.minimum(old + 0.2 * torch.randn(b, t, generator=g, dtype=dt), torch.zeros((), dtype=dt))
    sign = torch.tensor([1.0, -1.0] * (b // 2), dtype=dt).unsqueeze(1)  # [B, 1]
    adv = (torch.rand(b, 1, generator=g, dtype=dt) + 0.1) * sign
    mask = torch.rand(b, t, generator=g) > 0.2
    old[1::2, :3], lp[1::2, :3], mask[1::2, :3] = np.log(0.1), np.log(0.5), True
    old[3], lp[3], mask[3] = np.log(0.2), np.log(0.8), True
    old[4], lp[4], mask[4] = np.log(0.3), np.log(0.6), True
    old[7, 3:], lp[7, 3:], mask[7] = np.log(0.5), np.log(0.05), True
    mask[6, 5:] = False  # padding
    return lp, old, rollout, adv.expand(b, t).contiguous(), mask.to(dt)


SKYRL_CASES = [
    (kind, red)
    for kind in ("regular", "dual_clip", "gspo")
    for red in ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")
]


@pytest.mark.parametrize("policy_loss_type,loss_reduction", SKYRL_CASES)
def test_skyrl_recipe_changes_nothing_and_records_skyrls_clip_ratio(tmp_path, policy_loss_type, loss_reduction):
    ppo_utils = _skyrl_ppo_utils()
    loss_fn = ppo_utils.PolicyLossRegistry.get(policy_loss_type)  # what SkyRL's policy worker calls
    use_tis = policy_loss_type != "gspo" and loss_reduction != "token_mean"  # TIS: ppo_policy_loss only
    cfg = types.SimpleNamespace(
        policy_loss_type=policy_loss_type,
        loss_reduction=loss_reduction,
        eps_clip_low=0.2,
        eps_clip_high=0.28,
        clip_ratio_c=3.0,
        use_tis=use_tis,
        tis_imp_ratio_cap=2.0,
        max_seq_len=16,
    )
    lp0, old, rollout, adv, mask = _skyrl_batch(len(policy_loss_type) + len(loss_reduction))
    m = mask.bool()

    def call(fn, lp, **extra):
        with _stand_ins(_LOGURU):  # imported lazily by TIS and by GSPO without sequence_mean
            return fn(lp, old, adv, config=cfg, loss_mask=mask, rollout_logprobs=rollout, **extra)

    ref_lp = lp0.clone().requires_grad_(True)
    ref_loss, ref_clip_ratio = call(loss_fn, ref_lp)
    ref_loss.backward()

    # the recipe's lines; GSPO clips its sequence ratio, handed over as clip_ratio (the ratio column stays the token's)
    rec = Recorder(tmp_path, run="skyrl")
    hook = LossHook(
        rec,
        names="skyrl",
        eps_low=cfg.eps_clip_low,
        eps_high=cfg.eps_clip_high,
        dual_clip=cfg.clip_ratio_c if policy_loss_type == "dual_clip" else None,
        on_error="raise",
    )
    seq_ratio = None
    if policy_loss_type == "gspo":
        log_seq = ((lp0 - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
        seq_ratio = log_seq.clamp(max=10).exp().expand_as(lp0)
    results = []
    for step, via in enumerate(("watch", "wrap")):
        lp = lp0.clone().requires_grad_(True)
        extra = {} if seq_ratio is None else {"clip_ratio": seq_ratio}
        if via == "watch":
            hook.watch(
                step,
                0,
                log_probs=lp,
                old_log_probs=old,
                advantages=adv,
                loss_mask=mask,
                rollout_logprobs=rollout,
                **extra,
            )
            loss, clip_ratio = call(loss_fn, lp)
        else:
            loss, clip_ratio = call(hook.wrap(loss_fn), lp, step=step, update=0, **extra)
        loss.backward()
        results.append((loss, lp.grad, clip_ratio))
    rec.close()
    for loss, grad, clip_ratio in results:  # bit for bit
        assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_lp.grad) and clip_ratio == ref_clip_ratio

    # SkyRL's own per-token definitions: clip_ratio's indicator (-surr2 > -surr1), and dual clip's cap
    ratio = seq_ratio if seq_ratio is not None else ppo_utils._safe_exp_delta(lp0 - old, clip=20.0, out_dtype=lp0.dtype)
    surr1, surr2 = ratio * adv, ratio.clamp(1 - cfg.eps_clip_low, 1 + cfg.eps_clip_high) * adv
    ppo_clipped = -surr2 > -surr1
    dual = (
        (adv < 0) & (-adv * cfg.clip_ratio_c < -torch.min(surr1, surr2))
        if policy_loss_type == "dual_clip"
        else torch.zeros_like(m)
    )
    assert ref_clip_ratio > 0.1  # PPO-clip acts on this batch
    assert ref_clip_ratio == pytest.approx(float(ppo_clipped[m].double().mean()), rel=1e-12)

    t = (
        connect(rec.dir)
        .execute("SELECT step, clipped, dual_clipped, grad_coef, ratio FROM tokens ORDER BY step, seq, pos")
        .df()
    )
    for step in (0, 1):
        rows = t[t.step == step]
        assert len(rows) == int(m.sum())
        clipped = rows["clipped"].to_numpy().astype(bool)
        if policy_loss_type == "dual_clip":
            dual_clipped = rows["dual_clipped"].to_numpy().astype(bool)
            assert dual[m].sum() >= 10 and (dual_clipped == dual[m].numpy()).all()
            assert (ref_lp.grad[dual] == 0).all()  # dual clip removed these tokens' gradient
            # dual-clipped tokens are not PPO-clipped (schema): clipped is SkyRL's clip_ratio's indicator alone
            assert (clipped == ppo_clipped[m].numpy()).all() and not (clipped & dual_clipped).any()
            assert clipped.mean() == pytest.approx(ref_clip_ratio, rel=1e-12)
        else:
            assert rows["dual_clipped"].isna().all()
            assert (clipped == ppo_clipped[m].numpy()).all()
            assert clipped.mean() == pytest.approx(ref_clip_ratio, rel=1e-12)  # avg(clipped) is SkyRL's clip_ratio
        np.testing.assert_allclose(rows["grad_coef"].to_numpy(), ref_lp.grad[m].numpy(), rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(rows["ratio"].to_numpy(), (lp0 - old).exp()[m].numpy(), rtol=1e-6)
