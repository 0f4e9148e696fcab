"""Token rows selected for a whole file at once (packed_block.rows_of, token_buffer.TokenBuffer) equal
the rows each update gives alone (HostUpdate.rows), in the same order, column for column."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from entropylens.record.device import packed_block
from entropylens.record.writing.token_buffer import TokenBuffer
from entropylens.rl import aggregates


def packed_update(seed: int, b: int = 3, t: int = 5, *, tokens: bool = True, erc: bool = True, sample: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < 0.8
    selected = mask & (torch.rand(b, 1, generator=g) < sample)  # whole sequences kept or dropped
    cols = {
        name: torch.randn(b, t, generator=g)
        for name in ("logprob", "old_logprob", "advantage", "entropy", "old_entropy", "grad_coef")
    }
    cols["quadrant"] = torch.randint(0, 5, (b, t), generator=g)
    cols["clip"] = torch.randint(-1, 2, (b, t), generator=g)
    cols["clipped"] = torch.rand(b, t, generator=g) < 0.3
    if erc:
        cols["erc_kept"] = torch.rand(b, t, generator=g) < 0.7
    aggs = torch.randn(len(aggregates.AGG_NAMES), generator=g, dtype=torch.float64)
    packed, layout = packed_block.pack(
        cols,
        selected,
        aggs,
        {},
        seq=torch.arange(b) + 10 * seed,
        group=torch.arange(b) // 2,
        mask=mask,
        tokens=torch.randint(0, 50, (b, t), generator=g) if tokens else None,
    )
    return packed_block.unpack(packed.numpy(), layout)


def one_by_one(hosts, updates) -> dict[str, np.ndarray]:
    parts = []
    for h, u in zip(hosts, updates):
        r = h.rows()
        r["update"] = np.full(len(r["seq"]), u, np.int16)
        parts.append(r)
    return {k: np.concatenate([r[k] for r in parts]) for k in parts[0]}


def assert_rows_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("tokens,erc", [(True, True), (False, False), (True, False)])
def test_rows_of_equals_each_update_alone(tokens, erc):
    hosts = [packed_update(s, tokens=tokens, erc=erc) for s in range(4)]
    updates = [3, 4, 5, 7]
    got = packed_block.rows_of(hosts, updates)
    want = one_by_one(hosts, updates)
    assert len(want["seq"]) > 0
    assert_rows_equal(got, want)
    # spot check against the packed inputs: the first row of update 4 is its first selected position
    h = hosts[1]
    first = np.flatnonzero(h.selected)[0]
    row = len(hosts[0].rows()["seq"])
    assert got["update"][row] == 4 and got["pos"][row] == first % 5 and got["seq"][row] == h.seq[first // 5]
    assert got["logprob"][row] == h.columns["logprob"][first]


def test_rows_of_updates_of_different_shapes_and_one_update():
    hosts = [packed_update(0, b=2, t=4), packed_update(1, b=3, t=5), packed_update(2, b=2, t=4)]
    assert_rows_equal(packed_block.rows_of(hosts, [0, 1, 2]), one_by_one(hosts, [0, 1, 2]))
    assert_rows_equal(packed_block.rows_of(hosts[:1], [9]), one_by_one(hosts[:1], [9]))
    none = packed_update(3, sample=0.0)  # nothing selected
    got = packed_block.rows_of([none, none], [0, 1])
    assert all(len(v) == 0 for v in got.values()) and set(got) == set(one_by_one([none], [0]))


def test_host_update_decodes_its_columns_lazily_as_before():
    h = packed_update(5)
    # the flags word: quadrant 3 bits | clip + 1 << 3 | clipped << 5 | erc_kept << 6 | selected << 7 | mask << 8
    f = h.flags
    np.testing.assert_array_equal(h.columns["quadrant"], f & 7)
    np.testing.assert_array_equal(h.columns["clip"], ((f >> 3) & 3) - 1)
    np.testing.assert_array_equal(h.selected, (f >> 7) & 1 == 1)
    np.testing.assert_array_equal(h.masked, (f >> 8) & 1 == 1)
    assert h.n_selected == h.selected.sum() == len(h.rows()["seq"])


@pytest.mark.parametrize("rows_per_file", [1, 7, 20, 10_000])
def test_token_buffer_files_equal_the_per_update_rows(rows_per_file):
    # the same files (steps, update ranges, rows) as buffering each update's ready rows
    hosts = {(s, u): packed_update(10 * s + u, sample=0.5) for s in range(2) for u in range(4)}
    lazy, ready = TokenBuffer(rows_per_file), TokenBuffer(rows_per_file)
    files_lazy, files_ready = [], []
    for (s, u), h in hosts.items():
        files_lazy += lazy.add(s, u, h)
        files_ready += ready.add(s, u, one_by_one([h], [u]))
    files_lazy += lazy.flush()
    files_ready += ready.flush()
    assert [(s, r) for s, r, _ in files_lazy] == [(s, r) for s, r, _ in files_ready]
    for (_, _, a), (_, _, b) in zip(files_lazy, files_ready):
        assert_rows_equal(a, b)


def test_token_buffer_bounds_the_blocks_it_holds_and_mixes_ready_rows():
    # rows_per_file 40: past 80 positions held (15 per update) the held blocks' rows are selected at once
    buf = TokenBuffer(40)
    hosts = [packed_update(u, sample=0.2) for u in range(12)]
    ready = one_by_one([packed_update(99)], [12])
    out = []
    for u, h in enumerate(hosts):
        out += buf.add(0, u, h)
        assert buf._held <= 80
    out += buf.add(0, 12, ready)
    out += buf.flush()
    allrows = {k: np.concatenate([f[2][k] for f in out]) for k in out[0][2]}
    want = one_by_one(hosts, list(range(12)))
    want = {k: np.concatenate([want[k], ready[k]]) for k in want}
    assert_rows_equal(allrows, want)
    assert out[0][1][0] == 0 and out[-1][1][1] == 12
