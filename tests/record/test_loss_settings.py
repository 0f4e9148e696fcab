"""Loss settings: run-level ones in run.json, the ones that change over a run in the steps rows."""

import json

import pytest
import torch

from entropylens import Recorder
from entropylens.read.query import connect
from entropylens.report.build import _hyper
from entropylens.rl.losses import policy_loss, update_settings


def _update(rec, step, update, **loss_kw):
    lp = torch.log(torch.tensor([[0.5, 0.4]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = policy_loss(lp, lp, torch.ones(1), mask, **loss_kw)
    rec.record_update(
        step,
        update,
        mask=mask,
        advantages=torch.ones(1),
        logprobs=lp,
        old_logprobs=lp,
        seq_ids=torch.tensor([update]),
        loss=out,
    )


def test_beta1_schedule_lands_in_steps_rows_not_run_json(tmp_path):
    # ce_gppo_switch-like: beta1 0 for step 0, 0.5 from step 1 on (two updates per step)
    with Recorder(tmp_path, run="switch") as rec:
        for step, beta1 in ((0, 0.0), (1, 0.5)):
            for u in range(2):
                _update(rec, step, u, method="ce_gppo", beta1=beta1, beta2=1.0)
    with Recorder(tmp_path, run="grpo") as rec:
        _update(rec, 0, 0, method="grpo", dual_clip=3.0)
    con = connect(tmp_path)
    rows = con.execute("SELECT run, step, update, beta1, beta2, dual_clip FROM steps ORDER BY ALL").fetchall()
    assert rows == [
        ("grpo", 0, 0, None, None, 3.0),
        ("switch", 0, 0, 0.0, 1.0, None),
        ("switch", 0, 1, 0.0, 1.0, None),
        ("switch", 1, 0, 0.5, 1.0, None),
        ("switch", 1, 1, 0.5, 1.0, None),
    ]
    loss = json.loads((tmp_path / "switch" / "run.json").read_text())["loss"]
    assert loss == {"method": "ce_gppo", "eps_low": 0.2, "eps_high": 0.2, "agg": "token-mean", "tau": 0.5}


def test_update_settings_only_what_the_method_has():
    def cfg(**kw):
        lp = torch.zeros(1, 1)
        return policy_loss(lp, lp, torch.ones(1), torch.ones(1, 1, dtype=torch.bool), **kw).config

    assert update_settings(cfg(method="grpo")) == {}
    assert update_settings(cfg(method="ce_gppo", beta1=0.0)) == {"beta1": 0.0, "beta2": 1.0}
    h = torch.ones(1, 1)
    assert update_settings(cfg(method="dapo", entropy=h, old_entropy=h, erc=(0.9, 1.1), scale=0.5)) == {
        "erc_low": 0.9,
        "erc_high": 1.1,
        "loss_scale": 0.5,
    }


@pytest.mark.parametrize("beta1, shown", [(0.0, "beta1=0.0"), (0.25, "beta1=0.25")])
def test_report_shows_beta1_zero(beta1, shown):
    row = {
        "config": json.dumps({"method": "ce_gppo_b0", "loss_method": "ce_gppo", "beta1": beta1, "beta2": 1.0}),
        "eps_low": 0.2,
        "eps_high": 0.2,
    }
    assert shown in _hyper(row).split(", ")
    grpo = {"config": json.dumps({"method": "grpo", "beta1": 0.0}), "eps_low": 0.2, "eps_high": 0.2}
    assert "beta1" not in _hyper(grpo)
