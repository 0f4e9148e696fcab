"""A small token-viewer page's data, and texts that try to break out of the page: shared by the viewer's
tests (the page file, and the page in Chromium)."""

from __future__ import annotations

from entropylens.report import responses

HOSTILE = [
    "</script><script>window.PWNED=1</script>",
    "</SCRIPT >",
    "<!--<script>",
    "<\\/script>",
    "-->",
    "]]>",
    "\u2028\u2029",
    "\ud7ff\ue000",
    "a\nb\tc\r",
    "<style></style>",
    "&lt;&amp;",
    "'\"`",
]


def small_data(text: str | None = "hello") -> dict:
    """A page's data of the format page_data writes (two responses, one without text), by hand."""
    cols = list(responses.TOKEN_COLUMNS)
    row = [
        0,
        17,
        0.5,
        -0.6931472,
        -0.6931472,
        1.0,
        0.25,
        "PA&HP",
        0,
        False,
        1.25,
        1.5,
        0.8333333,
        True,
        None,
        None,
        None,
        None,
        -0.125,
        0.33,
        1e-07,
        None,
        None,
        None,
        None,
    ]
    assert len(row) == len(cols)
    resp = {
        "seq": 3,
        "rank": 0,
        "group": 1,
        "gen_step": 4,
        "why": ["highest reward"],
        "text": text,
        "summary": {
            "reward": 1.0,
            "advantage": 0.25,
            "length": 2,
            "tokens": 2,
            "updates": 1,
            "mean_entropy": 1.5,
            "max_entropy": 1.5,
            "clipped": 0,
            "erc_dropped": 0,
            "entropy_effect": 1e-07,
            "entropy_effect_dropped": None,
        },
        "pos": [0, 1],
        "tokens": [text or "", "</script>"],
        "forking": [0],
        "rows": {"0": [row, [1] + row[1:5] + ["inf", "-inf"] + row[7:]]},
    }
    return {
        "run": "r",
        "method": "grpo",
        "columns": cols,
        "summary_columns": list(responses.SUMMARY_COLUMNS),
        "metrics": [
            {
                "key": m.key,
                "label": m.label,
                "scale": m.scale,
                "center": m.center,
                "categories": [[v, lab] for v, lab in m.categories],
            }
            for m in responses.METRICS
        ],
        "has_text": True,
        "text_source": "a vocabulary",
        "text_hint": "",
        "selection": "2 of 2 responses",
        "where": None,
        "candidates": 2,
        "max_bytes": 4_000_000,
        "forking_share": 0.2,
        "steps": [{"step": 4, "updates": [0], "responses": [resp, {**resp, "seq": 5, "text": None}]}],
    }
