"""The token viewer page (entropylens/report/viewer.py) driven in a real headless Chromium through Playwright.

A run recorded by a plain loop through the real Recorder and policy_loss (DAPO with ERC, entropy
attribution, a vocabulary with newlines, tabs and "</script>" in it, a masked-out stretch in one response);
its page built by responses.select / page_data / viewer.write_page and opened from disk. What the page
shows is checked against the run's Parquet files read back independently (DuckDB read_parquet): every
value of a hovered token, the forking marks, the counts across updates, the list, the hash navigation.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from entropylens import Recorder
from entropylens.read.query import connect
from entropylens.report import responses
from entropylens.report.palette import QUADRANT_COLORS
from entropylens.report.viewer import page_name, write_page
from entropylens.rl.losses import policy_loss

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("CI"), reason="chromium not installed (CI installs it)"
)

RUN = "viewer-run"
STEPS, UPDATES, B, T, GROUP = 3, 2, 8, 40, 2
HOLE = (5, 8)  # the odd responses of each step: positions 5..7 masked out (tool output): no token rows
VOCAB = [
    " the",
    " cat",
    " sat",
    " on",
    " a",
    " mat",
    "\n",
    "\t",
    ".",
    ",",
    " 42",
    " =",
    "</script><script>window.PWNED=1</script>",
    "<!--<script>",
    " é",
    "  ",
    "Hello",
    " world",
    " ü",
    "\n\n",
    " x",
    " y",
    " +",
    " -",
    " (",
    ")",
    " if",
    " then",
    " else",
    " end",
    " ok",
    " no",
]
FLOAT_COLS = {
    "prob",
    "logprob",
    "old_logprob",
    "ratio",
    "advantage",
    "entropy",
    "old_entropy",
    "entropy_ratio",
    "is_weight",
    "grad_coef",
    "logit_grad_norm",
    "entropy_effect",
    "entropy_effect_dropped",
    "sampler_logprob",
    "sampler_log_ratio",
}
DERIVED = {
    "prob": "exp(old_logprob)",
    "ratio": "exp(logprob - old_logprob)",
    "entropy_ratio": "(entropy + 1e-8) / (old_entropy + 1e-8)",
    "sampler_log_ratio": "old_logprob - sampler_logprob",
}  # entropylens/schema.py's view formulas


def record(
    root: Path,
    run: str = RUN,
    *,
    b: int = B,
    t: int = T,
    steps: int = STEPS,
    min_len: int = 12,
    hole: tuple | None = HOLE,
) -> Path:
    gen = torch.Generator().manual_seed(7)
    with Recorder(root, run, config={"method": "dapo", "model": "plain-loop"}, tokenizer=VOCAB) as rec:
        for step in range(steps):
            lengths = torch.randint(min_len, t + 1, (b,), generator=gen)
            mask = torch.arange(t)[None, :] < lengths[:, None]  # [b, t]
            if hole:
                mask[1::2, hole[0] : hole[1]] = False
            ids = torch.randint(0, len(VOCAB), (b, t), generator=gen)
            p = 0.05 + 0.9 * torch.rand(b, t, generator=gen)
            old_logp, old_h = p.log(), 0.3 + 2.0 * torch.rand(b, t, generator=gen)
            rewards = torch.rand(b, generator=gen)
            r = rewards.view(-1, GROUP)
            adv = (r - r.mean(1, keepdim=True)).view(-1)
            seq_ids = torch.arange(b) + step * b
            groups = torch.arange(b) // GROUP + step * (b // GROUP)
            texts = ["".join(VOCAB[i] for i in ids[k, : int(lengths[k])].tolist()) for k in range(b)]
            rec.record_sequences(
                step, seq_ids=seq_ids, rewards=rewards, advantages=adv, lengths=lengths, group_ids=groups, texts=texts
            )
            for u in range(UPDATES):
                noise = torch.randn(b, t, generator=gen) if u else torch.zeros(b, t)
                logp = (old_logp + 0.3 * noise).clamp(max=0.0)
                h = old_h * torch.exp(0.04 * torch.randn(b, t, generator=gen)) if u else old_h
                out = policy_loss(
                    logp, old_logp, adv, mask, method="dapo", entropy=h, old_entropy=old_h, erc=(0.97, 1.03)
                )
                sens = 0.1 * torch.randn(b, t, generator=gen)
                rec.record_update(
                    step,
                    u,
                    mask=mask,
                    advantages=adv,
                    logprobs=logp,
                    old_logprobs=old_logp,
                    entropy=h,
                    old_entropy=old_h,
                    tokens=ids,
                    seq_ids=seq_ids,
                    group_ids=groups,
                    loss=out,
                    entropy_sensitivity=sens,
                )
                rec.record_step(step, update=u, grad_norm=0.5, lr=1e-3)
    return root


def build_page(root: Path, out: Path, run: str = RUN, n: int = 12) -> tuple[Path, dict]:
    from entropylens.read.run_decoder import decoder_for_run

    con = connect(root)
    sel = responses.select(con, run, n=n)
    data = responses.page_data(con, run, sel, decoder_for_run(root, run), method="dapo")
    con.close()
    return write_page(out / page_name(run), data, back_href="index.html"), data


def parquet_rows(root: Path, run: str, step: int, seq: int, update: int | None = None) -> list[dict]:
    """The token rows of one response read straight from the run's Parquet files (derived columns by
    the schema's formulas), ordered by update, pos."""
    import duckdb

    derived = "".join(f", CAST({e} AS FLOAT) AS {c}" for c, e in DERIVED.items())
    cond = f"step = {step} AND seq = {seq}" + (f' AND "update" = {update}' if update is not None else "")
    glob = str(root / run / "tokens" / "**" / "*.parquet")
    df = duckdb.sql(
        f"SELECT *{derived} FROM read_parquet('{glob}', hive_partitioning = true) WHERE {cond} ORDER BY \"update\", pos"
    ).df()
    return df.to_dict("records")


def check_value(col: str, shown: str, want) -> None:
    """One displayed value against the Parquet value: float32 exactly, ints, booleans, strings, null."""
    missing = want is None or (isinstance(want, float) and math.isnan(want)) or want is __import__("pandas").NA
    if missing:
        assert shown == "null", (col, shown, want)
    elif col in FLOAT_COLS:
        assert shown != "null", (col, shown, want)
        assert np.float32(float(shown)) == np.float32(want), (col, shown, want)
        assert float(shown) == float(str(np.float32(want))), (col, shown, want)  # the shortest float32 form
    elif isinstance(want, (bool, np.bool_)):
        assert shown == ("true" if want else "false"), (col, shown, want)
    elif col == "quadrant":
        assert shown == str(want), (col, shown, want)
    else:
        assert int(shown) == int(want), (col, shown, want)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    base = tmp_path_factory.mktemp("viewer")
    root = record(base / "runs")
    path, data = build_page(root, base / "report")
    return root, path, data


def open_page(browser, path: Path, hash_: str = "", width: int = 1300):
    pg = browser.new_page(viewport={"width": width, "height": 1000})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("request", lambda r: errors.append(f"request {r.url}") if not r.url.startswith(("file:", "data:")) else None)
    pg.goto(path.as_uri() + hash_)
    pg.wait_for_selector('body[data-ready="1"]')
    return pg, errors


def details(pg) -> dict[str, str]:
    return pg.eval_on_selector_all(
        "#el-details tr[data-col]",
        "rs => Object.fromEntries(rs.map(r => [r.getAttribute('data-col'), r.querySelector('td.v').textContent]))",
    )


def _rgb(hex_: str) -> str:
    """'#2e7d32' as the browser's computed style writes it: 'rgb(46, 125, 50)'."""
    return "rgb({}, {}, {})".format(*(int(hex_[i : i + 2], 16) for i in (1, 3, 5)))


def colours(pg) -> list[str]:
    return pg.eval_on_selector_all("#el-text span.tk", "ss => ss.map(s => getComputedStyle(s).backgroundColor)")


def test_click_switch_hover_values_equal_the_parquet_rows(page, browser, tmp_path):
    root, path, data = page
    pg, errors = open_page(browser, path)
    assert pg.evaluate("window.PWNED") is None  # the "</script>" token did not break out of the data
    assert pg.text_content("#el-run") == RUN
    assert data["selection"] in pg.text_content("#el-selection")
    assert "summed over the updates" in pg.text_content("#el-counts")  # what the counts sum over, and what "–" means
    assert "not applicable" in pg.text_content("#el-counts")
    assert "vocabulary" in pg.text_content("#el-textsource") or data["text_source"] in pg.text_content("#el-textsource")
    assert pg.get_attribute("#el-back", "href") == "index.html"

    # pick a step (one with a response with the masked-out stretch, then the most clipped such)
    sd, resp = max(
        ((s, r) for s in data["steps"] for r in s["responses"]),
        key=lambda sr: (sr[1]["seq"] % 2, sr[1]["summary"]["clipped"], -sr[0]["step"]),
    )
    assert resp["seq"] % 2 == 1 and resp["summary"]["clipped"] > 0
    step = sd["step"]
    pg.select_option("#el-step", str(step))
    rows = pg.eval_on_selector_all("#el-list tbody tr", "rs => rs.map(r => [+r.dataset.seq, +r.dataset.rank])")
    assert sorted(map(tuple, rows)) == sorted((r["seq"], r["rank"]) for r in sd["responses"])
    opts = pg.eval_on_selector_all("#el-update option", "os => os.map(o => +o.value)")
    assert opts == sd["updates"] == list(range(UPDATES))

    # sort by reward (a click on its header): descending, then ascending
    pg.click('#el-list th[data-key="reward"]')
    by = {(r["seq"], r["rank"]): r["summary"]["reward"] for r in sd["responses"]}
    shown = [
        by[tuple(x)]
        for x in pg.eval_on_selector_all("#el-list tbody tr", "rs => rs.map(r => [+r.dataset.seq, +r.dataset.rank])")
    ]
    assert shown == sorted(shown, reverse=True)
    pg.click('#el-list th[data-key="reward"]')
    shown = [
        by[tuple(x)]
        for x in pg.eval_on_selector_all("#el-list tbody tr", "rs => rs.map(r => [+r.dataset.seq, +r.dataset.rank])")
    ]
    assert shown == sorted(shown)

    # click that response
    seq = resp["seq"]
    pg.click(f'#el-list tbody tr[data-seq="{seq}"]')
    assert pg.get_attribute("#el-list tbody tr.sel", "data-seq") == str(seq)
    assert f"seq={seq}" in pg.evaluate("location.hash") and f"step={step}" in pg.evaluate("location.hash")

    # the spans: one per recorded position, in order, none invented for the masked-out ones
    rows_u1 = parquet_rows(root, RUN, step, seq, update=1)
    want_pos = [int(r["pos"]) for r in rows_u1]
    spans_pos = pg.eval_on_selector_all("#el-text span.tk", "ss => ss.map(s => +s.dataset.pos)")
    assert spans_pos == want_pos
    assert not set(range(*HOLE)) & set(spans_pos)
    assert pg.locator("#el-text .gap").count() == 1
    # each span's text is its token's string (newlines shown as a visible glyph, then a line break)
    texts = pg.eval_on_selector_all("#el-text span.tk", "ss => ss.map(s => s.textContent)")
    for tx, r in zip(texts, rows_u1):
        s = VOCAB[int(r["token_id"])]
        assert tx == s.replace("\n", "\u23ce\n").replace("\t", "\u21e5\t"), (tx, s)

    # the decoded completion: the sequence's recorded text
    import duckdb

    text = duckdb.sql(
        f"SELECT text FROM read_parquet('{root / RUN / 'sequences' / '**' / '*.parquet'}', "
        f"hive_partitioning = true) WHERE seq = {seq}"
    ).fetchall()[0][0]
    assert pg.text_content("#el-completion pre") == text == resp["text"]

    # the forking marks: responses.forking of the response's sampling entropy, from the Parquet rows
    rows_u0 = parquet_rows(root, RUN, step, seq, update=0)
    fork = {int(r["pos"]) for r, f in zip(rows_u0, responses.forking([r["old_entropy"] for r in rows_u0])) if f}
    marked = set(pg.eval_on_selector_all("#el-text span.tk.forking", "ss => ss.map(s => +s.dataset.pos)"))
    assert marked == fork and len(fork) >= math.ceil(0.2 * len(rows_u0))

    # switch the metric: the colours change; categorical: one colour per category, as responses.category says
    pg.select_option("#el-update", "1")
    pg.select_option("#el-metric", "entropy")
    c_entropy = colours(pg)
    assert float(pg.text_content('#el-legend [data-role="min"]')) == float(
        str(np.float32(min(r["entropy"] for r in rows_u1)))
    )
    assert float(pg.text_content('#el-legend [data-role="max"]')) == float(
        str(np.float32(max(r["entropy"] for r in rows_u1)))
    )
    pg.select_option("#el-metric", "ratio")
    c_ratio = colours(pg)
    assert c_ratio != c_entropy and len(set(c_ratio)) > 3
    pg.select_option("#el-metric", "clip")
    by_cat: dict = {}
    for c, r in zip(colours(pg), rows_u1):
        by_cat.setdefault(
            responses.category("clip", {k: (None if v is None or v != v else v) for k, v in r.items()}), set()
        ).add(c)
    assert all(len(v) == 1 for v in by_cat.values()), by_cat
    assert len({next(iter(v)) for v in by_cat.values()}) == len(by_cat)
    for metric in ("clip", "erc", "quadrant"):  # the legend's counts: responses.category over the Parquet rows
        pg.select_option("#el-metric", metric)
        counts = pg.eval_on_selector_all(
            "#el-legend .lg-cat",
            "cs => Object.fromEntries(cs.map(c => [c.dataset.cat, +c.querySelector('b').textContent]))",
        )
        want: dict = {}
        for r in rows_u1:
            c = responses.category(metric, {k: (None if v is None or v != v else v) for k, v in r.items()})
            want["null" if c is None else c] = want.get("null" if c is None else c, 0) + 1
        assert {k: v for k, v in counts.items() if v} == want, metric
    pg.select_option("#el-metric", "quadrant")  # the quadrants in the figures' own colours (palette.py)
    seen = set()
    for c, r in zip(colours(pg), rows_u1):
        q = responses.category("quadrant", {k: (None if v is None or v != v else v) for k, v in r.items()})
        if q in QUADRANT_COLORS:
            assert c == _rgb(QUADRANT_COLORS[q]), (q, c)
            seen.add(q)
    assert len(seen) >= 2, seen
    pg.select_option("#el-metric", "clip")
    assert pg.locator("#el-chart svg rect[fill]").count() == len(rows_u1)  # a coloured mark per position
    pg.select_option("#el-metric", "entropy_ratio")
    assert colours(pg) != c_ratio

    # hover tokens: the details panel shows every recorded value of that token at the chosen update
    picks = sorted({0, len(rows_u1) // 2, len(rows_u1) - 1, spans_pos.index(min(fork))})
    for i in picks:
        pg.hover(f'#el-text span.tk[data-pos="{want_pos[i]}"]')
        shown = details(pg)
        assert list(shown) == list(data["columns"]) == list(responses.TOKEN_COLUMNS)
        for col in responses.TOKEN_COLUMNS:
            check_value(col, shown[col], rows_u1[i][col])
        assert pg.text_content('#el-details [data-role="pos"]') == str(want_pos[i])
        assert pg.text_content('#el-details [data-role="update"]') == "1"
    # the other update: the values move with it
    pg.select_option("#el-update", "0")
    pg.hover(f'#el-text span.tk[data-pos="{want_pos[picks[1]]}"]')
    shown = details(pg)
    for col in responses.TOKEN_COLUMNS:
        check_value(col, shown[col], rows_u0[picks[1]][col])
    # a click pins a token: leaving the text shows the pinned one again
    pg.click(f'#el-text span.tk[data-pos="{want_pos[-1]}"]')
    pg.hover(f'#el-text span.tk[data-pos="{want_pos[0]}"]')
    pg.mouse.move(2, 2)
    assert pg.text_content('#el-details [data-role="pos"]') == str(want_pos[-1])

    # the chart: a mark per position with a value; across updates: one line per update and metric, counts
    pg.select_option("#el-metric", "entropy")
    assert pg.locator("#el-chart svg circle").count() == len(rows_u0)
    assert pg.locator("#el-updates svg path.up").count() == 2 * UPDATES
    for u in range(UPDATES):
        rs = parquet_rows(root, RUN, step, seq, update=u)
        tr = f'#el-updates tr[data-update="{u}"]'
        assert pg.text_content(f'{tr} td[data-key="tokens"]') == str(len(rs))
        assert pg.text_content(f'{tr} td[data-key="clipped"]') == str(sum(bool(r["clipped"]) for r in rs))
        dropped = sum(r["erc_kept"] is not None and r["erc_kept"] == r["erc_kept"] and not r["erc_kept"] for r in rs)
        assert pg.text_content(f'{tr} td[data-key="erc_dropped"]') == str(dropped)
        mean_ratio = float(np.mean([float(np.float32(r["ratio"])) for r in rs]))
        assert float(pg.text_content(f'{tr} td[data-key="mean_ratio"]')) == pytest.approx(mean_ratio, rel=1e-4)

    pg.select_option("#el-update", "1")
    pg.select_option("#el-metric", "entropy")
    pg.hover(f'#el-text span.tk[data-pos="{min(fork)}"]')
    pg.screenshot(path=str(tmp_path / "viewer.png"), full_page=True)
    pg.screenshot(path="/tmp/viewer_shot.png", full_page=True)
    assert (tmp_path / "viewer.png").stat().st_size > 20_000
    assert errors == []
    pg.close()


def test_hash_opens_that_step_and_response(page, browser):
    root, path, data = page
    sd = data["steps"][-1]
    resp = sd["responses"][-1]  # not the one shown by default
    pg, errors = open_page(browser, path, f"#step={sd['step']}&seq={resp['seq']}")
    assert pg.input_value("#el-step") == str(sd["step"])
    assert pg.get_attribute("#el-list tbody tr.sel", "data-seq") == str(resp["seq"])
    assert pg.eval_on_selector_all("#el-text span.tk", "ss => ss.map(s => +s.dataset.pos)") == resp["pos"]
    # a hash change (a link within the page, the back button) opens that response too
    other = sd["responses"][0]
    pg.evaluate(f"location.hash = '#step={sd['step']}&seq={other['seq']}&metric=ratio&update=1'")
    pg.wait_for_function(f"document.querySelector('#el-list tbody tr.sel').dataset.seq === '{other['seq']}'")
    assert pg.input_value("#el-metric") == "ratio" and pg.input_value("#el-update") == "1"
    # a step without embedded responses opens the nearest one, and says so
    pg2, errors2 = open_page(browser, path, f"#step={data['steps'][0]['step'] + 1000}")
    assert pg2.input_value("#el-step") == str(data["steps"][-1]["step"])
    assert "no embedded responses" in pg2.text_content("#el-note")
    assert errors == [] and errors2 == []
    pg.close()
    pg2.close()


def test_thousands_of_tokens_stay_fast(tmp_path, browser):
    root = record(tmp_path / "runs", "long", b=2, t=3000, steps=1, min_len=2800, hole=None)
    path, data = build_page(root, tmp_path / "report", "long", n=2)
    n = len(data["steps"][0]["responses"][0]["pos"])
    assert n >= 2800
    pg, errors = open_page(browser, path)
    assert pg.locator("#el-text span.tk").count() == n
    t0 = time.perf_counter()
    for m in ("ratio", "quadrant", "entropy", "clip", "entropy_effect"):
        pg.select_option("#el-metric", m)
    per_switch = (time.perf_counter() - t0) / 5
    assert per_switch < 1.0, per_switch  # recoloured in place (spans built once per response)
    pg.hover(f'#el-text span.tk[data-pos="{n // 2}"]')
    assert details(pg)["pos"] == str(n // 2)
    assert errors == []
    pg.close()


def test_ranks_infinities_and_hostile_text_by_hand(tmp_path, browser):
    """A hand-made page: the same seq on two ranks (the hash's rank picks one), "inf" values shown as
    embedded, a token text of "</script>" shown as text."""
    from viewer_data import small_data

    data = small_data("</script><script>window.PWNED=1</script>")
    resp = data["steps"][0]["responses"][0]
    data["steps"][0]["responses"] = [resp, {**resp, "rank": 1, "why": ["lowest reward"]}]
    path = write_page(tmp_path / "page.html", data)
    pg, errors = open_page(browser, path, "#step=4&seq=3&rank=1")
    assert pg.evaluate("window.PWNED") is None
    assert pg.get_attribute("#el-list tbody tr.sel", "data-rank") == "1"
    assert pg.locator('#el-list th[data-key="rank"]').count() == 1  # several ranks: the list shows them
    assert pg.text_content('#el-text span.tk[data-pos="0"]') == resp["tokens"][0]
    pg.hover('#el-text span.tk[data-pos="1"]')
    shown = details(pg)
    assert shown["ratio"] == "inf" and shown["advantage"] == "-inf" and shown["dual_clipped"] == "null"
    assert shown["entropy_effect"] == "1e-7" and shown["clipped"] == "false" and shown["quadrant"] == "PA&HP"
    assert "rank=1" in pg.evaluate("location.hash")
    assert errors == []
    pg.close()
