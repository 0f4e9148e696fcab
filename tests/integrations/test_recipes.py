"""The loss-hook recipes (docs/recipes/) against the trainers' own loss code, where the package gives it.

AReaL 1.0.4 (``pip install --no-deps areal==1.0.4``): ``areal/utils/functional/functional.py`` is loaded by
path, its two imports (``areal.api.cli_args.RejectionSamplingConfig``, ``areal.utils.data.KLEstimator``:
types the PPO loss without rejection sampling never touches) as empty stand-ins for the load only.
SkyRL 0.3.1 needs Python 3.12 and imports ray, loguru, jaxtyping and omegaconf at the top of its loss module;
slime's loss lives in its Megatron backend: neither is tested here (docs/recipes/skyrl.md, slime.md)."""

import importlib.util
import sys
import types

import numpy as np
import pytest
import torch

from entropylens.integrations.loss_hook import LossHook
from entropylens.read.query import connect
from entropylens.record.recorder import Recorder


def _areal_loss_fn():
    spec = importlib.util.find_spec("areal")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("AReaL is not installed (pip install --no-deps areal==1.0.4)")
    path = f"{list(spec.submodule_search_locations)[0]}/utils/functional/functional.py"
    stand_ins = {"areal": None, "areal.api": None, "areal.api.cli_args": "RejectionSamplingConfig",
                 "areal.utils": None, "areal.utils.data": "KLEstimator"}
    saved = {n: sys.modules.get(n) for n in stand_ins}
    try:
        for name, cls in stand_ins.items():
            mod = types.ModuleType(name)
            mod.__path__ = []
            if cls:
                setattr(mod, cls, type(cls, (), {}))
            sys.modules[name] = mod
        s = importlib.util.spec_from_file_location("_el_areal_functional", path)
        module = importlib.util.module_from_spec(s)
        s.loader.exec_module(module)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    return module.ppo_actor_loss_fn


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
    kw = dict(proximal_logprobs=prox, old_logprobs=behave, advantages=adv, eps_clip=0.2, loss_mask=mask,
              eps_clip_higher=0.28, c_clip=c_clip)
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
