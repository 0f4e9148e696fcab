"""The report is right for a user's own runs (tests/user_runs.py), not only for the demo's.

Every number a caption states is computed here again from what the fixture recorded.
"""

from __future__ import annotations

import json
import re
from html import unescape

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import user_runs
from entropylens.cli.main import app
from typer.testing import CliRunner

from entropylens.report import runset
from entropylens.report.build import write_report


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    return user_runs.build(tmp_path_factory.mktemp("user") / "runs")


def captions_of(index) -> dict[str, str]:
    """{figure id: its caption text} from the report's index.html."""
    page = index.read_text()
    out = {}
    for fid, cap in re.findall(r'<figure id="([^"]+)">.*?<figcaption>(.*?)</figcaption>', page, re.S):
        out[fid] = unescape(re.sub(r"<[^>]+>", "", cap))
    out["comparison"] = unescape(re.search(r'<p id="comparison">(.*?)</p>', page, re.S).group(1))
    return out


def _g(v) -> str:
    return f"{v:.3g}"


def test_per_run_lines_and_captions_tell_an_lr_sweep_apart(user, tmp_path):
    root, exp = user
    caps = captions_of(write_report(root, tmp_path / "rep"))
    for run in ("grpo-lr1e-3", "grpo-lr3e-3"):  # one method, two learning rates: two entries
        first, last = exp[run]["old_entropy"][0], exp[run]["old_entropy"][user_runs.STEPS - 1]
        assert f"{run} {_g(first)} -> {_g(last)}" in caps["entropy"], caps["entropy"]
    # the sweep differs in lr and the ERC run in its method: no verdict against the paper
    assert "not a controlled comparison" in caps["entropy"] and "paper's direction" not in caps["entropy"]
    # the method factor names the method-defining setting that differs (the ERC band)
    assert "differ in method (dapo erc=(0.9, 1.1), grpo) and lr (0.001, 0.003)" in caps["comparison"]


def test_erc_band_is_each_runs_own(user, tmp_path):
    root, exp = user
    caps = captions_of(write_report(root, tmp_path / "rep"))
    text = caps["entropy_ratio"]
    # erc-band recorded erc=(0.9, 1.1): measured against it, and the runs without ERC against the same band
    lo, hi = 0.9, 1.1
    for run, e in exp.items():
        rho = e["rho"].astype(np.float32)  # the view computes rho in float32
        share = float(((rho <= np.float32(lo)) | (rho >= np.float32(hi))).mean())
        label = run if run.startswith(user_runs.RUNS[run]["method"]) else f"{run} ({user_runs.RUNS[run]['method']})"
        whose = "its ERC band" if run == "erc-band" else "no ERC; band"
        assert f"{label} {100 * share:.1f}% outside ({whose} (0.9, 1.1)" in text, (run, text)
    assert "(0.95, 1.05)" not in text and "against the ERC runs' band (0.9, 1.1)" in text


def test_paper_band_is_the_reference_only_without_erc_runs(user, tmp_path):
    root, exp = user
    caps = captions_of(write_report(root, tmp_path / "rep", runs=["grpo-lr1e-3", "stable"]))
    e = exp["grpo-lr1e-3"]
    share = float(((e["rho"].astype(np.float32) <= 0.95) | (e["rho"].astype(np.float32) >= 1.05)).mean())
    assert f"grpo-lr1e-3 {100 * share:.1f}% outside (no ERC; band (0.95, 1.05)" in caps["entropy_ratio"]
    assert "the ERC paper's band (0.95, 1.05)" in caps["entropy_ratio"]


def test_a_controlled_comparison_is_named(user, tmp_path):
    root, _ = user
    caps = captions_of(write_report(root, tmp_path / "rep", runs=["grpo-lr1e-3", "grpo-lr3e-3"]))
    assert caps["comparison"].startswith("2 runs, a controlled comparison in lr (0.001, 0.003)")
    assert (
        "The runs differ only in lr (0.001, 0.003): a controlled comparison of lr; the papers' verdicts "
        "compare methods, so none here."
    ) in caps["entropy"]
    assert "not a controlled comparison" not in caps["entropy"]


def test_method_verdict_only_when_only_the_method_differs(tmp_path):
    """A CE-GPPO run and a GRPO run recorded with the same settings but the method: the verdict is given;
    the same pair with different learning rates: none, and the caption says why."""
    spec = dict(lr=1e-3, decay=0.05)
    user_runs.record_run(tmp_path / "same", "grpo-a", {**spec, "method": "grpo"})
    user_runs.record_run(tmp_path / "same", "ce_gppo-a", {**spec, "method": "ce_gppo", "decay": 0.01})
    caps = captions_of(write_report(tmp_path / "same", tmp_path / "rep1"))
    assert "The runs differ only in the method: CE-GPPO is above GRPO / DAPO" in caps["entropy"], caps["entropy"]
    user_runs.record_run(tmp_path / "apart", "grpo-a", {**spec, "method": "grpo"})
    user_runs.record_run(tmp_path / "apart", "ce_gppo-a", {**spec, "method": "ce_gppo", "lr": 3e-3, "decay": 0.01})
    caps = captions_of(write_report(tmp_path / "apart", tmp_path / "rep2"))
    assert "CE-GPPO is above" not in caps["entropy"]
    assert "differ in method (ce_gppo, grpo) and lr (0.001, 0.003)" in caps["entropy"]


def test_group_by_lr_draws_the_mean_with_a_band(user, tmp_path):
    root, exp = user
    res = CliRunner().invoke(
        app, ["report", str(root), "--out", str(tmp_path / "rep"), "--group-by", "lr", "--band", "sd"]
    )
    assert res.exit_code == 0, res.output
    caps = captions_of(tmp_path / "rep" / "index.html")
    runs = [r for r, s in user_runs.RUNS.items() if s["lr"] == 1e-3]
    assert len(runs) == 5
    first = np.mean([exp[r]["old_entropy"][0] for r in runs])
    last = np.mean([exp[r]["old_entropy"][user_runs.STEPS - 1] for r in runs])
    assert f"lr=0.001 {_g(first)} -> {_g(last)}" in caps["entropy"], caps["entropy"]
    assert "band = +-1 sd over the runs" in caps["entropy"]
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| run | series | method |" in md and "| grpo-lr3e-3 | lr=0.003 |" in md


def test_group_by_an_unknown_key_is_one_line(user, tmp_path):
    root, _ = user
    res = CliRunner().invoke(app, ["report", str(root), "--out", str(tmp_path / "rep"), "--group-by", "lrr"])
    assert res.exit_code != 0 and "Traceback" not in res.output
    assert (
        "--group-by lrr: no run records that config key; keys: method, config, erc, lr, model, seed, steps"
        in res.output
    )


def test_group_by_config_pools_the_seeds_of_one_config(tmp_path):
    for seed in (0, 1, 2):
        user_runs.record_run(
            tmp_path / "runs", f"grpo-s{seed}", {"method": "grpo", "lr": 1e-3, "decay": 0.05}, seed=seed
        )
    user_runs.record_run(tmp_path / "runs", "grpo-fast", {"method": "grpo", "lr": 3e-3, "decay": 0.15})
    con_rs = runset.from_connection(__import__("entropylens").connect(tmp_path / "runs"), group_by="config")
    assert con_rs.series == {
        "grpo-s0": "grpo lr=0.001",
        "grpo-s1": "grpo lr=0.001",
        "grpo-s2": "grpo lr=0.001",
        "grpo-fast": "grpo lr=0.003",
    }
    caps = captions_of(write_report(tmp_path / "runs", tmp_path / "rep", group_by="config"))
    assert "Runs grouped (seeds of one config" in caps["comparison"] or "seeds of one config" in caps["comparison"]


def _long_run(root, steps: int = 5000):
    """One run of ``steps`` steps, its steps table written as one compacted file (as `entropylens compact`
    leaves a long run): entropy 2 exp(-s / 2000) + 0.1 plus N(0, 0.05) noise."""
    from entropylens.record.writing.parquet import steps_table

    d = root / "long"
    (d / "compacted" / "steps").mkdir(parents=True)
    (d / "run.json").write_text(
        json.dumps(
            {
                "run": "long",
                "method": "grpo",
                "status": "finished",
                "eps_low": 0.2,
                "eps_high": 0.2,
                "tau": 0.5,
                "schema_version": 2,
                "config": {"method": "grpo", "lr": 1e-3},
            }
        )
    )
    rng = np.random.default_rng(0)
    h = 2.0 * np.exp(-np.arange(steps) / 2000) + 0.1 + 0.05 * rng.standard_normal(steps)
    rows = [
        {
            "update": 0,
            "n_tokens": 100,
            "entropy_mean": float(v),
            "old_entropy_mean": float(v),
            "grad_norm": 0.5,
            "kl_k3": 1e-3,
            "reward_mean": 0.5,
        }
        for v in h
    ]
    t = steps_table(rows)
    t = t.add_column(0, "rank", pa.array(np.zeros(steps, np.int16))).add_column(
        0, "step", pa.array(np.arange(steps, dtype=np.int32))
    )
    pq.write_table(t, d / "compacted" / "steps" / f"steps-0-{steps - 1}.parquet")
    return h


def test_a_long_run_is_smoothed_and_says_so(tmp_path):
    from entropylens.report import plots

    h = _long_run(tmp_path / "runs")
    w = plots.smooth_window(5000)
    assert w > 1
    caps = captions_of(write_report(tmp_path / "runs", tmp_path / "rep"))
    assert f"rolling mean of {w} steps" in caps["entropy"]
    # the ends of a long run: means over the first and last w steps (float32 as stored)
    h = h.astype(np.float32).astype(np.float64)
    assert (
        f"first -> last {w} steps (nats): long (grpo) {_g(h[:w].mean())} -> {_g(h[-w:].mean())}" in caps["entropy"]
    ), caps["entropy"]


def test_check_over_the_user_runs_names_what_is_wrong(user):
    """`entropylens check` on the fixture: the NaN grad norm, the zero-advantage run, the collapsing lr
    and nothing on the stable run (the rules' own tests are tests/test_alarm_rules.py)."""
    root, exp = user
    runs = ["grpo-lr3e-3", "nan-grad", "zero-adv", "stable"]
    res = CliRunner().invoke(app, ["check", str(root), *sum((["--run", r] for r in runs), [])])
    assert res.exit_code == 1, res.output
    lines = [x for x in res.output.splitlines() if not x.startswith("note: ")]
    noted = [x for x in res.output.splitlines() if x.startswith("note: ")]
    # stable updates on the sampling policy (every ratio 1): a note, not an alarm
    assert [x.split(" signal=")[0] for x in noted] == ["note: run=stable step=0 rule=on_policy value=0 threshold=0"], (
        noted
    )
    h = exp["grpo-lr3e-3"]["old_entropy"]
    base = 0.25 * np.mean([h[s] for s in range(3)])  # collapse: below 0.25 x the mean of the first 3 steps
    first = min(s for s in range(3, user_runs.STEPS) if h[s] < base)
    assert any(x.startswith(f"run=grpo-lr3e-3 step={first} rule=collapse") for x in lines), lines
    assert f"run=nan-grad step={user_runs.NAN_STEP} rule=nonfinite value=nan" in res.output
    # zero-adv: 6 of 8 responses (3 groups of 2) with A = 0 at every step: no learning signal from step 2 on
    assert any(x.startswith("run=zero-adv step=2 rule=no_signal") for x in lines), lines
    assert not any("run=stable" in x for x in lines)
    assert len(lines) == 3, lines
    quiet = CliRunner().invoke(app, ["check", str(root), "--run", "stable"])
    assert quiet.exit_code == 0 and "no alarm" in quiet.output and "rule=on_policy" in quiet.output


def test_a_series_mixing_erc_and_plain_runs_says_so(user, tmp_path):
    root, _ = user
    caps = captions_of(write_report(root, tmp_path / "rep", group_by="lr"))
    # lr=0.001 holds erc-band and four runs without ERC: the caption says so, not "its ERC band"
    assert "lr=0.001" in caps["entropy_ratio"] and "ERC in 1 of 5 runs; band (0.9, 1.1)" in caps["entropy_ratio"]
    by_method = runset.from_connection(__import__("entropylens").connect(root), group_by="method")
    assert by_method.series["erc-band"] == "dapo erc=(0.9, 1.1)" and by_method.series["stable"] == "grpo"
