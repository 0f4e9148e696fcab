"""Recorder: rows, exact aggregates, hooks, sampling, bad input, writer failures. Real files."""

import json
import warnings

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from recorded_batches import B, T, V, make_batch, record_one  # noqa: E402,F401

from entropylens import SCHEMA_VERSION, Recorder
from entropylens.read.query import connect
from entropylens.record.recorder import RecorderError
from entropylens.rl import stats
from entropylens.rl.losses import policy_loss
from entropylens.schema import QUADRANT_NAMES


def test_rows_columns_and_hook(tmp_path):
    with Recorder(tmp_path, run="r", config={"method": "ce_gppo"}) as rec:
        logits, tokens, mask, out = record_one(rec, 0, 0, erc=(0.95, 1.05), method="ce_gppo")
        assert not rec.has_hook  # the hook removed itself when it fired
        assert not logits._backward_hooks  # and left no handle on the tensor
        lgn_autograd = logits.grad.norm(dim=-1)  # ||dLoss/dz_t||, plain autograd
    con = connect(tmp_path)
    df = con.execute("SELECT * FROM tokens ORDER BY seq, pos").df()
    assert len(df) == int(mask.sum())  # only masked-in tokens
    sel = mask.numpy()
    for col in ("ratio", "grad_coef", "prob", "entropy_ratio"):
        np.testing.assert_allclose(df[col].to_numpy(), out.columns[col].numpy()[sel], rtol=1e-6)
    np.testing.assert_array_equal(df["clip"].to_numpy(), out.columns["clip"].numpy()[sel])
    np.testing.assert_array_equal(df["erc_kept"].to_numpy(), out.columns["erc_kept"].numpy()[sel])
    names = [QUADRANT_NAMES[int(q)] for q in out.columns["quadrant"].numpy()[sel]]
    assert df["quadrant"].tolist() == names
    np.testing.assert_array_equal(df["token_id"].to_numpy(), tokens.numpy()[sel])
    # exact logit-gradient norm from the hook == autograd == the closed form from grad_coef
    np.testing.assert_allclose(df["logit_grad_norm"].to_numpy(), lgn_autograd.numpy()[sel], rtol=1e-5, atol=1e-9)
    closed = stats.logit_grad_norm(logits.detach(), tokens, out.columns["grad_coef"])
    np.testing.assert_allclose(df["logit_grad_norm"].to_numpy(), closed.numpy()[sel], rtol=1e-4, atol=1e-9)
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["status"] == "finished" and info["schema_version"] == SCHEMA_VERSION and info["method"] == "ce_gppo"


def test_step_aggregates_equal_token_rows(tmp_path):
    with Recorder(tmp_path, run="r", config={"method": "grpo"}) as rec:
        for step in range(2):
            for u in range(3):
                record_one(rec, step, u, seed=10 * step + u, erc=(0.95, 1.05))
            rec.record_sequences(
                step,
                seq_ids=torch.arange(B),
                rewards=torch.arange(B).float(),
                advantages=torch.zeros(B),
                lengths=torch.full((B,), T),
            )
    con = connect(tmp_path)
    got = con.execute("""
        SELECT s.step, s.update, s.n_tokens, t.n, s.entropy_mean, t.h, s.clip_low_frac, t.cl, s.clip_high_frac,
               t.ch, s.n_pa_lp, t.n_pa_lp, s.erc_drop_frac, t.drop, s.kl_k3, t.kl, s.entropy_ratio_p50, t.p50,
               s.lgn_mean_na_lp, t.lgn_na_lp, s.clip_frac_pa_lp, t.cf_pa_lp, s.reward_mean, s.grad_norm
        FROM steps s JOIN (
            SELECT step, update, count(*) AS n, avg(entropy) AS h,
                   avg((clipped AND clip = -1)::INT) AS cl, avg((clipped AND clip = 1)::INT) AS ch,
                   count(*) FILTER (WHERE quadrant = 'PA&LP') AS n_pa_lp,
                   avg((NOT erc_kept)::INT) AS drop, avg(ratio - 1 - ln(ratio)) AS kl,
                   quantile_cont(entropy_ratio, 0.5) AS p50,
                   avg(logit_grad_norm) FILTER (WHERE quadrant = 'NA&LP') AS lgn_na_lp,
                   avg(clipped::INT) FILTER (WHERE quadrant = 'PA&LP') AS cf_pa_lp
            FROM tokens GROUP BY ALL) t USING (step, update)
        ORDER BY step, update""").fetchall()
    assert len(got) == 6
    for row in got:
        (step, u, n, n2, h, h2, cl, cl2, ch, ch2, q, q2, d, d2, kl, kl2, p50, p502, lg, lg2, cf, cf2, rw, gn) = row
        assert n == n2
        assert h == pytest.approx(h2, rel=1e-5)
        assert cl == pytest.approx(cl2) and ch == pytest.approx(ch2) and d == pytest.approx(d2)
        assert q == q2
        assert kl == pytest.approx(kl2, rel=1e-3, abs=1e-6)
        assert p50 == pytest.approx(p502, rel=1e-5)
        assert lg == pytest.approx(lg2, rel=1e-5)
        assert cf == pytest.approx(cf2 if cf2 is not None else 0.0)
        assert rw == pytest.approx(2.5)  # mean of 0..5
        assert gn is not None and gn > 0


def test_without_loss_object_derives_columns(tmp_path):
    x, tokens, mask, adv, old = make_batch(3)
    with torch.no_grad():
        lp, h = stats.logprobs_and_entropy(x.float(), tokens)
        old_lp, old_h = stats.logprobs_and_entropy(old.float(), tokens)
    with Recorder(tmp_path, run="r", config={"eps_low": 0.1, "eps_high": 0.3}, tau=0.3) as rec:
        rec.record_update(0, 0, mask=mask, advantages=adv.float(), logprobs=lp, old_logprobs=old_lp)
    df = connect(tmp_path).execute("SELECT * FROM tokens ORDER BY seq, pos").df()
    sel = mask.numpy()
    # independent values: the ratio, probability and advantage from the input tensors (float64)
    r = torch.exp(lp.double() - old_lp.double()).numpy()[sel]
    np.testing.assert_allclose(df["logprob"], lp.numpy()[sel], rtol=1e-6)
    np.testing.assert_allclose(df["ratio"], r, rtol=1e-5)
    exp_clip = np.where(r < 0.9, -1, np.where(r > 1.3, 1, 0))
    np.testing.assert_array_equal(df["clip"], exp_clip)
    a = adv.unsqueeze(1).expand(mask.shape).numpy()[sel]
    np.testing.assert_array_equal(df["advantage"], a)
    np.testing.assert_array_equal(df["clipped"], ((exp_clip == -1) & (a < 0)) | ((exp_clip == 1) & (a > 0)))
    p = torch.exp(old_lp.double()).numpy()[sel]
    exp_q = np.where(
        a == 0, "ZA", np.where(a > 0, np.where(p >= 0.3, "PA&HP", "PA&LP"), np.where(p >= 0.3, "NA&HP", "NA&LP"))
    )
    assert df["quadrant"].tolist() == exp_q.tolist()
    assert df["entropy"].isna().all() and df["logit_grad_norm"].isna().all() and df["erc_kept"].isna().all()


def kept_seqs(root, run, sample):
    with Recorder(root, run=run, sample=sample) as rec:
        for step in range(3):
            for u in range(2):
                x, tokens, mask, adv, old = make_batch(step)
                big = torch.ones(40, 4, dtype=torch.bool)
                lp = torch.full((40, 4), -1.0)
                rec.record_update(
                    step,
                    u,
                    mask=big,
                    advantages=torch.randn(40),
                    logprobs=lp,
                    old_logprobs=lp,
                    seq_ids=torch.arange(40),
                )
    return (
        connect(root / run)
        .execute("SELECT step, update, list(DISTINCT seq ORDER BY seq) FROM tokens GROUP BY ALL ORDER BY ALL")
        .fetchall()
    )


def test_sampling_is_deterministic_whole_sequences_and_aggregates_exact(tmp_path):
    a = kept_seqs(tmp_path / "a", "same", 0.3)
    b = kept_seqs(tmp_path / "b", "same", 0.3)
    assert a == b  # same run id, same kept sequences
    by_step = {}
    for step, _u, seqs in a:
        by_step.setdefault(step, []).append(seqs)
    for lists in by_step.values():
        assert all(s == lists[0] for s in lists)  # every update of a kept sequence is kept
        assert 3 <= len(lists[0]) <= 25  # about 30% of 40
    con = connect(tmp_path / "a")
    n = con.execute("SELECT DISTINCT n_tokens FROM steps").fetchall()
    assert n == [(160,)]  # aggregates cover all 40 x 4 tokens, not the sample
    rows = con.execute("SELECT count(*) FROM tokens").fetchone()[0]
    assert rows == 4 * sum(len(s) for _, _, s in a)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 1e300])
def test_non_finite_inputs_fail_only_at_masked_in_positions(tmp_path, value):
    # NaN, +inf, -inf (and a float64 value that overflows float32) at a masked-in position of any
    # checked input fail the call, naming the input (but a log-prob's -inf, a token of probability 0, is
    # recorded: test_input_checks.py); the same value at a masked-out position is fine
    lp = torch.zeros(2, 3, dtype=torch.float64)
    m = torch.tensor([[True, True, False], [True, True, True]])
    with Recorder(tmp_path, run="r") as rec:
        for step, name in enumerate(("logprobs", "old_logprobs", "entropy", "old_entropy")):
            inputs = {"logprobs": lp, "old_logprobs": lp, "entropy": lp, "old_entropy": lp}
            bad = lp.clone()
            bad[0, 1] = value
            if not (value == float("-inf") and name in ("logprobs", "old_logprobs")):
                with pytest.raises(ValueError, match=f"^{name} contains NaN or Inf at masked-in positions"):
                    rec.record_update(step, 0, mask=m, advantages=torch.ones(2), **{**inputs, name: bad})
            hidden = lp.clone()
            hidden[0, 2] = value  # masked out
            rec.record_update(step, 0, mask=m, advantages=torch.ones(2), **{**inputs, name: hidden})
        with pytest.raises(ValueError, match="^advantages contains NaN or Inf"):
            rec.record_update(9, 0, mask=m, advantages=torch.tensor([value, 1.0]), logprobs=lp, old_logprobs=lp)
    n = connect(tmp_path).execute("SELECT count(*) FROM tokens").fetchone()[0]
    assert n == 4 * 5  # the four accepted updates, 5 masked-in tokens each


def test_bad_inputs(tmp_path):
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with Recorder(tmp_path, run="r") as rec:
        with pytest.raises(ValueError, match="old_logprobs shape"):
            rec.record_update(0, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=torch.zeros(2, 4))
        with pytest.raises(ValueError, match="advantages"):
            rec.record_update(0, 0, mask=m, advantages=torch.ones(3), logprobs=lp, old_logprobs=lp)
        bad = lp.clone()
        bad[1, 1] = float("nan")
        with pytest.raises(ValueError, match="logprobs contains NaN"):
            rec.record_update(0, 0, mask=m, advantages=torch.ones(2), logprobs=bad, old_logprobs=lp)
        ids = torch.arange(2)
        rec.record_update(0, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp, seq_ids=ids)
        with pytest.raises(ValueError, match="step 0 update 0 was already recorded"):
            rec.record_update(0, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp, seq_ids=ids)
        # a second update of a step needs seq_ids (else two mini-batches would share ids 0..B-1)
        with pytest.raises(ValueError, match="seq_ids: step 0 has more than one update"):
            rec.record_update(0, 1, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
        # an empty mask: no rows, no error
        rec.record_update(
            0,
            1,
            mask=torch.zeros(2, 3, dtype=torch.bool),
            advantages=torch.ones(2),
            logprobs=lp,
            old_logprobs=lp,
            seq_ids=ids + 2,
        )
        rec.record_update(1, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
        with pytest.raises(ValueError, match="steps must not go back"):
            rec.record_update(0, 5, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
    con = connect(tmp_path)
    assert con.execute("SELECT step, update, count(*) FROM tokens GROUP BY ALL ORDER BY ALL").fetchall() == [
        (0, 0, 6),
        (1, 0, 6),
    ]
    assert con.execute("SELECT n_tokens FROM steps WHERE step = 0 AND update = 1").fetchall() == [(0,)]
    with pytest.raises(RecorderError, match="cannot write the run directory"):
        Recorder("/proc/entropylens-cannot-write", run="r")
    with pytest.raises(ValueError, match="sample"):
        Recorder(tmp_path, run="s", sample=0.0)


def test_writer_failure_raises_in_caller(tmp_path):
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    rec = Recorder(tmp_path, run="r")
    (tmp_path / "r" / "tokens").write_text("a file where the writer needs a directory")
    rec.record_update(0, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
    with pytest.raises(RecorderError, match="Parquet writer failed"):
        for step in range(1, 200):  # the error surfaces at a later call, never swallowed
            rec.record_update(step, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
    assert json.loads((tmp_path / "r" / "run.json").read_text())["status"] == "failed"


def test_writer_failure_warns_when_asked(tmp_path):
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    rec = Recorder(tmp_path, run="r", on_error="warn")
    (tmp_path / "r" / "tokens").write_text("x")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for step in range(200):
            rec.record_update(step, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
        rec.close()
    assert sum("recording stopped" in str(x.message) for x in w) == 1
    info = json.loads((tmp_path / "r" / "run.json").read_text())
    assert info["status"] == "failed" and info["error"]


def test_failed_status_on_exception_and_no_drops_with_tiny_queue(tmp_path):
    lp = torch.zeros(3, 5)
    m = torch.ones(3, 5, dtype=torch.bool)
    with pytest.raises(KeyError):
        with Recorder(tmp_path, run="r", queue_size=1) as rec:
            for step in range(40):
                rec.record_update(step, 0, mask=m, advantages=torch.ones(3), logprobs=lp, old_logprobs=lp)
            raise KeyError("training crashed")
    assert json.loads((tmp_path / "r" / "run.json").read_text())["status"] == "failed"
    con = connect(tmp_path)
    assert con.execute("SELECT count(*), count(DISTINCT step) FROM tokens").fetchone() == (600, 40)
    assert con.execute("SELECT count(*) FROM steps").fetchone() == (40,)


def test_schema_evolution_reads_older_files(tmp_path):
    # a run written before `logit_grad_norm` and `erc_kept` existed, next to today's run
    old_dir = tmp_path / "old"
    (old_dir / "tokens" / "step=0" / "rank=0").mkdir(parents=True)
    (old_dir / "run.json").write_text(json.dumps({"run": "old", "method": "grpo", "schema_version": 0}))
    pq.write_table(
        pa.table(
            {
                "update": pa.array([0, 0], pa.int16()),
                "seq": pa.array([0, 0], pa.int32()),
                "pos": pa.array([0, 1], pa.int32()),
                "ratio": pa.array([1.0, 1.1], pa.float32()),
                "quadrant": ["PA&HP", "NA&LP"],
            }
        ),
        old_dir / "tokens" / "step=0" / "rank=0" / "update-0.parquet",
    )
    (old_dir / "steps" / "step=0" / "rank=0").mkdir(parents=True)  # the steps file commits step 0
    pq.write_table(
        pa.table({"update": pa.array([0], pa.int16()), "n_tokens": pa.array([2], pa.int64())}),
        old_dir / "steps" / "step=0" / "rank=0" / "steps.parquet",
    )
    with Recorder(tmp_path, run="new") as rec:
        record_one(rec, 0, 0)
    con = connect(tmp_path)
    got = con.execute("""SELECT run, count(*), count(logit_grad_norm), count(ratio) FROM tokens
                         GROUP BY run ORDER BY run""").fetchall()
    assert got[0][0] == "new" and got[0][1] == got[0][2] == got[0][3] > 0
    assert got[1] == ("old", 2, 0, 2)


def test_concurrent_reader_never_errors(tmp_path):
    import threading

    errors, reads = [], [0]
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            try:
                if (tmp_path / "r" / "run.json").exists():
                    con = connect(tmp_path)
                    con.execute("SELECT count(*), sum(ratio) FROM tokens").fetchall()
                    con.execute("SELECT count(*) FROM steps").fetchall()
                    if any(tmp_path.rglob("*.parquet")):  # files only ever appear, whole
                        duckdb.sql(
                            f"SELECT count(*) FROM read_parquet('{tmp_path}/**/*.parquet', union_by_name=true)"
                        ).fetchall()
                    reads[0] += 1
            except Exception as e:  # noqa: BLE001 - any error fails the test
                errors.append(repr(e))

    th = threading.Thread(target=reader)
    th.start()
    try:
        with Recorder(tmp_path, run="r") as rec:
            for step in range(2000):  # write until the reader has read several times mid-run
                for u in range(2):
                    record_one(rec, step, u, seed=step % 7)
                if reads[0] >= 8:
                    break
    finally:
        stop.set()
        th.join()
    assert not errors, errors[:3]
    assert reads[0] >= 8


def test_watch_logits_context_manager_leaves_no_hook(tmp_path):
    x, tokens, mask, adv, old = make_batch(1)
    with torch.no_grad():
        old_lp, old_h = stats.logprobs_and_entropy(old.float(), tokens)
    with Recorder(tmp_path, run="r") as rec:
        # 1) backward inside the block: the norms are recorded, no handle is left on the tensor
        leaf = x.clone().float().requires_grad_(True)
        logits = leaf * 1.0  # a non-leaf tensor, as a model's output is
        with rec.watch_logits(logits) as watch:
            assert rec.has_hook and len(logits._backward_hooks) == 1
            lp, h = stats.logprobs_and_entropy(logits, tokens)
            out = policy_loss(lp, old_lp, adv.float(), mask, entropy=h, old_entropy=old_h)
            rec.record_update(
                0,
                0,
                mask=mask,
                advantages=adv.float(),
                logprobs=lp,
                old_logprobs=old_lp,
                entropy=h,
                old_entropy=old_h,
                tokens=tokens,
                loss=out,
            )
            out.loss.backward()
        assert watch.norms is not None and not logits._backward_hooks and not rec.has_hook
        # 2) the block is left without a backward: the exit removes the hook
        logits2 = x.clone().float().requires_grad_(True)
        with rec.watch_logits(logits2):
            assert len(logits2._backward_hooks) == 1
        assert not logits2._backward_hooks and not rec.has_hook
        # 3) the plain call form still works (the hook removes itself when it fires)
        logits3 = x.clone().float().requires_grad_(True)
        rec.watch_logits(logits3)
        lp3, _ = stats.logprobs_and_entropy(logits3, tokens)
        lp3.sum().backward()
        assert not logits3._backward_hooks and not rec.has_hook
    got = connect(tmp_path).execute("SELECT count(logit_grad_norm), count(*) FROM tokens").fetchone()
    assert got == (int(mask.sum()), int(mask.sum()))


def test_recorder_resolves_eps_like_the_loss(tmp_path):
    # without a loss object the recorder derives the clip region itself. dapo: eps 0.2 / 0.28, so
    # r = 1.25 is inside (1.25 < 1.28) and r = 1.3 is on the high side; gspo: 3e-4 / 4e-4, so
    # r = 1.001 is already high (1.001 > 1.0004) and r = 0.9995 low (0.9995 < 0.9997).
    lp = torch.log(torch.tensor([[1.25, 1.3, 1.001, 0.9995]]))
    old = torch.zeros(1, 4)
    m = torch.ones(1, 4, dtype=torch.bool)
    for method, expected in (("dapo", [0, 1, 0, 0]), ("gspo", [1, 1, 1, -1]), ("grpo", [1, 1, 0, 0])):
        with Recorder(tmp_path, run=method, config={"method": method}) as rec:
            rec.record_update(0, 0, mask=m, advantages=torch.ones(1), logprobs=lp, old_logprobs=old)
        got = connect(tmp_path / method).execute("SELECT clip FROM tokens ORDER BY pos").fetchall()
        assert [c for (c,) in got] == expected, method
        info = json.loads((tmp_path / method / "run.json").read_text())
        from entropylens.rl.losses import resolve_eps

        assert (info["eps_low"], info["eps_high"]) == resolve_eps(method, None, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_record_update_does_not_synchronise_on_cuda(tmp_path):
    # every synchronising call on the caller's thread (nonzero, .item(), a blocking copy) raises here
    dev = torch.device("cuda")
    x, tokens, mask, adv, old = (t.to(dev) for t in make_batch(2))
    with torch.no_grad():
        old_lp, old_h = stats.logprobs_and_entropy(old.float(), tokens)
    norms = []
    with Recorder(tmp_path, run="r", sample=0.5) as rec:
        for update in range(2):
            logits = x.clone().float().requires_grad_(True)
            rec.watch_logits(logits)
            lp, h = stats.logprobs_and_entropy(logits, tokens)
            with torch.no_grad():
                out_cols = policy_loss(lp.detach(), old_lp, adv.float(), mask, entropy=h.detach(), old_entropy=old_h)
            torch.cuda.set_sync_debug_mode("error")
            try:
                rec.record_update(
                    0,
                    update,
                    mask=mask,
                    advantages=adv.float(),
                    logprobs=lp,
                    old_logprobs=old_lp,
                    entropy=h,
                    old_entropy=old_h,
                    tokens=tokens,
                    seq_ids=torch.arange(B, device=dev),
                    loss=out_cols,
                )
            finally:
                torch.cuda.set_sync_debug_mode("default")
            lp.sum().backward()
            grad_norm = logits.grad.norm()  # a device scalar, as clip_grad_norm_ returns it
            torch.cuda.set_sync_debug_mode("error")
            try:  # the update's block is finalised here and the grad norm stays a device tensor
                rec.record_step(0, update=update, grad_norm=grad_norm, lr=1e-3)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            norms.append(float(grad_norm.float()))
        summary = rec.step_summary(0)
    con = connect(tmp_path)
    n = con.execute("SELECT sum(n_tokens) FROM steps").fetchone()[0]
    assert n == 2 * int(mask.sum()) == summary["n_tokens"]
    got = con.execute('SELECT grad_norm, lr FROM steps ORDER BY "update"').fetchall()
    lr32 = float(np.float32(1e-3))  # steps store float32: the device norm (a float32) round-trips exactly
    assert got == [(norms[0], lr32), (norms[1], lr32)]
    assert con.execute("SELECT count(logit_grad_norm) = count(*) FROM tokens").fetchone()[0]


def test_device_scalars_of_record_step_arrive_through_the_writer_thread(tmp_path, monkeypatch):
    # on CUDA a tensor grad norm is not read on the caller's thread (that would synchronise): it goes
    # by a non-blocking copy the writer thread waits for. Take that path with CPU tensors and check
    # the stored values: float32(v) for every tensor, floats as they are, per update and per step.
    from entropylens.record.training import steps as recorder_module  # where record_step reads it

    monkeypatch.setattr(recorder_module, "_DEFERRED_DEVICES", ("cpu",))
    norms = [torch.tensor(1.2345678, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float32)]
    with Recorder(tmp_path, run="r") as rec:
        for update in range(2):
            record_one(rec, 0, update, seed=update, watch=False)
            rec.record_step(0, update=update, grad_norm=norms[update], lr=1e-3)
        rec.record_step(0, reward_std=torch.tensor(2.5), accuracy=0.75)
    got = (
        connect(tmp_path).execute('SELECT grad_norm, lr, reward_std, accuracy FROM steps ORDER BY "update"').fetchall()
    )
    f32 = [float(np.float32(x)) for x in (1.2345678, 0.1, 1e-3, 0.75)]
    assert got == [(f32[0], f32[2], 2.5, f32[3]), (f32[1], f32[2], 2.5, f32[3])]


def test_step_summary_quantiles_are_quantiles_of_the_step(tmp_path):
    # update 0: rho = [1, 1, 1] (3 tokens); update 1: rho = [2, 4] (2 tokens). The step's 5 values
    # sorted are [1, 1, 1, 2, 4]: median 1, p95 at position 0.95 * 4 = 3.8 -> 2 + 0.8 * (4 - 2) = 3.6,
    # p05 at 0.2 -> 1. (The token-weighted mean of the updates' medians would be (3*1 + 2*3) / 5 = 1.8.)
    with Recorder(tmp_path, run="r", sample=0.5) as rec:
        for update, h in ((0, [[1.0, 1.0, 1.0]]), (1, [[2.0, 4.0, 9.0]])):
            mask = torch.tensor([[True, True, update == 0]])
            lp = torch.zeros(1, 3)
            rec.record_update(
                0,
                update,
                mask=mask,
                advantages=torch.ones(1),
                logprobs=lp,
                old_logprobs=lp,
                entropy=torch.tensor(h),
                old_entropy=torch.ones(1, 3),
                seq_ids=torch.tensor([update]),
            )
        summary = rec.step_summary(0)
        only = rec.step_summary_later(0, ("entropy_ratio_p95", "n_pa_hp")).result()  # what a trainer log asks
        assert only == {k: summary[k] for k in ("n_tokens", "entropy_ratio_p95", "n_pa_hp")}
        assert rec.step_summary_later(0, ("entropy_mean",)).result() == {
            k: summary[k] for k in ("n_tokens", "entropy_mean")
        }
    assert summary["n_tokens"] == 5
    assert summary["entropy_ratio_p50"] == pytest.approx(1.0)
    assert summary["entropy_ratio_p95"] == pytest.approx(3.6, rel=1e-6)
    assert summary["entropy_ratio_p05"] == pytest.approx(1.0)
    assert summary["entropy_mean"] == pytest.approx((3 * 1 + 2 + 4) / 5)


def test_files_reach_the_disk_before_the_steps_file_commits_them(tmp_path, monkeypatch):
    # observe the real os.fsync / os.replace calls (they still run): every token and sequences file,
    # and its directory, is fsynced before the steps file of its step is renamed into place
    import os

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with Recorder(tmp_path, run="r") as rec:
        for step in range(2):
            for u in range(2):
                record_one(rec, step, u, seed=step + u, watch=False)
            rec.record_sequences(
                step,
                seq_ids=torch.arange(B),
                rewards=torch.ones(B),
                advantages=torch.zeros(B),
                lengths=torch.full((B,), T),
            )
    monkeypatch.undo()
    run_dir = str((tmp_path / "r").resolve())
    for step in range(2):
        commit = events.index(("replace", f"{run_dir}/steps/step={step}/rank=0/steps.parquet"))
        files = [dst for kind, dst in events[:commit] if kind == "replace" and f"/step={step}/" in dst]
        assert any("/tokens/" in f for f in files) and any("/sequences/" in f for f in files)
        for f in files:
            i = events.index(("replace", f))
            assert events[i - 1][0] == "fsync" and events[i - 1][1].endswith(".tmp")  # the file, before its rename
            assert ("fsync", os.path.dirname(f)) in events[i + 1 : commit]  # its directory, before the commit
        assert ("fsync", f"{run_dir}/steps/step={step}/rank=0") in events[commit + 1 :]  # the commit itself
    assert connect(tmp_path).execute("SELECT count(*) FROM steps").fetchone()[0] == 4


def test_nan_found_on_the_writer_thread_is_raised_at_the_next_call(tmp_path, monkeypatch):
    # on CUDA the caller never waits for the copy: the writer thread reads the NaN flags. Take that
    # path on the CPU too (as if the block were still on its way) and check the error and the drop.
    from entropylens.record.device.host_copy import DeferredBlock, HostCopy

    monkeypatch.setattr(HostCopy, "on_host", property(lambda self: False))
    monkeypatch.setattr(DeferredBlock, "on_host", False)
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    bad = lp.clone()
    bad[0, 1] = float("inf")
    with Recorder(tmp_path, run="r") as rec:
        rec.record_update(0, 0, mask=m, advantages=torch.ones(2), logprobs=bad, old_logprobs=lp)
        rec.step_summary(0)  # the writer thread has taken the update in
        with pytest.raises(
            ValueError, match=r"logprobs contains NaN or Inf at masked-in positions \(step 0, update 0\)"
        ):
            rec.record_update(1, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
        rec.record_update(1, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
    con = connect(tmp_path)
    assert con.execute("SELECT step, count(*) FROM tokens GROUP BY step").fetchall() == [(1, 6)]


def test_inputs_checked_by_the_loss_are_not_checked_again_but_others_are(tmp_path, monkeypatch):
    # policy_loss checks its inputs (one sync); the recorder skips the very tensors it checked (same
    # objects, same mask) and still checks the rest: a float64 input whose finite values overflow
    # float32 (the loss checked it as float64; its stored float32 column is +inf)
    from entropylens.record.device import blocks
    from entropylens.rl.losses import policy_loss

    names = []
    snapshot = blocks.snapshot
    monkeypatch.setattr(
        blocks,
        "snapshot",
        lambda cols, mask, loss, finite, *a: names.append(finite.names) or snapshot(cols, mask, loss, finite, *a),
    )
    m = torch.ones(2, 3, dtype=torch.bool)
    lp, old, adv = torch.full((2, 3), -1.0), torch.full((2, 3), -1.1), torch.tensor([1.0, -1.0])
    h = torch.full((2, 3), 0.5)
    out = policy_loss(lp, old, adv, m, entropy=h)
    assert out.checked["logprobs"] is lp and out.checked["mask"] is m
    big = torch.full((2, 3), -1.0, dtype=torch.float64)
    big[1, 2] = 1e300  # finite in float64, +inf in float32 (a -inf log-prob would be a probability 0)
    out64 = policy_loss(big, old, adv, m)
    assert "logprobs" not in out64.checked
    with Recorder(tmp_path, run="r") as rec:
        rec.record_update(
            0, 0, mask=m, advantages=adv, logprobs=lp, old_logprobs=old, entropy=h, old_entropy=h.clone(), loss=out
        )
        assert names[-1] == ("old_entropy",)  # the one input the loss was not given
        with pytest.raises(ValueError, match="^logprobs contains NaN or Inf at masked-in positions"):
            rec.record_update(1, 0, mask=m, advantages=adv, logprobs=big, old_logprobs=old, loss=out64)
        assert names[-1] == ("logprobs",)
        rec.record_update(2, 0, mask=m.clone(), advantages=adv, logprobs=lp, old_logprobs=old, loss=out)
        assert names[-1] == ("logprobs", "old_logprobs", "advantages")  # another mask object: all checked
    assert connect(tmp_path).execute("SELECT count(*) FROM tokens").fetchone()[0] == 12


def test_record_step_refuses_the_recorders_own_columns_and_clashing_names(tmp_path):
    # a metric named like a column the recorder fills from the updates would overwrite it (update=u)
    # or be dropped (the whole step): refused with one line; so are two names for one column and
    # values that are not numbers. Nothing of a refused call is recorded.
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with Recorder(tmp_path, run="r") as rec:
        rec.record_update(
            0,
            0,
            mask=m,
            advantages=torch.ones(2),
            logprobs=lp,
            old_logprobs=lp,
            entropy=torch.full((2, 3), 2.0),
            old_entropy=torch.full((2, 3), 2.0),
        )
        for name in ("entropy_mean", "n_tokens", "clip_high_frac", "loss", "rank", "run"):
            with pytest.raises(
                ValueError, match=f"metric name '{name}': the steps column '{name}' is the recorder's own"
            ):
                rec.record_step(0, update=0, **{name: 9.0})
        with pytest.raises(ValueError, match="metric name 'entropy/mean': the steps column 'entropy_mean'"):
            rec.record_step(0, **{"entropy/mean": 1.0})
        with pytest.raises(ValueError, match="metric names 'a.b' and 'a_b' are both the steps column 'a_b'"):
            rec.record_step(0, **{"a.b": 1.0, "a_b": 2.0})
        with pytest.raises(ValueError, match="metric 'note': expected a number, got str"):
            rec.record_step(0, note="hello")
        rec.record_step(0, update=0, grad_norm=torch.tensor(0.5), lr=1e-3, reward_mean=0.25, beta1=0.5, my_metric=1.0)
    row = (
        connect(tmp_path)
        .execute("SELECT entropy_mean, n_tokens, grad_norm, reward_mean, beta1, my_metric FROM steps")
        .fetchall()
    )
    assert row == [(pytest.approx(2.0), 6, pytest.approx(0.5), pytest.approx(0.25), pytest.approx(0.5), 1.0)]


def test_record_step_refuses_an_update_that_was_not_recorded(tmp_path):
    # record_step(4, update=99) would add a steps row of its own (n_tokens null) holding the grad norm: with
    # gradient accumulation an off-by-one in update= would lose it from the real update's row
    lp = torch.zeros(2, 3)
    kw = dict(mask=torch.ones(2, 3, dtype=torch.bool), advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
    with Recorder(tmp_path, run="r") as rec:
        rec.record_update(0, 0, seq_ids=torch.tensor([0, 1]), **kw)
        rec.record_update(0, 1, seq_ids=torch.tensor([2, 3]), **kw)
        with pytest.raises(
            ValueError,
            match=r"record_step\(0, update=2\): step 0 has no update 2 recorded "
            r"\(its updates: 0, 1\)",
        ):
            rec.record_step(0, update=2, grad_norm=1.0)
        with pytest.raises(ValueError, match=r"step 1 has no update 0 recorded \(its updates: none\)"):
            rec.record_step(1, update=0, grad_norm=1.0)  # a later step without updates: refused, nothing closed
        rec.record_step(0, update=1, grad_norm=1.0)
        rec.record_step(0, reward_mean=0.5)  # a whole-step value needs no update
    rows = connect(tmp_path).execute('SELECT step, "update", grad_norm, reward_mean FROM steps ORDER BY ALL').fetchall()
    assert rows == [(0, 0, None, 0.5), (0, 1, 1.0, 0.5)]


def test_record_step_names_a_metric_that_is_not_one_number(tmp_path):
    lp = torch.zeros(2, 3)
    with Recorder(tmp_path, run="r") as rec:
        rec.record_update(
            0, 0, mask=torch.ones(2, 3, dtype=torch.bool), advantages=torch.ones(2), logprobs=lp, old_logprobs=lp
        )
        with pytest.raises(ValueError, match=r"metric 'kl': expected one number, got a tensor of shape \(2,\)"):
            rec.record_step(0, kl=torch.tensor([1.0, 2.0]))
        with pytest.raises(ValueError, match=r"metric 'val_acc': expected one number, got a tensor of shape \(0,\)"):
            rec.record_step(0, val_acc=np.array([]))
        rec.record_step(0, kl=torch.tensor([[0.5]]), val_acc=np.float32(0.25))  # one element: fine
    assert connect(tmp_path).execute("SELECT kl, val_acc FROM steps").fetchall() == [(0.5, 0.25)]


def test_record_step_warns_once_when_a_whole_step_scalar_is_replaced(tmp_path):
    # two optimizer steps in one RL step, each calling record_step(step, grad_norm=...) without update=:
    # the second value replaces the first on every update row: a warning (once per run) names the columns
    # and the fix; update= per optimizer step keeps both values.
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    kw = dict(mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
    with Recorder(tmp_path, run="r") as rec:
        rec.record_update(0, 0, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rec.record_step(0, grad_norm=0.8)
            rec.record_step(0, reward_mean=0.5)  # another column: no warning
        with pytest.warns(UserWarning, match=r"record_step\(0\) set grad_norm for the whole step again.*update="):
            rec.record_step(0, grad_norm=0.9, lr=1e-3)
        rec.record_update(1, 0, seq_ids=torch.tensor([0, 1]), **kw)
        rec.record_update(1, 1, seq_ids=torch.tensor([2, 3]), **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per run; and per-update values never warn
            rec.record_step(1, update=0, grad_norm=0.7)
            rec.record_step(1, update=1, grad_norm=0.6)
            rec.record_step(1, grad_norm=0.1)
            rec.record_step(1, grad_norm=0.2)
    rows = connect(tmp_path).execute('SELECT step, "update", grad_norm FROM steps ORDER BY step, "update"').fetchall()
    assert rows[0] == (0, 0, pytest.approx(0.9))  # the later value, as warned


def test_commit_writes_the_recorded_steps_and_closes_them(tmp_path):
    # without commit, step 1 (in progress) and possibly step 0 (closed, writer lagging) are not on disk;
    # commit() writes both and returns once their files are in place: the files are read here while the
    # recorder is still open (no close, no later step)
    rec = Recorder(tmp_path, run="r", alarms={})
    assert rec.commit() == -1  # nothing recorded: nothing to write
    for step in (0, 1):
        for u in (0, 1):
            record_one(rec, step, u, seed=10 * step + u)
    assert rec.commit() == 1
    n = int(make_batch(0)[2].sum())  # every seed's mask keeps the same positions: 6 x 9 - 4 - 7
    assert n == 43
    con = connect(tmp_path)
    assert con.execute('SELECT step, "update", n_tokens FROM steps ORDER BY ALL').fetchall() == [
        (0, 0, n),
        (0, 1, n),
        (1, 0, n),
        (1, 1, n),
    ]
    assert con.execute("SELECT step, count(*) FROM tokens GROUP BY step ORDER BY step").fetchall() == [
        (0, 2 * n),
        (1, 2 * n),
    ]
    # the committed step is closed: its updates and scalars are refused, naming the reason
    with pytest.raises(
        ValueError,
        match=r"step 1 was already written \(steps <= 1 are closed: by a later step, "
        r"by end_step\(\), commit\(\) or resume=\)",
    ):
        record_one(rec, 1, 2)
    with pytest.raises(ValueError, match="step 1 was already written"):
        rec.record_step(1, reward_mean=0.5)
    with pytest.raises(ValueError, match=r"step 5 has not been recorded \(the last recorded step is 1\)"):
        rec.commit(5)
    with pytest.raises(ValueError, match=r"commit: step must be >= 0, got -3"):
        rec.commit(-3)
    # later steps record as usual; commit(step) writes only up to that step
    record_one(rec, 2, 0, seed=20)
    record_one(rec, 3, 0, seed=30)  # step 2 closed by step 3 (written whenever the writer gets to it)
    assert rec.commit(2) == 2
    assert connect(tmp_path).execute("SELECT max(step) FROM steps").fetchone() == (2,)
    record_one(rec, 3, 1, seed=31)  # step 3 is still open
    rec.close()
    assert connect(tmp_path).execute("SELECT step, count(*) FROM steps GROUP BY step ORDER BY step").fetchall() == [
        (0, 2),
        (1, 2),
        (2, 1),
        (3, 2),
    ]
    with pytest.raises(RecorderError, match="closed"):
        rec.commit()


def test_end_step_closes_the_step_without_waiting(tmp_path):
    # end_step hands the steps to the writer and returns; the files follow with no further call (here:
    # drain, which only waits for the writer); the steps are closed like commit's
    rec = Recorder(tmp_path, run="r", alarms={})
    assert rec.end_step() == -1  # nothing recorded
    record_one(rec, 0, 0, seed=1)
    record_one(rec, 0, 1, seed=2)
    assert rec.end_step() == 0
    rec._writer.drain()  # no close_steps, no later step: end_step already asked for the files
    assert connect(tmp_path).execute("SELECT step, count(*) FROM steps GROUP BY step").fetchall() == [(0, 2)]
    with pytest.raises(
        ValueError,
        match=r"step 0 was already written \(steps <= 0 are closed: by a later step, "
        r"by end_step\(\), commit\(\) or resume=\)",
    ):
        record_one(rec, 0, 2)
    with pytest.raises(ValueError, match=r"step 3 has not been recorded \(the last recorded step is 0\)"):
        rec.end_step(3)
    with pytest.raises(ValueError, match=r"end_step: step must be >= 0, got -1"):
        rec.end_step(-1)
    record_one(rec, 1, 0, seed=3)  # later steps record as usual
    assert rec.end_step(0) == 0  # already closed: nothing to do
    rec.close()
    assert connect(tmp_path).execute("SELECT step, count(*) FROM steps GROUP BY step ORDER BY step").fetchall() == [
        (0, 2),
        (1, 1),
    ]


def test_a_config_method_other_than_the_loss_warns_once(tmp_path):
    # config says grpo, the loss is ce_gppo: the runs table names the run by config's method, run.json's loss
    # block by the loss's; the mismatch warns
    from entropylens.integrations.torch import policy_update

    x, tokens, mask, adv, old = make_batch(0)
    with torch.no_grad():
        old_lp, old_h = stats.logprobs_and_entropy(old.float(), tokens)
    with Recorder(tmp_path, run="r", config={"method": "grpo"}) as rec:
        with pytest.warns(UserWarning, match=r"config=\{'method': 'grpo'\}\) but the loss is 'ce_gppo'") as w:
            policy_update(
                rec, 0, 0, x.float(), tokens, mask, adv.float(), old_lp, seq_ids=torch.arange(B), method="ce_gppo"
            )
        assert [r.filename for r in w if "but the loss is" in str(r.message)] == [__file__]  # the caller's line
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: the run-level settings are taken from the first update only
            policy_update(
                rec, 0, 1, x.float(), tokens, mask, adv.float(), old_lp, seq_ids=torch.arange(B) + B, method="ce_gppo"
            )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same method: no warning
        with Recorder(tmp_path, run="s", config={"method": "ce_gppo"}) as rec:
            policy_update(rec, 0, 0, x.float(), tokens, mask, adv.float(), old_lp, method="ce_gppo")


def test_all_masked_update_needs_no_seq_ids(tmp_path):
    """An update whose mask selects no token (TRL / verl hand over such micro-batches) makes no rows,
    so it needs no seq_ids and its ids collide with none; rows without ids still may not share a step."""
    lp = torch.zeros(2, 3)
    m, empty = torch.ones(2, 3, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.bool)
    kw = dict(advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
    with Recorder(tmp_path, run="r") as rec:
        rec.record_update(0, 0, mask=m, seq_ids=torch.arange(2), **kw)
        rec.record_update(0, 1, mask=empty, **kw)  # was: "seq_ids: step 0 has more than one update"
        rec.record_update(0, 2, mask=m, seq_ids=torch.arange(2) + 2, **kw)
        rec.record_update(1, 0, mask=m, **kw)  # a plain loop without ids, and an empty second update
        rec.record_update(1, 1, mask=empty, **kw)
        with pytest.raises(ValueError) as e:
            rec.record_update(1, 2, mask=m, seq_ids=torch.arange(2) + 2, **kw)
        assert str(e.value).startswith(
            "seq_ids: step 1 has more than one update with tokens and update 0 came without seq_ids"
        ) and "\n" not in str(e.value)
        with pytest.raises(ValueError, match="and updates 0, 2 came without seq_ids"):
            rec.record_update(1, 2, mask=m, **kw)
    con = connect(tmp_path)
    assert con.execute("SELECT step, update, count(*) FROM tokens GROUP BY ALL ORDER BY ALL").fetchall() == [
        (0, 0, 6),
        (0, 2, 6),
        (1, 0, 6),
    ]
    assert con.execute("SELECT step, update, n_tokens FROM steps ORDER BY ALL").fetchall() == [
        (0, 0, 6),
        (0, 1, 0),
        (0, 2, 6),
        (1, 0, 6),
        (1, 1, 0),
    ]
