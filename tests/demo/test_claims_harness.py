"""The paper-claims harness end to end on tiny real runs (slow), and its command line."""

import json

import pytest

from entropylens.demo.toy import claims

TINY = dict(steps=3, prompts=4, group=4, minibatches=2, epochs=1, sft_steps=2)


def test_unknown_regime_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        claims.main(["--regime", "fast,slow", "--out", "/nonexistent"])
    assert e.value.code == 2
    assert "unknown regime 'slow'; known: fast, paper" in capsys.readouterr().err


def test_no_train_refuses_missing_runs(tmp_path):
    with pytest.raises(SystemExit, match="runs not finished: grpo-s0"):
        claims.main(["--regime", "paper", "--out", str(tmp_path), "--seeds", "1", "--no-train"])


@pytest.mark.slow
def test_harness_on_tiny_runs(tmp_path):
    dirs = {"fast": tmp_path / "runs" / "fast", "paper": tmp_path / "runs" / "paper"}
    claims.train_all(dirs, 2, 2, **TINY)
    for regime, d in dirs.items():
        runs = sorted(p.name for p in d.iterdir() if p.is_dir())
        assert runs == sorted(f"{n}-s{s}" for n in claims.CONFIGS for s in range(2))
        assert set(claims.timings(d)) == set(runs)
        assert all(v["wall"] > 0 and v["cpu"] > 0 for v in claims.timings(d).values())
        cfg = json.loads((d / "grpo-s1" / "run.json").read_text())["config"]
        assert cfg["regime"] == regime and cfg["seed"] == 1 and cfg["steps"] == TINY["steps"]
    from entropylens.read.query import connect

    con = connect(dirs["paper"])
    metrics = claims.per_run_metrics(con)
    assert len(metrics) == 2 * len(claims.CONFIGS)
    m = metrics["grpo-s0"]
    assert m["grad_clip"] == 3.0 and m["seed"] == 0 and 0.0 <= m["gclip_share"] <= 1.0
    assert isinstance(m["destabilised"], bool) and m["kl"] >= 0
    found = claims.evaluate(con, metrics)
    assert [c.key for c in found][:8] == [str(i) for i in range(1, 9)]
    rows = claims.compare.method_rows(claims.by_config(metrics), "grpo", order=claims.CONFIGS)
    assert [r["method"] for r in rows] == list(claims.CONFIGS)  # grpo first already
    claims.figures(con, tmp_path, "paper", found, rows)
    for stem in [c.figure for c in found] + ["methods-entropy", "methods-reward"]:
        assert (tmp_path / f"paper-claims-paper-{stem}.png").stat().st_size > 1000
    from entropylens.demo.toy.beside import token_entropy_shares

    shares = token_entropy_shares(con, {r: m["config"] for r, m in metrics.items()})
    assert set(shares) == set(claims.CONFIGS)
    from entropylens.demo.toy.beside import mismatch_summary

    mm = mismatch_summary(con, {r: m["config"] for r, m in metrics.items()})
    assert all(x != x for x in mm["grpo"]["kl_k3"]) and all(x == x for x in mm["grpo"]["clipped"])  # no sampler: NaN
    # kl_k3 of a mismatched run from its token rows (a second path to the steps' aggregate): per step
    # mean(exp(d) - 1 - d) over the tokens with d = old_logprob - sampler_logprob, then the mean over steps
    by_tokens = con.execute(
        "SELECT avg(k) FROM (SELECT step, avg(exp(sampler_log_ratio) - 1 - sampler_log_ratio) AS k "
        "FROM tokens WHERE run = 'grpo_mismatch_tis-s1' GROUP BY step)"
    ).fetchone()[0]
    assert mm["grpo_mismatch_tis"]["kl_k3"][1] == pytest.approx(by_tokens, rel=1e-4) and by_tokens > 1e-3
    res = claims.regime_result(
        "paper",
        metrics,
        found,
        seeds=2,
        steps=TINY["steps"],
        workers=2,
        minutes=1.0,
        core_minutes=2.0,
        rows=rows,
        shares=shares,
        mismatch=mm,
    )
    assert res["reduced"] and res["settings"]["lr"] == 2e-4
    (tmp_path / "paper-claims-paper.json").write_text(json.dumps(res, default=float))
    text = claims.write_markdown(tmp_path).read_text()
    assert (
        "paper (REDUCED: 2 seeds x 3 steps)" in text and "![clipped-prob](paper-claims-paper-clipped-prob.png)" in text
    )
    for n in claims.CONFIGS:  # one line a method in the methods table
        assert sum(line.startswith(f"| {n} | loss ") for line in text.splitlines()) == 1, n
    assert "## Token-entropy shares beside the 80/20 paper" in text
    assert "## Training-inference mismatch in the lab" in text
    assert "clipped share, grpo_mismatch_tis against grpo_mismatch: difference" in text
