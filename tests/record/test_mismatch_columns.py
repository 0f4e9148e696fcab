"""The training-inference mismatch columns by hand: tokens.sampler_logprob / is_masked / sampler_log_ratio
and the steps' sampler_abs_log_ratio_mean / _max / _mean_<q>, sampler_kl_k1 / _k3, is_masked_frac,
clipped_mismatched_frac, through a real Recorder, Parquet and DuckDB; null (never 0) without them."""

import math

import pytest
import torch

from entropylens import Recorder
from entropylens.integrations.torch import policy_update
from entropylens.read.query import connect
from entropylens.record.device import blocks, packed_block

STEP_COLS = (
    "sampler_abs_log_ratio_mean",
    "sampler_abs_log_ratio_max",
    "sampler_kl_k1",
    "sampler_kl_k3",
    "is_masked_frac",
    "clipped_mismatched_frac",
    "sampler_abs_log_ratio_mean_pa_hp",
    "sampler_abs_log_ratio_mean_pa_lp",
    "sampler_abs_log_ratio_mean_na_hp",
    "sampler_abs_log_ratio_mean_na_lp",
)

# 2 sequences x 3 positions, position (1, 2) masked out: 5 tokens. A = +1 (seq 0), -1 (seq 1).
#   old_logprob  -1    -1    -1   | -1    -1    (-1)      p = e^-1 = 0.37 < tau 0.5... : all LP
#   logprob      -1   -0.5   -1   | -1   -1.5   (-1)      r = e^0.5 = 1.65 > 1.2 (A > 0), e^-0.5 = 0.61 < 0.8
#                                                        (A < 0): clipped (0, 1) and (1, 1)
#   sampler      -1.1 -0.2   -1   | -2    -1    (5)
#   d = old - s   0.1 -0.8    0   |  1     0              |d| sum 1.9, d sum 0.3
#   is_masked     F    F     F    |  T     F    (T)
# sampler_abs_log_ratio_mean = 1.9 / 5 = 0.38; _max = 1.0
# sampler_kl_k1 = mean(-d) = -0.3 / 5 = -0.06
# sampler_kl_k3 = mean(e^d - d - 1) = ((e^0.1 - 1.1) + (e^-0.8 - 0.2) + 0 + (e - 2) + 0) / 5
# is_masked_frac = 1 / 5 = 0.2
# mismatched (|d| > ln 2 = 0.693, or masked): (0, 1) and (1, 0); clipped (0, 1), (1, 1) -> 1 of 2 = 0.5
# by quadrant: PA&LP (seq 0) |d| = (0.1 + 0.8 + 0) / 3 = 0.3; NA&LP (seq 1) (1 + 0) / 2 = 0.5; HP: null
MASK = torch.tensor([[True, True, True], [True, True, False]])
OLD = torch.full((2, 3), -1.0)
NEW = torch.tensor([[-1.0, -0.5, -1.0], [-1.0, -1.5, -1.0]])
SAMPLER = torch.tensor([[-1.1, -0.2, -1.0], [-2.0, -1.0, 5.0]])
MASKED = torch.tensor([[False, False, False], [True, False, True]])
ADV = torch.tensor([1.0, -1.0])
K3 = ((math.exp(0.1) - 1.1) + (math.exp(-0.8) - 0.2) + (math.e - 2)) / 5
WANT = (0.38, 1.0, -0.06, K3, 0.2, 0.5, None, 0.3, None, 0.5)
# the counts the means are over: 5 tokens with a sampler log-prob, 2 of them clipped
COUNT_COLS = ("n_sampled", "n_sampled_clipped")


def _record(path, **kw):
    with Recorder(path, run="m", tau=0.5) as rec:
        rec.record_update(
            0, 0, mask=MASK, advantages=ADV, logprobs=NEW, old_logprobs=OLD, seq_ids=torch.tensor([3, 4]), **kw
        )
    return connect(path)


def _approx(row, want):
    assert [r is None for r in row] == [w is None for w in want], row
    assert [r for r in row if r is not None] == pytest.approx([w for w in want if w is not None], rel=1e-6, abs=1e-7)


def test_hand_built_columns_and_step_figures(tmp_path):
    con = _record(tmp_path, sampler_logprobs=SAMPLER, is_masked=MASKED)
    _approx(con.execute(f"SELECT {', '.join(STEP_COLS)} FROM steps").fetchone(), WANT)
    assert con.execute(f"SELECT {', '.join(COUNT_COLS)} FROM steps").fetchone() == (5, 2)
    toks = con.execute(
        "SELECT clipped, sampler_logprob, is_masked, sampler_log_ratio FROM tokens ORDER BY seq, pos"
    ).fetchall()
    assert [t[0] for t in toks] == [False, True, False, False, True]
    assert [t[1] for t in toks] == pytest.approx([-1.1, -0.2, -1.0, -2.0, -1.0], rel=1e-6)
    assert [t[2] for t in toks] == [False, False, False, True, False]
    assert [t[3] for t in toks] == pytest.approx([0.1, -0.8, 0.0, 1.0, 0.0], abs=1e-6)
    types = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE tokens)").fetchall())
    assert (types["sampler_logprob"], types["is_masked"]) == ("FLOAT", "BOOLEAN")


def test_absent_is_null_not_zero(tmp_path):
    con = _record(tmp_path)
    assert con.execute(f"SELECT {', '.join(STEP_COLS)} FROM steps").fetchone() == (None,) * len(STEP_COLS)
    assert con.execute(f"SELECT {', '.join(COUNT_COLS)} FROM steps").fetchone() == (None, None)
    assert con.execute(
        "SELECT count(*), count(sampler_logprob), count(is_masked), count(sampler_log_ratio) FROM tokens"
    ).fetchone() == (5, 0, 0, 0)


def test_sampler_without_masking_correction_nulls_is_masked_only(tmp_path):
    # no is_masked: is_masked_frac null; mismatched by |d| alone: (0, 1) and (1, 0), still 1 of the 2 clipped
    con = _record(tmp_path, sampler_logprobs=SAMPLER)
    _approx(con.execute(f"SELECT {', '.join(STEP_COLS)} FROM steps").fetchone(), WANT[:4] + (None, 0.5) + WANT[6:])
    assert con.execute("SELECT count(is_masked), count(sampler_logprob) FROM tokens").fetchone() == (0, 5)


def test_unscored_token_nan_is_null_and_left_out(tmp_path):
    # the sampler did not score (0, 1) (TRL: NaN): left out, as TRL does. |d| = 0.1, 0, 1, 0: mean 1.1 / 4;
    # k1 = -(1.1) / 4; k3 = ((e^0.1 - 1.1) + (e - 2)) / 4; clipped with a sampler log-prob: (1, 1) alone,
    # not mismatched -> 0; PA&LP (0.1 + 0) / 2
    s = SAMPLER.clone()
    s[0, 1] = float("nan")
    con = _record(tmp_path, sampler_logprobs=s, is_masked=MASKED)
    k3 = ((math.exp(0.1) - 1.1) + (math.e - 2)) / 4
    _approx(
        con.execute(f"SELECT {', '.join(STEP_COLS)} FROM steps").fetchone(),
        (1.1 / 4, 1.0, -1.1 / 4, k3, 0.2, 0.0, None, 0.05, None, 0.5),
    )
    assert con.execute(f"SELECT {', '.join(COUNT_COLS)} FROM steps").fetchone() == (4, 1)  # (0, 1) left out
    assert con.execute(
        "SELECT sampler_logprob, sampler_log_ratio FROM tokens WHERE seq = 3 AND pos = 1"
    ).fetchone() == (None, None)


def test_stacked_updates_equal_each_alone():
    """The writer thread stacks a step's updates: row u of the stacked block equals update u's own."""
    cols = {
        "advantage": ADV.unsqueeze(1).expand(2, 3),
        "logprob": NEW,
        "old_logprob": OLD,
        "ratio": torch.exp(NEW - OLD),
        "quadrant": torch.tensor([[2] * 3, [4] * 3], dtype=torch.int8),
        "clip": torch.tensor([[0, 1, 0], [0, -1, 0]], dtype=torch.int8),
        "clipped": torch.tensor([[False, True, False], [False, True, False]]),
        "sampler_logprob": SAMPLER,
        "is_masked": MASKED,
    }
    other = {**cols, "sampler_logprob": SAMPLER - 0.3, "is_masked": ~MASKED}
    finite, seq, group = packed_block.FiniteFlags((), None), torch.tensor([3, 4]), torch.tensor([0, 0])
    a, layout = blocks.update_block(dict(cols), MASK, None, finite, seq, group, None, 0, 1.0)
    b, _ = blocks.update_block(dict(other), MASK, None, finite, seq, group, None, 0, 1.0)
    both, _ = blocks.update_block(
        {k: torch.stack([cols[k], other[k]]) for k in cols},
        torch.stack([MASK, MASK]),
        None,
        finite,
        torch.stack([seq, seq]),
        torch.stack([group, group]),
        None,
        0,
        1.0,
    )
    assert torch.equal(both[0], a) and torch.equal(both[1], b)
    host = packed_block.unpack(a.numpy(), layout)
    assert "is_masked" in layout.bool_names and "sampler_logprob" in layout.float_names
    assert [host.aggregates[n] for n in STEP_COLS[:6]] == pytest.approx(WANT[:6], rel=1e-6)
    assert [host.aggregates[n] for n in COUNT_COLS] == [5, 2]


def test_live_summary_weighs_each_mean_by_its_own_count(tmp_path):
    """The step summary (trackers, the live alarms) pools a step's updates as mismatch_by_step does: the
    means by the tokens with a sampler log-prob, clipped_mismatched_frac by the clipped ones among them.
    Update 0: the hand batch (5 tokens, 5 scored, 2 of them clipped; k3 = K3, clipped_mismatched 1 / 2).
    Update 1: the same 5 tokens, the sampler scored seq 1 alone: (1, 0) d = -1 - (-2) = 1 (masked) and
    (1, 1) d = -1 - (-2) = 1 (clipped, |d| > ln 2: mismatched): n_sampled 2, n_sampled_clipped 1,
    |d| mean 1, k1 -1, k3 e - 2, clipped_mismatched 1 / 1; PA&LP none scored (null), NA&LP mean 1.
      sampler_kl_k3 = (5 K3 + 2 (e - 2)) / 7                (n_tokens-weighted: (5 K3 + 5 (e - 2)) / 10)
      sampler_abs_log_ratio_mean = (5 x 0.38 + 2 x 1) / 7 = 3.9 / 7          (by n_tokens: 6.9 / 10)
      sampler_kl_k1 = (5 x -0.06 + 2 x -1) / 7 = -2.3 / 7                     (by n_tokens: -5.3 / 10)
      clipped_mismatched_frac = (2 x 0.5 + 1 x 1) / 3 = 2 / 3                 (by n_tokens: 0.75)
      sampler_abs_log_ratio_mean_pa_lp = 0.3 (update 0 alone); _na_lp = (2 x 0.5 + 2 x 1) / 4 = 0.75"""
    seq1 = torch.full((2, 3), float("nan"))
    seq1[1, :2] = -2.0
    with Recorder(tmp_path, run="s", tau=0.5) as rec:
        for u, s in enumerate((SAMPLER, seq1)):
            rec.record_update(
                0,
                u,
                mask=MASK,
                advantages=ADV,
                logprobs=NEW,
                old_logprobs=OLD,
                seq_ids=torch.tensor([3, 4]),
                sampler_logprobs=s,
                is_masked=MASKED,
            )
        summary = rec.step_summary(0)
    assert (summary["n_sampled"], summary["n_sampled_clipped"]) == (7, 3)
    assert summary["sampler_kl_k3"] == pytest.approx((5 * K3 + 2 * (math.e - 2)) / 7, rel=1e-6)
    assert summary["sampler_abs_log_ratio_mean"] == pytest.approx(3.9 / 7, rel=1e-6)
    assert summary["sampler_kl_k1"] == pytest.approx(-2.3 / 7, rel=1e-6)
    assert summary["clipped_mismatched_frac"] == pytest.approx(2 / 3, rel=1e-6)
    assert summary["sampler_abs_log_ratio_mean_pa_lp"] == pytest.approx(0.3, rel=1e-6)
    assert summary["sampler_abs_log_ratio_mean_na_lp"] == pytest.approx(0.75, rel=1e-6)
    with Recorder(tmp_path / "none", run="t", tau=0.5) as rec:
        rec.record_update(0, 0, mask=MASK, advantages=ADV, logprobs=NEW, old_logprobs=OLD, seq_ids=torch.tensor([3, 4]))
        summary = rec.step_summary(0)
    assert not {"n_sampled", "n_sampled_clipped", "sampler_kl_k3"} & summary.keys()  # not measured: left out


def test_policy_update_records_sampler_logprobs(tmp_path):
    """policy_update passes sampler_logprobs / is_masked to the recorder: the figures follow from its
    own old_logprobs (here the trainer's) and the given sampler log-probs."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    tokens = torch.tensor([[0, 1, 2], [3, 4, 0]])
    old = torch.log_softmax(logits.detach(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    s = old - torch.tensor([[0.1, -0.8, 0.0], [1.0, 0.0, 0.0]])  # d = old - s as in the hand batch
    with Recorder(tmp_path, run="p") as rec:
        out = policy_update(
            rec,
            0,
            0,
            logits,
            tokens,
            MASK,
            ADV,
            old,
            seq_ids=torch.tensor([3, 4]),
            sampler_logprobs=s,
            is_masked=MASKED[:, :1],
        )
        out.loss.backward()
    con = connect(tmp_path)
    row = con.execute("SELECT sampler_abs_log_ratio_mean, sampler_kl_k1, is_masked_frac FROM steps").fetchone()
    assert row == pytest.approx((0.38, -0.06, 2 / 5), rel=1e-5)  # is_masked [B, 1]: seq 1's 2 tokens
