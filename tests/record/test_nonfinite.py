"""NaN and inf given to record_step are stored as they are: Parquet keeps them, DuckDB reads them,
the analyses show them; the recorder's own "not measured" aggregates stay null; one warning per run;
a NaN, infinite or negative lr is refused."""

import math
import warnings

import pyarrow.parquet as pq
import pytest
import torch

from entropylens import Recorder
from entropylens.alarms import NonFiniteWarning
from entropylens.read.query import connect, list_analyses, run_analysis, run_sql
from entropylens.record.writing.parquet import nan_is_null, steps_table, steps_table_by_values
from entropylens.rl.aggregates import AGG_NAMES

NAN, INF = float("nan"), float("inf")


def _update(rec, step, update=0):
    lp = torch.full((2, 3), -0.5)
    rec.record_update(
        step,
        update,
        mask=torch.ones(2, 3, dtype=torch.bool),
        advantages=torch.tensor([1.0, -1.0]),
        logprobs=lp,
        old_logprobs=lp,
        old_entropy=torch.full((2, 3), 1.0),
        seq_ids=torch.tensor([0, 1]) + 2 * update + 4 * step,
    )


def _steps(run_dir, step):
    return pq.read_table(run_dir / "steps" / f"step={step}" / "rank=0" / "steps.parquet").to_pylist()


def test_user_scalars_keep_nan_and_inf_aggregates_not_measured_stay_null(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        with Recorder(tmp_path, run="r", fsync=False) as rec:
            _update(rec, 0, 0)
            rec.record_step(0, update=0, grad_norm=NAN, lr=1e-3, my_metric=INF, other=-INF)
            _update(rec, 0, 1)
            rec.record_step(0, update=1, grad_norm=2.0, lr=1e-3)
            _update(rec, 1)
            rec.record_step(1, grad_norm=torch.tensor(NAN), reward_mean=NAN)  # a whole-step value: every row
    rows = _steps(tmp_path / "r", 0)
    assert math.isnan(rows[0]["grad_norm"]) and rows[1]["grad_norm"] == 2.0
    assert rows[0]["my_metric"] == INF and rows[0]["other"] == -INF and rows[1]["my_metric"] is None
    # not measured: no entropy= (entropy_mean), no loss=, no watch_logits (lgn_mean_*), no ERC: null, not NaN
    for name in ("entropy_mean", "loss", "lgn_mean_pa_hp", "erc_drop_frac", "entropy_effect"):
        assert rows[0][name] is None, name
    assert rows[0]["old_entropy_mean"] == 1.0
    row1 = _steps(tmp_path / "r", 1)[0]
    assert math.isnan(row1["grad_norm"]) and math.isnan(row1["reward_mean"])
    con = connect(tmp_path)
    got = run_sql(
        con,
        'SELECT step, "update", isnan(grad_norm) AS nan, grad_norm IS NULL AS null, '
        'entropy_mean IS NULL AS h_null FROM steps ORDER BY step, "update"',
    )
    assert got[["nan", "null", "h_null"]].values.tolist() == [
        [True, False, True],
        [False, False, True],
        [True, False, True],
    ]
    # step_health: avg over a NaN is NaN (visible, not dropped)
    health = run_analysis(con, "step_health")
    assert health["grad_norm"].map(math.isnan).tolist() == [True, True]


def test_every_analysis_and_the_report_summary_survive_a_nan_run(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        with Recorder(tmp_path, run="r", fsync=False) as rec:
            for step in range(3):
                _update(rec, step)
                rec.record_step(step, update=0, grad_norm=NAN if step == 1 else 1.0, lr=1e-3, acc=NAN)
    con = connect(tmp_path)
    for name, _ in list_analyses():
        run_analysis(con, name)  # none fails
    summary = run_analysis(con, "run_summary")
    assert summary["steps"].tolist() == [3]
    from entropylens.report import captions, plots

    by_step = run_analysis(con, "grad_norm_by_step")
    assert isinstance(captions.grad_norm(by_step), str)
    plots.grad_norm_vs_step(by_step)


def test_one_warning_per_run_naming_the_step_and_the_value(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run="w", fsync=False) as rec:
            for step in range(4):
                _update(rec, step)
                rec.record_step(
                    step, update=0, grad_norm=1.0 if step < 2 else NAN, loss_scale_seen=INF if step == 3 else 1.0
                )
    got = [w for w in caught if issubclass(w.category, NonFiniteWarning)]
    assert len(got) == 1
    assert str(got[0].message).startswith(
        "entropylens: record_step(2, update=0) recorded grad_norm=nan, stored as it is"
    )
    assert got[0].filename == __file__  # the user's line


def test_a_device_scalar_is_checked_once_its_copy_lands(tmp_path, monkeypatch):
    # CPU tensors take the CUDA path (a non-blocking HostCopy the writer thread reads): stored NaN, warned
    import entropylens.record.training.steps as recorder  # where record_step reads it

    monkeypatch.setattr(recorder, "_DEFERRED_DEVICES", ("cuda", "cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run="d", fsync=False) as rec:
            _update(rec, 0)
            rec.record_step(0, update=0, grad_norm=torch.tensor(NAN), lr=torch.tensor(1e-3))
    assert math.isnan(_steps(tmp_path / "d", 0)[0]["grad_norm"])
    assert [str(w.message)[:48] for w in caught if issubclass(w.category, NonFiniteWarning)] == [
        "entropylens: record_step(0, update=0) recorded g"
    ]


@pytest.mark.parametrize("lr", [NAN, INF, -INF, -1e-3, torch.tensor(NAN)])
def test_a_broken_lr_is_refused(tmp_path, lr):
    with Recorder(tmp_path, run="lr", fsync=False) as rec:
        _update(rec, 0)
        with pytest.raises(ValueError, match=r"^record_step\(0\): lr must be a finite number >= 0, got ") as e:
            rec.record_step(0, update=0, lr=lr)
        assert "\n" not in str(e.value)
        rec.record_step(0, update=0, lr=0.0, grad_norm=1.0)  # lr 0 (warm-up) is fine; the recorder goes on
    assert _steps(tmp_path / "lr", 0)[0]["lr"] == 0.0


def test_only_the_recorders_aggregates_turn_nan_into_null():
    assert all(nan_is_null(n) for n in AGG_NAMES if n != "loss")
    assert not nan_is_null("loss")  # the caller's loss: left out of the row when not given, its NaN kept
    assert not any(nan_is_null(n) for n in ("grad_norm", "lr", "reward_mean", "beta1", "erc_low", "my_metric"))
    rows = [
        {"update": 0, "n_tokens": 4.0, "entropy_mean": NAN, "grad_norm": NAN, "acc": INF, "m": NAN},
        {"update": 1, "n_tokens": 4.0, "entropy_mean": 1.0, "grad_norm": None, "acc": 1.0},
    ]
    fast, slow = steps_table(rows), steps_table_by_values(rows)
    assert fast.schema == slow.schema
    for table in (fast, slow):
        assert table.column("entropy_mean").to_pylist() == [None, 1.0]
        g = table.column("grad_norm").to_pylist()
        assert math.isnan(g[0]) and g[1] is None
        assert table.column("acc").to_pylist() == [INF, 1.0]
        m = table.column("m").to_pylist()
        assert math.isnan(m[0]) and m[1] is None


def test_a_nan_loss_from_record_update_is_stored_and_fires_nonfinite(tmp_path):
    """record_update(loss=...) with a NaN loss value: stored as NaN (a blow-up), found by `check`; an update
    without loss= stays null (not measured)."""
    from types import SimpleNamespace

    from entropylens.report.checks import check
    from entropylens.rl.losses import policy_loss

    lp = torch.full((2, 3), -0.5)
    mask, adv = torch.ones(2, 3, dtype=torch.bool), torch.tensor([1.0, -1.0])
    with Recorder(tmp_path, run="r", fsync=False) as rec:
        for step in range(3):
            out = policy_loss(lp, lp, adv, mask)
            if step == 2:  # the same columns, the loss value a blow-up
                out = SimpleNamespace(loss=torch.tensor(NAN), columns=out.columns, config=out.config)
            rec.record_update(
                step,
                0,
                mask=mask,
                advantages=adv,
                logprobs=lp,
                old_logprobs=lp,
                old_entropy=torch.full((2, 3), 1.0),
                seq_ids=torch.tensor([0, 1]) + 2 * step,
                loss=out,
            )
        _update(rec, 3)  # no loss=
    assert _steps(tmp_path / "r", 0)[0]["loss"] == pytest.approx(float(policy_loss(lp, lp, adv, mask).loss))
    assert math.isnan(_steps(tmp_path / "r", 2)[0]["loss"]) and _steps(tmp_path / "r", 3)[0]["loss"] is None
    found = [(f.step, f.rule, f.signal) for f in check(tmp_path)]
    assert (2, "nonfinite", "loss") in found and not any(s in (0, 1, 3) for s, rule, _ in found if rule == "nonfinite")
