"""The toy lab's method registry: every method trains one tiny step and records what its loss used;
unknown names fail with the known ones listed; adding a method is one entry."""

import json
import subprocess
import sys

import pytest

from entropylens.demo.toy import config_for, methods, train
from entropylens.read.query import connect

TINY = dict(steps=1, prompts=2, group=2, minibatches=1, epochs=1, sft_steps=0)
# one instance of each family, beside every named method
NAMES = [
    *methods.REGISTRY,
    "entropy_bonus_0.003",
    "ce_gppo_0.75_1",
    "dual_clip_3",
    "forking_0.5",
    "adaptive_entropy_0.5",
    "clip_cov_0.01",
    "kl_cov_0.01",
]
# ToyConfig field -> the steps column the loss writes it to (losses.update_settings)
STEP_COLUMNS = {"beta1": "beta1", "beta2": "beta2", "dual_clip": "dual_clip", "entropy_coef": "entropy_coef"}


@pytest.mark.parametrize("name", NAMES)
def test_every_method_trains_one_tiny_step_and_records(tmp_path, name):
    cfg = config_for(name, **TINY)
    res = train(cfg, tmp_path, run="r")
    meta = json.loads((res.path / "run.json").read_text())
    assert meta["status"] == "finished" and meta["config"]["method"] == name
    assert meta["loss"]["method"] == cfg.method  # the loss the recorder saw
    con = connect(tmp_path)
    steps = con.execute("SELECT * FROM steps WHERE grad_norm IS NOT NULL").df()
    assert len(steps) == cfg.updates and (steps["n_tokens"] > 0).all()
    assert con.execute("SELECT count(*) FROM tokens").fetchone()[0] > 0
    # every option the entry sets reached the loss: its resolved eps in run.json, its settings in the steps rows
    settings = methods.settings(meta["config"])
    assert settings["loss"] == cfg.method
    if cfg.method == "sapo":  # no clip band: the gate's temperatures, as the loss resolved them
        assert settings["sapo_tau"] == f"{meta['loss']['sapo_tau_pos']:g} / {meta['loss']['sapo_tau_neg']:g}"
        assert "eps" not in settings
    elif cfg.method == "kl_cov":  # no clip band either: KL-Cov's settings (verl's defaults unless the entry's)
        from entropylens.rl import cov

        ratio = dict(cfg.loss_options).get("kl_cov_ratio", cov.KL_COV_RATIO)
        assert "eps" not in settings and settings["kl_cov_ratio"] == f"{ratio:g}" and settings["ppo_kl_coef"] == "0.1"
    else:
        assert settings["eps"] == f"{meta['loss']['eps_low']:g} / {meta['loss']['eps_high']:g}"
    assert settings["agg"] == meta["loss"]["agg"]
    for field, col in STEP_COLUMNS.items():
        if field == "entropy_coef" and cfg.entropy_target is not None:
            continue  # the adaptive coefficient: below
        if field in methods.lookup(name).options and (field not in ("beta1", "beta2") or cfg.method == "ce_gppo"):
            want = cfg.beta1_at(0) if field == "beta1" else getattr(cfg, field)
            assert steps[col].tolist() == pytest.approx([want] * len(steps)), col
    if cfg.top_entropy_quantile < 1:  # the forking mask: about q of the update's tokens keep the policy term
        n = int(steps["n_tokens"].iloc[0])
        kept = con.execute("SELECT avg(CAST(token_kept AS DOUBLE)) FROM tokens").fetchone()[0]
        assert abs(kept - cfg.top_entropy_quantile) <= 1 / n + 1e-9  # ties at the threshold are kept
        assert steps["token_masked_frac"].tolist() == pytest.approx([1 - kept])
    else:
        assert con.execute("SELECT count(token_kept) FROM tokens").fetchone()[0] == 0
    if cfg.entropy_target is not None:  # the controller's coefficient, recorded per update (it starts at 0)
        assert steps["entropy_coef_adaptive"].tolist() == pytest.approx([cfg.entropy_coef])
    else:
        assert steps["entropy_coef_adaptive"].isna().all()
    # Clip-Cov / KL-Cov: per update max(int(ratio x n), 1) tokens selected (verl's rule)
    if cfg.method == "clip_cov":  # among the candidates: not PPO-clipped, 1 < cov < 5 (none in band: none)
        n_sel, n_band = con.execute(
            "SELECT count_if(cov_clipped), count_if(cov > 1 AND cov < 5 AND NOT clipped) FROM tokens"
        ).fetchone()
        assert n_sel == min(max(int(float(settings["clip_cov_ratio"]) * int(steps["n_tokens"].iloc[0])), 1), n_band)
        assert steps["cov_clipped_frac"].tolist() == pytest.approx([n_sel / steps["n_tokens"].iloc[0]])
    if cfg.method == "kl_cov":  # the top max(int(ratio x n), 1) tokens by cov
        n = steps["n_tokens"]
        want = [max(int(float(settings["kl_cov_ratio"]) * int(k)), 1) for k in n]
        assert (steps["kl_cov_frac"] * n).round().tolist() == want
    if cfg.erc is not None:
        assert steps["erc_low"].tolist() == pytest.approx([cfg.erc[0]]) and steps["erc_high"].tolist() == pytest.approx(
            [cfg.erc[1]]
        )
        assert steps["erc_drop_frac"].notna().all()


def test_unknown_method_lists_the_known_ones(tmp_path):
    with pytest.raises(ValueError) as e:
        config_for("clip_kov")
    msg = str(e.value)
    assert msg.startswith("unknown run 'clip_kov'; known: ") and "\n" not in msg
    for n in methods.names():
        assert n in msg
    cmd = [sys.executable, "-m", "entropylens.cli.main", "demo", "--methods", "grpo,clip_kov", "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0].startswith("error: --methods: unknown method 'clip_kov'; known: grpo, dapo")
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_claims_lab_refuses_an_unknown_method(capsys):
    from entropylens.demo.toy import claims

    with pytest.raises(SystemExit) as e:
        claims.main(["--methods", "grpo,nope", "--out", "/nonexistent"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--methods: unknown method 'nope'; known: grpo" in err
    with pytest.raises(SystemExit):
        claims.main(["--methods", "dapo", "--out", "/nonexistent"])  # the baseline (grpo) not among them
    assert "--baseline 'grpo' is not among --methods" in capsys.readouterr().err


def test_list_methods_names_every_entry():
    from entropylens.cli.main import app
    from typer.testing import CliRunner

    res = CliRunner().invoke(app, ["demo", "--list-methods"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert len(lines) == len(methods.listing())
    for line, m in zip(lines, methods.listing()):
        assert line.startswith(f"{m.name}: {m.description}.") and m.paper in line


def test_adding_a_method_is_one_entry(tmp_path, monkeypatch):
    """A new entry is a --methods name at once, and its loss options reach policy_loss: TRL's delta clamp
    (delta 1.05 < 1 + eps_high) makes the loss write its dual_clipped column, which plain grpo does not."""
    entry = methods.Method(
        "grpo_delta",
        dict(method="grpo", loss_options=dict(delta=1.05)),
        "GRPO with TRL's upper clamp of the ratio at 1.05",
        "INTELLECT-2 (arXiv 2505.07291)",
    )
    monkeypatch.setitem(methods.REGISTRY, entry.name, entry)
    assert "grpo_delta" in methods.names()
    cfg = config_for("grpo_delta", **TINY)
    assert cfg.loss_options == (("delta", 1.05),)
    for name in ("grpo", "grpo_delta"):
        train(config_for(name, **TINY), tmp_path, run=name)
    con = connect(tmp_path)
    kept = dict(con.execute("SELECT run, count(dual_clipped) FROM tokens GROUP BY run").fetchall())
    assert kept["grpo"] == 0 and kept["grpo_delta"] > 0
    meta = json.loads((tmp_path / "grpo_delta" / "run.json").read_text())
    assert methods.settings(meta["config"])["delta"] == "1.05"
    with pytest.raises(ValueError, match="registered already"):
        methods.register(methods.Method("grpo", {}, "", ""))
    with pytest.raises(ValueError, match="registered already"):
        methods.register(methods.Method("entropy_bonus_0.1", {}, "", ""))  # a family's name


def test_loss_options_must_be_policy_loss_options():
    with pytest.raises(ValueError, match=r"loss_options: 'clip_ratio' is not a policy_loss option; valid: .*delta"):
        config_for("grpo", loss_options=(("clip_ratio", 0.2),))
    with pytest.raises(ValueError, match="'token_mask' is not a policy_loss option"):  # a tensor: the loop's
        config_for("grpo", loss_options=(("token_mask", None),))
    with pytest.raises(ValueError, match="'eps_low' is not a policy_loss option"):  # a ToyConfig field sets it
        config_for("grpo", loss_options=(("eps_low", 0.1),))


def test_settings_resolve_defaults_and_list_only_what_applies():
    def rec(name):  # as run.json records it: method = the run's name, loss_method = the loss
        cfg = config_for(name)
        return {**cfg.to_dict(), "method": name, "loss_method": cfg.method}

    assert methods.loss_part(methods.settings(rec("grpo"))) == {"loss": "grpo", "eps": "0.2 / 0.2", "agg": "token-mean"}
    assert methods.loss_part(methods.settings(rec("gspo"))) == {
        "loss": "gspo",
        "eps": "0.0003 / 0.0004",
        "agg": "seq-mean-token-mean",
    }
    s = methods.settings(rec("ce_gppo_switch"))
    assert (s["beta1"], s["beta2"], s["beta1_schedule"]) == ("0", "1", "step 60: 0.5")
    assert "beta1" not in methods.settings(rec("dapo"))  # beta1 applies to ce_gppo only
    assert methods.differs_text(methods.settings(rec("erc_dapo")), methods.settings(rec("grpo")), "grpo") == (
        "loss dapo (grpo: grpo); eps 0.2 / 0.28 (grpo: 0.2 / 0.2); erc (0.95, 1.05) (grpo: -)"
    )
    paper = {**rec("grpo"), "lr": 2e-4}
    assert methods.differs(methods.settings(paper), methods.settings(rec("grpo"))) == {"lr": ("0.0002", "0.0007")}


@pytest.mark.slow  # every method of the registry through `entropylens demo`, then its report (minutes on 2 cores)
def test_demo_runs_every_method(tmp_path):
    from entropylens.cli.main import app
    from typer.testing import CliRunner

    res = CliRunner().invoke(
        app, ["demo", "--quick", "--steps", "2", "--methods", ",".join(NAMES), "--workers", "2", "--out", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(f"{n}-s0" for n in NAMES)
    con = connect(tmp_path / "runs")
    assert dict(con.execute("SELECT method, count(*) FROM runs GROUP BY method").fetchall()) == {n: 1 for n in NAMES}
    assert con.execute("SELECT DISTINCT status FROM runs").fetchall() == [("finished",)]
    md = (tmp_path / "report" / "report.md").read_text()
    for n in NAMES:
        assert f"| {n}-s0 |" in md


def test_adaptive_entropy_coefficient_moves_in_the_toy(tmp_path):
    """A target above any entropy (10 nats, the toy's maximum is log 32 = 3.47): every optimizer step measures
    H <= target, so the coefficient rises by delta each step. 2 steps x 2 updates = 4 optimizer steps:
      c before each update (entropy_coef_adaptive): 0, 0.005, 0.010, 0.015;
      applied (entropy_coef): 0 at the first update (no step measured yet: H_-1 = inf > target), then c."""
    cfg = config_for("adaptive_entropy_10", steps=2, prompts=2, group=2, minibatches=2, epochs=1, sft_steps=0)
    assert cfg.updates == 2
    train(cfg, tmp_path, run="r")
    steps = (
        connect(tmp_path)
        .execute(
            "SELECT entropy_coef, entropy_coef_adaptive FROM steps WHERE grad_norm IS NOT NULL ORDER BY step, update"
        )
        .df()
    )
    assert steps["entropy_coef_adaptive"].tolist() == pytest.approx([0.0, 0.005, 0.010, 0.015])
    assert steps["entropy_coef"].fillna(0.0).tolist() == pytest.approx([0.0, 0.005, 0.010, 0.015])


def test_forking_and_adaptive_refuse_the_probe():
    with pytest.raises(ValueError, match="probe_every: the probe's update does not apply top_entropy_quantile"):
        config_for("forking", probe_every=2)
    with pytest.raises(ValueError, match="top_entropy_quantile must lie in"):
        config_for("forking_1.5")
