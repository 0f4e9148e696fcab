"""A small run recorded with the real Recorder (real updates, real files), and the answers a reader gives
for it, for the tests that tamper with one file and compare the untouched steps."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from recorded_batches import B, record_one  # noqa: E402

from entropylens import Recorder  # noqa: E402

STEPS = 3


def record_run(root, run: str = "r", *, ranks: int = 1, steps: int = STEPS) -> Path:
    """``root/run``: ``steps`` steps of one update per rank (ranks recorded one after the other), with
    their sequences."""
    for rank in range(ranks):
        with Recorder(root, run=run, rank=rank, world_size=ranks, fsync=False) as rec:
            for step in range(steps):
                record_one(rec, step, 0, seed=step * 10 + rank)
                rec.record_sequences(
                    step,
                    seq_ids=torch.arange(B),
                    rewards=torch.arange(B, dtype=torch.float32) + step,
                    advantages=torch.ones(B),
                    lengths=torch.full((B,), 9),
                )
    return Path(root) / run


TOKEN_ANSWER = (
    "SELECT step, rank, count(*) AS n, count(entropy) AS n_entropy, sum(entropy) AS entropy, "
    "sum(logprob) AS logprob, sum(token_id) AS token_id, sum(ratio) AS ratio, "
    "count(entropy_ratio) AS n_rho FROM tokens GROUP BY step, rank ORDER BY step, rank"
)


def answers(path, sql: str = TOKEN_ANSWER) -> tuple[dict, list[str]]:
    """{(step, rank): the row of ``sql``} and the warnings the connection gave."""
    from entropylens.read.query import UnreadableFileWarning, connect

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        con = connect(path)
        rows = con.execute(sql).fetchall()
    said = [str(w.message) for w in caught if issubclass(w.category, UnreadableFileWarning)]
    return {(r[0], r[1]): r[2:] for r in rows}, said
