"""The report's two palettes, one for each kind of thing a colour names, never sharing a hue.

Quadrants: green for A > 0, red for A < 0, dark for high probability (p >= tau), light for low. The same
four colours in every figure and in the token viewer (viewer.py hands them to viewer.js).
Runs / series (and the viewer's updates): ten colours with no green and no red, so a line of a run never
reads as a quadrant. Beyond ten series plots.py draws from larger palettes.
"""

from __future__ import annotations

QUADRANT_COLORS: dict[str, str] = {
    "PA&HP": "#2e7d32",  # dark green
    "PA&LP": "#8bc34a",  # light green
    "NA&HP": "#c62828",  # dark red
    "NA&LP": "#f28b82",  # light red
    "ZA": "#9e9e9e",  # zero advantage: grey
}
RUN_COLORS: tuple[str, ...] = (
    "#1f77b4",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#393b79",
    "#bcbd22",
    "#7f7f7f",
    "#e7ba52",
)
