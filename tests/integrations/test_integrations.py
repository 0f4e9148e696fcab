"""Real trainers: the plain-PyTorch example and TRL's GRPOTrainer (tiny Qwen2, local tokenizer, CPU)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from entropylens.read.query import connect

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


def check_consistent(con, tau=0.5):
    t = con.execute("SELECT * FROM tokens").df()
    assert len(t) > 0
    assert (t["entropy"] >= 0).all() and (t["old_entropy"] >= 0).all()
    # two code paths per update: the device aggregates of the steps row against the stored token rows
    # (the views' ratio / entropy_ratio come from the stored log-probs and entropies)
    got = con.execute("""SELECT s.ratio_mean, t.r, s.entropy_ratio_p50, t.rho50, s.n_tokens, t.n FROM steps s
        JOIN (SELECT run, step, update, rank, avg(ratio) AS r, median(entropy_ratio) AS rho50, count(*) AS n
              FROM tokens GROUP BY ALL) t USING (run, step, update, rank)""").fetchall()
    assert got
    for ratio_mean, r, p50, rho50, n_tokens, n in got:
        assert n_tokens == n
        assert ratio_mean == pytest.approx(r, rel=1e-5) and p50 == pytest.approx(rho50, rel=1e-5)
    a, p = t["advantage"].to_numpy(), t["prob"].to_numpy()
    quad = np.where(
        a == 0, "ZA", np.where(a > 0, np.where(p >= tau, "PA&HP", "PA&LP"), np.where(p >= tau, "NA&HP", "NA&LP"))
    )
    assert (t["quadrant"].to_numpy() == quad).all()
    assert t["logit_grad_norm"].notna().all()
    return t


def test_torch_loop_example(tmp_path):
    import torch_loop

    run_dir = torch_loop.main(["--out", str(tmp_path), "--steps", "3"])
    con = connect(run_dir)
    check_consistent(con)
    assert con.execute("SELECT count(DISTINCT step), count(*) FROM steps").fetchone() == (3, 12)
    assert con.execute("SELECT count(*) FROM steps WHERE grad_norm IS NULL").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM sequences").fetchone()[0] == 3 * 64


def test_torch_loop_example_refuses_bad_options_before_any_run(tmp_path, capsys):
    """--method foo and --steps 0 are argparse usage errors: no traceback, and nothing is written (no empty
    failed run, no finished run with no steps)."""
    import pytest
    import torch_loop

    for bad in (["--method", "foo"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as e:
            torch_loop.main(["--out", str(tmp_path / "runs"), *bad])
        assert e.value.code == 2
        assert "error: argument" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_torch_loop_example_run_ids(tmp_path):
    """The example's default run id is new each time, as its refusal says: two runs side by side; a fixed
    --run is refused the second time, --overwrite replaces."""
    import pytest
    import torch_loop

    from entropylens.record.run_dir.run_claim import RunExistsError

    a = torch_loop.main(["--out", str(tmp_path), "--steps", "1"])
    b = torch_loop.main(["--out", str(tmp_path), "--steps", "1"])
    assert a != b and str(a).rsplit("/", 1)[-1].startswith("torch-loop-ce_gppo-")
    torch_loop.main(["--out", str(tmp_path), "--steps", "1", "--run", "fixed"])
    with pytest.raises(RunExistsError, match="default id is new each time"):
        torch_loop.main(["--out", str(tmp_path), "--steps", "1", "--run", "fixed"])
    torch_loop.main(["--out", str(tmp_path), "--steps", "2", "--run", "fixed", "--overwrite"])
    assert connect(tmp_path / "fixed").execute("SELECT count(DISTINCT step) FROM steps").fetchone()[0] == 2


def test_trl_grpo_trainer_records_every_step(tmp_path):
    import trl_grpo

    trainer = trl_grpo.main(["--out", str(tmp_path), "--steps", "3", "--run", "trl"])
    con = connect(tmp_path / "trl")
    t = check_consistent(con)
    assert sorted(t["step"].unique().tolist()) == [0, 1, 2]
    assert con.execute("SELECT count(*) FROM steps WHERE grad_norm IS NULL OR lr IS NULL").fetchone()[0] == 0
    # num_iterations = 2: the old policy differs from the new one on the reused batch
    assert (t["ratio"] - 1).abs().max() > 1e-4
    assert (t["entropy_ratio"] - 1).abs().max() > 1e-5
    # sequences join the tokens by run-unique seq ids
    joined = con.execute("""SELECT count(*) FROM tokens t JOIN sequences s USING (run, seq)""").fetchone()[0]
    assert joined == len(t)
    assert con.execute("SELECT status, method FROM runs").fetchall() == [
        ("finished", "trl-dapo")
    ]  # TRL 1.16 defaults to loss_type="dapo"
    logged = [h for h in trainer.state.log_history if "entropylens/entropy_ratio_p50" in h]
    assert logged and "entropylens/share_pa_lp" in logged[0]


def test_trl_with_ce_gppo_and_erc_trains(tmp_path):
    import trl_grpo

    trainer = trl_grpo.make_trainer(str(tmp_path), loss="ce_gppo", steps=3, run="ce")
    trainer.train()
    con = connect(tmp_path / "ce")
    t = check_consistent(con)
    assert t["erc_kept"].notna().all()
    np.testing.assert_array_equal(t["erc_kept"], (t["entropy_ratio"] > 0.95) & (t["entropy_ratio"] < 1.05))
    # every row against CE-GPPO's closed form (eps 0.2, beta1 0.5 low side, beta2 1 high side, ERC drops g),
    # normalised as TRL's default loss_type dapo: by the accumulation window's completion tokens (the
    # step's two micro-batches: num_items_in_batch / processes * GA / steps_per_generation, GA = 2 = spg):
    a, r, clip = t["advantage"].to_numpy(), t["ratio"].to_numpy(), t["clip"].to_numpy()
    g = np.where((clip == -1) & (a < 0), -0.5 * 0.8 * a, np.where((clip == 1) & (a > 0), -1.0 * 1.2 * a, -a * r))
    g = np.where(t["erc_kept"], g, 0.0)
    n = t.groupby("step")["seq"].transform("size").to_numpy()
    np.testing.assert_allclose(t["grad_coef"], g / n, rtol=1e-4, atol=1e-9)
    assert (t["ratio"] - 1).abs().max() > 1e-4  # reused batches: r != 1 enters -A r
    # the exact logit-gradient norm (hook on TRL's fused log-probs, closed form) bounds: (1-p)|g| <= . <= sqrt 2 |g|
    gc, lgn, p = t["grad_coef"].abs(), t["logit_grad_norm"], np.exp(t["logprob"])
    assert (lgn >= (1 - p) * gc * (1 - 1e-5) - 1e-12).all() and (lgn <= np.sqrt(2) * gc * (1 + 1e-5) + 1e-12).all()
    cfg = con.execute("SELECT method, eps_low, eps_high FROM runs").fetchone()
    assert cfg == ("ce_gppo", 0.2, 0.2)


def test_trl_version_check():
    from entropylens.integrations.trl import check_trl_version

    with pytest.raises(RuntimeError, match="supports TRL 1.16.x; found 0.19.1"):
        check_trl_version("0.19.1")
    assert check_trl_version("1.16.3") == "1.16.3"
    with pytest.raises(ValueError, match="erc needs loss"):
        import trl_grpo

        from entropylens.integrations.trl import EntropyLensGRPOTrainer

        EntropyLensGRPOTrainer(model=None, reward_funcs=trl_grpo.digit_reward, erc=(0.95, 1.05))
