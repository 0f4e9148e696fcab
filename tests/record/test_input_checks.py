"""Every argument of the recording calls is checked at the call, so the writer thread never meets an input
it cannot write: an empty batch is an empty update, means over no tokens are null, texts are str or None
(invalid code points replaced, said once), duplicate seq ids are refused, sequences no update trains are
named at close, a -inf log-prob is non-finite (counted, alarmed), masked-out token ids may be anything,
and a recording stopped by the writer is always said. Real Recorder runs, read back through DuckDB."""

import json
import math
import warnings

import pytest
import torch

import entropylens
from entropylens import Recorder
from entropylens.integrations.torch import old_policy_pass, policy_update
from entropylens.record.device.host_copy import HostCopy
from entropylens.record.training import inputs, update
from entropylens.report.checks import check

V = 7


def _batch(b: int, t: int, step: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + step)
    logits = torch.randn(b, t, V, generator=g)
    tokens = torch.randint(0, V, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0] * (b // 2 + 1))[:b]
    old_lp, old_h = old_policy_pass(logits + 0.1, tokens)
    return logits.requires_grad_(), tokens, mask, adv, old_lp, old_h


def _train(rec, step, logits, tokens, mask, adv, old_lp, old_h, seq_ids=None, update=0):
    out = policy_update(
        rec, step, update, logits, tokens, mask, adv, old_lp, old_entropy=old_h, method="grpo", seq_ids=seq_ids
    )
    out.loss.backward()
    rec.record_step(step, update=update, grad_norm=1.0, lr=1e-3)
    return out


def _steps(root, cols="*"):
    return entropylens.open(root).sql(f'SELECT {cols} FROM steps ORDER BY step, "update"')


def _status(root, run):
    return json.loads((root / run / "run.json").read_text())["status"]


@pytest.mark.parametrize("shape", [(0, 4), (2, 0)], ids=["B=0", "T=0"])
def test_an_empty_batch_is_an_empty_update_and_recording_goes_on(tmp_path, shape):
    # dynamic sampling can leave no sample at a step: a steps row with n_tokens 0 and null means, not a
    # writer thread that dies (and with it every later step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        with Recorder(tmp_path, run="r", fsync=False) as rec:
            for step in range(3):
                b, t = shape if step == 1 else (4, 5)
                _train(rec, step, *_batch(b, t, step), seq_ids=torch.arange(b) + 10 * step)
    assert _status(tmp_path, "r") == "finished"
    df = _steps(
        tmp_path,
        "step, n_tokens, entropy_mean, old_entropy_mean, ratio_mean, kl_k3, clipped_frac, "
        "entropy_ratio_p05, entropy_ratio_p50, entropy_ratio_p95, n_pa_lp, n_nonfinite_ratio",
    )
    assert df["step"].tolist() == [0, 1, 2] and df["n_tokens"].tolist() == [20, 0, 20]
    empty = df.iloc[1]
    for col in (
        "entropy_mean",
        "old_entropy_mean",
        "ratio_mean",
        "kl_k3",
        "clipped_frac",
        "entropy_ratio_p05",
        "entropy_ratio_p50",
        "entropy_ratio_p95",
    ):
        assert math.isnan(empty[col]), col  # pandas shows DuckDB's NULL as NaN: checked as NULL below
    assert empty["n_pa_lp"] == 0 and empty["n_nonfinite_ratio"] == 0  # counts over no tokens: 0
    con = entropylens.open(tmp_path)
    assert con.sql(
        "SELECT count(*) AS n FROM steps WHERE step = 1 AND entropy_mean IS NULL "
        "AND entropy_ratio_p50 IS NULL AND clipped_frac IS NULL"
    )["n"].tolist() == [1]
    assert con.sql("SELECT DISTINCT step FROM tokens ORDER BY step")["step"].tolist() == [0, 2]


def test_means_and_fractions_over_no_tokens_are_null_never_zero(tmp_path):
    # a mask that selects nothing (all completions truncated) made entropy_mean 0.0: a collapse to 0 in a
    # raw steps query and for the alarms; a quadrant without tokens made its clip fraction 0
    with Recorder(tmp_path, run="r", fsync=False, alarms=True) as rec:
        for step in range(6):
            logits, tokens, mask, adv, old_lp, old_h = _batch(4, 5, step)
            if step == 3:
                mask[:] = False
            _train(rec, step, logits, tokens, mask, adv, old_lp, old_h)
    con = entropylens.open(tmp_path)
    got = con.sql(
        "SELECT step, n_tokens, entropy_mean IS NULL AS h, ratio_mean IS NULL AS r, "
        "clipped_frac IS NULL AS c, clip_frac_pa_lp IS NULL AS q FROM steps ORDER BY step"
    )
    assert got.iloc[3].tolist() == [3, 0, True, True, True, True]
    assert not got.drop(index=3)[["h", "r", "c"]].any().any()
    assert con.sql("SELECT min(entropy_mean) AS m FROM steps")["m"].iloc[0] > 0.5  # no collapse to 0
    # old_lp = log p of the sampled token under logits + 0.1: with V = 7 no token reaches p >= tau = 0.5
    # everywhere, so the high-probability quadrants of some steps are empty: their clip fraction is null
    q = con.sql("SELECT sum(n_pa_hp) AS n, count(clip_frac_pa_hp) AS frac FROM steps WHERE n_pa_hp = 0")
    assert q["frac"].iloc[0] == 0
    assert not [f for f in check(tmp_path) if f.rule in ("collapse", "nonfinite")]


def test_texts_must_be_str_or_none_and_invalid_code_points_are_replaced_once(tmp_path):
    ids, ones = torch.arange(3), torch.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run="r", fsync=False) as rec:
            _train(rec, 0, *_batch(3, 4, 0), seq_ids=ids)
            with pytest.raises(TypeError, match=r"^record_sequences: texts\[1\] is int, expected a str or None$"):
                rec.record_sequences(0, seq_ids=ids, rewards=ones, advantages=ones, lengths=ones, texts=["a", 3, None])
            rec.record_sequences(
                0,
                seq_ids=ids[:2],
                rewards=ones[:2],
                advantages=ones[:2],
                lengths=ones[:2],
                texts=["lone \ud800 surrogate", "a pair \ud83d\ude00 joined"],
            )
            rec.record_sequences(
                0, seq_ids=ids[2:], rewards=ones[2:], advantages=ones[2:], lengths=ones[2:], texts=["\udfff"]
            )
    said = [str(w.message) for w in caught if "lone surrogates" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("entropylens: record_sequences(0): 2 texts held lone surrogates")
    assert caught[0].filename == __file__
    texts = entropylens.open(tmp_path).sql("SELECT seq, text FROM sequences ORDER BY seq")["text"].tolist()
    assert texts == ["lone \ufffd surrogate", "a pair \U0001f600 joined", "\ufffd"]
    assert _status(tmp_path, "r") == "finished"


def test_duplicate_seq_ids_are_refused_at_the_call_naming_them(tmp_path):
    with Recorder(tmp_path, run="r", fsync=False) as rec:
        batch = _batch(4, 5, 0)
        with pytest.raises(ValueError, match=r"^seq_ids: step 0 update 0 gives seq id 0 to more than one row; "):
            _train(rec, 0, *batch, seq_ids=torch.tensor([0, 0, 1, 2]))
        with pytest.raises(ValueError, match=r"^record_sequences: seq_ids 1, 2 occur more than once; "):
            rec.record_sequences(0, seq_ids=[1, 2, 1, 2], rewards=[1.0] * 4, advantages=[0.0] * 4, lengths=[5] * 4)
        logits, tokens, mask, adv, old_lp, old_h = _batch(4, 5, 0)
        mask[1:3] = False  # rows without a token make no token rows: their ids may repeat (padding rows)
        _train(rec, 0, logits, tokens, mask, adv, old_lp, old_h, seq_ids=torch.tensor([0, 9, 9, 3]))
        rec.record_sequences(0, seq_ids=[0, 3], rewards=[1.0, 0.0], advantages=[1.0, -1.0], lengths=[5, 5])
    con = entropylens.open(tmp_path)
    assert con.sql("SELECT seq, count(*) AS n FROM tokens GROUP BY seq ORDER BY seq").values.tolist() == [
        [0, 5],
        [3, 5],
    ]
    assert con.sql("SELECT count(*) AS n FROM steps")["n"].tolist() == [1]
    resp = entropylens.open(tmp_path).analysis("responses")
    assert resp["seq"].tolist() == [0, 3] and resp["reward"].tolist() == [1.0, 0.0]


def test_duplicate_seq_ids_of_a_device_update_are_raised_at_the_next_call(tmp_path, monkeypatch):
    # a device update's seq ids are not read on the training thread (a sync): the writer thread finds the
    # duplicates in the update's one host copy and the next call raises, the update dropped. The CPU update
    # takes that path here (its check at the call off, its block built as a device block would be)
    monkeypatch.setattr(inputs, "_refuse_duplicates", lambda *a: None)
    monkeypatch.setattr(update, "DeferredBlock", lambda snap, salt, sample: HostCopy(*snap.block(salt, sample)))
    with Recorder(tmp_path, run="r", fsync=False) as rec:
        _train(rec, 0, *_batch(4, 5, 0), seq_ids=torch.tensor([5, 0, 5, 0]))
        rec.step_summary(0)  # the writer thread has taken the update in
        with pytest.raises(ValueError, match=r"^seq_ids: step 0 update 0 gives seq ids 0, 5 to more than one row; "):
            rec.record_step(0, grad_norm=1.0)
        _train(rec, 1, *_batch(4, 5, 1), seq_ids=torch.arange(4))
    con = entropylens.open(tmp_path)
    assert con.sql("SELECT DISTINCT step FROM tokens")["step"].tolist() == [1]


def test_sequences_no_update_trains_are_named_once_at_close(tmp_path):
    def run(name, trained_ids, sequence_ids, sequences_first):
        with Recorder(tmp_path, run=name, fsync=False) as rec:
            for step in range(3):
                n = len(sequence_ids(step))
                ones = torch.ones(n)

                def seqs():
                    if n:
                        rec.record_sequences(
                            step, seq_ids=sequence_ids(step), rewards=ones, advantages=ones, lengths=ones
                        )

                if sequences_first:
                    seqs()
                ids = trained_ids(step)
                _train(rec, step, *_batch(len(ids), 3, step), seq_ids=ids)
                if not sequences_first:
                    seqs()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # TRL: a generation's sequences recorded at its first step, before its updates, trained over 3 steps
        run(
            "trl",
            lambda s: torch.arange(2) + 2 * s,
            lambda s: torch.arange(6) if s == 0 else torch.arange(0),
            sequences_first=True,
        )
        # verl: each step's updates first, then its sequences
        run("verl", lambda s: torch.arange(3) + 3 * s, lambda s: torch.arange(3) + 3 * s, sequences_first=False)
    assert not [w for w in caught if "matched no recorded update" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run("off", lambda s: torch.arange(3) + 3 * s, lambda s: torch.arange(3) + 3 * s + 100, sequences_first=False)
    said = [str(w.message) for w in caught if "matched no recorded update" in str(w.message)]
    assert said == [
        "entropylens: 9 sequences of record_sequences in run 'off' (rank 0) matched no recorded update "
        "at their step or a later one: seq 100 (step 0), 101 (step 0), 102 (step 0), 103 (step 1), "
        "104 (step 1), ...; their rewards join no tokens. Pass record_update the same seq_ids"
    ]
    resp = entropylens.open(tmp_path, runs=["off"]).analysis("responses")
    assert resp["reward"].isna().all()  # what the warning says: nothing joined


def test_untrained_sequences_past_the_cap_are_counted(tmp_path, monkeypatch):
    # the writer keeps UNTRAINED_CAP of them by id (bounded memory in a run whose ids never match), counts the rest
    from entropylens.record.writing import step_table

    monkeypatch.setattr(step_table, "UNTRAINED_CAP", 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run="r", fsync=False) as rec:
            _train(rec, 0, *_batch(2, 3, 0), seq_ids=torch.arange(2))
            rec.record_sequences(0, seq_ids=[0, 7, 8, 9], rewards=[1.0] * 4, advantages=[0.0] * 4, lengths=[3] * 4)
    said = [str(w.message) for w in caught if "matched no recorded update" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(
        "entropylens: 3 sequences of record_sequences in run 'r' (rank 0) "
        "matched no recorded update at their step or a later one: seq 7 "
        "(step 0), 8 (step 0), ...;"
    )


def test_a_minus_inf_logprob_is_nonfinite_counted_and_alarmed_not_a_finite_number(tmp_path):
    # a -inf logit at a sampled token: stats gives the lowest finite float32 (the loss's gradient stays
    # finite); stored as -inf, counted in n_nonfinite_ratio (its k3 is inf), out of kl_k3, and the alarm fires
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Recorder(tmp_path, run="r", fsync=False) as rec:
            for step in range(3):
                logits, tokens, mask, adv, old_lp, old_h = _batch(4, 5, step)
                if step == 1:
                    logits = logits.detach().clone()
                    logits[2, 3, tokens[2, 3]] = float("-inf")
                    logits.requires_grad_()
                _train(rec, step, logits, tokens, mask, adv, old_lp, old_h)
            # a -inf old log-prob given as it is (its ratio is inf): recorded, counted; NaN is still refused
            lp = torch.full((2, 3), -1.0)
            old = lp.clone()
            old[0, 0] = float("-inf")
            m = torch.ones(2, 3, dtype=torch.bool)
            rec.record_update(
                3,
                0,
                mask=m,
                advantages=torch.tensor([1.0, -1.0]),
                logprobs=lp,
                old_logprobs=old,
                seq_ids=torch.tensor([0, 1]),
            )
            with pytest.raises(ValueError, match="^logprobs contains NaN or Inf at masked-in positions"):
                rec.record_update(
                    3,
                    1,
                    mask=m,
                    advantages=torch.ones(2),
                    logprobs=torch.full((2, 3), math.nan),
                    old_logprobs=lp,
                    seq_ids=torch.tensor([5, 6]),
                )
    con = entropylens.open(tmp_path)
    steps = con.sql("SELECT step, n_tokens, n_nonfinite_ratio, kl_k3 FROM steps ORDER BY step")
    assert steps["n_nonfinite_ratio"].tolist() == [0, 1, 0, 1]
    assert all(math.isfinite(k) and k < 10 for k in steps["kl_k3"])  # the finite tokens' mean, not 1e37
    bad = con.sql(
        "SELECT step, seq, pos, logprob, old_logprob, ratio FROM tokens WHERE isinf(logprob) "
        "OR isinf(old_logprob) ORDER BY step"
    )
    assert bad[["step", "seq", "pos"]].values.tolist() == [[1, 2, 3], [3, 0, 0]]
    assert bad["logprob"].iloc[0] == -math.inf and bad["ratio"].iloc[0] == 0.0
    assert bad["old_logprob"].iloc[1] == -math.inf and bad["ratio"].iloc[1] == math.inf
    assert con.sql("SELECT min(logprob) AS m FROM tokens WHERE NOT isinf(logprob)")["m"].iloc[0] > -100
    found = {(f.step, f.rule, f.signal) for f in check(tmp_path) if f.rule == "nonfinite"}
    assert found == {(1, "nonfinite", "n_nonfinite_ratio"), (3, "nonfinite", "n_nonfinite_ratio")}


def test_masked_out_positions_may_hold_any_token_id(tmp_path):
    # HF-style labels: -100 at padding positions; only masked-in ids must lie in the vocabulary
    logits, tokens, mask, adv, _, _ = _batch(2, 5, 0)
    mask[:, 3:] = False
    padded = tokens.clone()
    padded[:, 3:] = -100
    old_lp, old_h = old_policy_pass(logits.detach() + 0.1, padded, mask=mask)
    ref_lp, ref_h = old_policy_pass(logits.detach() + 0.1, tokens)
    assert torch.equal(old_lp[mask], ref_lp[mask]) and torch.equal(old_h[mask], ref_h[mask])
    with Recorder(tmp_path, run="r", fsync=False) as rec:
        _train(rec, 0, logits, padded, mask, adv, old_lp, old_h)
        bad = padded.clone()
        bad[0, 0] = -100  # masked in: still refused
        with pytest.raises(ValueError, match=r"^tokens must lie in \[0, 7\)"):
            _train(rec, 1, logits.detach().clone().requires_grad_(), bad, mask, adv, old_lp, old_h)
    got = entropylens.open(tmp_path).sql("SELECT seq, pos, token_id FROM tokens ORDER BY seq, pos")
    assert got["token_id"].tolist() == tokens[:, :3].reshape(-1).tolist()


def _fail_from_step(root, run, step):
    """A file where the writer needs step ``step``'s token folder: writing that step fails."""
    (root / run / "tokens").mkdir(parents=True, exist_ok=True)
    (root / run / "tokens" / f"step={step}").write_text("in the way")


def test_a_stopped_recording_is_said_at_close_naming_the_first_step_lost(tmp_path):
    # a fast loop ends before the writer fails: close() is the only call left, and it says so
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recorder(tmp_path, run="r", fsync=False, on_error="warn")
        for step in range(2):
            rec.record_update(step, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
        rec.commit()  # steps 0 and 1 are on disk
        _fail_from_step(tmp_path, "r", 2)
        for step in range(2, 4):
            rec.record_update(step, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
        rec.close()
    said = [str(w.message) for w in caught if "recording stopped" in str(w.message)]
    assert len(said) == 1
    assert said[0].startswith("entropylens: recording stopped at step 2 (the Parquet writer failed: ")
    assert said[0].endswith("); steps 2.. of run 'r' (rank 0) are not recorded, training goes on")
    assert _status(tmp_path, "r") == "failed"
    assert entropylens.open(tmp_path).sql("SELECT step FROM steps ORDER BY step")["step"].tolist() == [0, 1]


def test_a_stopped_recording_is_said_once_at_the_next_call_too(tmp_path):
    lp = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, run="r", fsync=False, on_error="warn") as rec:
            _fail_from_step(tmp_path, "r", 0)
            rec.record_update(0, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
            rec.commit()  # the failure happens here and is said here
            for step in range(1, 4):  # training goes on, recording nothing
                rec.record_update(step, 0, mask=m, advantages=torch.ones(2), logprobs=lp, old_logprobs=lp)
    said = [w for w in caught if "recording stopped" in str(w.message)]
    assert len(said) == 1 and str(said[0].message).startswith("entropylens: recording stopped at step 0 ")
    assert said[0].filename == __file__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_duplicate_seq_ids_on_cuda_are_found_without_a_sync(tmp_path):
    # on CUDA the ids are not read on the caller's thread (every synchronising call raises here): the
    # writer thread finds them in the update's host copy, and the next call raises
    dev = torch.device("cuda")
    lp = torch.full((4, 3), -1.0, device=dev)
    m = torch.ones(4, 3, dtype=torch.bool, device=dev)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0], device=dev)
    with Recorder(tmp_path, run="r", fsync=False) as rec:
        torch.cuda.set_sync_debug_mode("error")
        try:
            rec.record_update(
                0,
                0,
                mask=m,
                advantages=adv,
                logprobs=lp,
                old_logprobs=lp - 0.1,
                seq_ids=torch.tensor([5, 0, 5, 0], device=dev),
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        rec.step_summary(0)
        with pytest.raises(ValueError, match=r"^seq_ids: step 0 update 0 gives seq ids 0, 5 to more than one row; "):
            rec.record_step(0, grad_norm=1.0)
        rec.record_update(
            1, 0, mask=m, advantages=adv, logprobs=lp, old_logprobs=lp, seq_ids=torch.arange(4, device=dev)
        )
    assert entropylens.open(tmp_path).sql("SELECT DISTINCT step FROM tokens")["step"].tolist() == [1]
