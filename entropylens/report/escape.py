"""What a user names (run ids, config values, method names, token text, response texts), escaped for the
output it is written to. One function per output kind; every writer of that kind calls it.

- :func:`visible`: the characters that draw nothing, or change how the characters around them are drawn
  or acted on, written as their code: C0 and C1 controls and DEL (Unicode category Cc), format characters
  (Cf: bidi overrides and isolates U+202A-U+202E, U+2066-U+2069, the marks U+200E / U+200F / U+061C,
  zero-width spaces and joiners, U+FEFF, ...), line and paragraph separators (Zl, Zp) and lone surrogates
  (Cs). The form is Python's: ``\\t``, ``\\n``, ``\\r``, else ``\\x1b`` (below U+0100), ``\\u202e``
  (up to U+FFFF), ``\\U000e0001``. A backslash itself is left as it is (ids and paths stay readable),
  so a name that holds the six characters ``\\u202e`` prints the same as one that holds U+202E.
- :func:`terminal`: :func:`visible`, keeping the characters named in ``keep`` (``show`` keeps the newline
  and the tab of token text: they are its layout). rich markup is never parsed from a user's value: the
  writers hand rich ``Text`` objects, never markup strings, so ``[red]x[/red]`` prints as typed.
- :func:`markdown` (text) and :func:`markdown_cell` (a table cell): :func:`visible` with line breaks as a
  space (a value never starts a block), then what Markdown would read as structure escaped so that the
  value reads as typed: ``<`` as ``&lt;`` unless a space follows (so no tag, comment or autolink
  survives; ``p < 0.5`` stays), ``>`` as ``&gt;`` unless a space or ``-`` comes before (``0 -> 1``
  stays), ``&`` as ``&amp;`` where it would start an entity (``PA&HP`` stays), a backslash before ASCII
  punctuation doubled, a backslash before each backtick and asterisk, before a ``]`` that a ``(`` or
  ``[`` follows (no link or image: ``[red]`` and ``[0.2, 0.3)`` stay), and before an underscore not
  between two letters or digits (``grpo_lr_1`` stays); in a cell ``|`` as
  ``\\|``. ``grpo-seed1`` stays as it is. The report's own text around the names (headings, links to
  the figures, the analyses' names in backticks) is not escaped.
- :func:`token`: :func:`visible`, and a token :func:`drawn_as_nothing` written whole as its codes (the
  token viewer's rule, for ``show``).
- :func:`plot_text`: :func:`visible`, and ``$`` escaped (matplotlib's mathtext): the figures' legends and
  panel titles.
- :func:`html_text`: :func:`visible`, then :func:`html.escape` (quotes included: also for attributes).
"""

from __future__ import annotations

import html
import re
import unicodedata

INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def code(ch: str) -> str:
    """One character as its escape, as Python writes it: ``\\t``, ``\\n``, ``\\r``, ``\\x85``, ``\\u202e``,
    ``\\U000e0001``."""
    if ch in _SHORT:
        return _SHORT[ch]
    o = ord(ch)
    if o < 0x100:
        return f"\\x{o:02x}"
    if o < 0x10000:
        return f"\\u{o:04x}"
    return f"\\U{o:08x}"


def is_invisible(ch: str) -> bool:
    """A control, format, separator or surrogate character (see the module's docstring)."""
    return unicodedata.category(ch) in INVISIBLE_CATEGORIES


# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt): drawn as nothing where a font has no
# glyph for them; the letters among them (U+115F, U+3164, ...) are not invisible by category
DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)


def drawn_as_nothing(s: str) -> bool:
    """Every character of ``s`` (not empty) is invisible or default-ignorable: a token a viewer would show
    as nothing at all."""
    return bool(s) and all(is_invisible(ch) or any(lo <= ord(ch) <= hi for lo, hi in DEFAULT_IGNORABLE) for ch in s)


def visible(s, keep: str = "") -> str:
    """``s`` (made a str) with every invisible character written as its code, but those in ``keep``."""
    s = str(s)
    if s.isprintable():  # the common case (str.isprintable is False for every invisible character)
        return s
    return "".join(code(ch) if is_invisible(ch) and ch not in keep else ch for ch in s)


def terminal(s, keep: str = "") -> str:
    """``s`` as a terminal prints it: :func:`visible` (``keep``: the layout characters to leave, e.g. "\\n\\t")."""
    return visible(s, keep)


def token(s: str, keep: str = "") -> str:
    """A token's text: :func:`visible`, and a token :func:`drawn_as_nothing` (a Hangul filler, a variation
    selector alone) written whole as its codes."""
    return "".join(code(ch) for ch in s) if drawn_as_nothing(s) else visible(s, keep)


_BREAKS = re.compile(r"\r\n|[\n\r]")  # Markdown's line endings
_ENTITY = re.compile(r"&(?=#[0-9]+;|#[xX][0-9a-fA-F]+;|[A-Za-z][A-Za-z0-9]*;)")
_LT = re.compile(r"<(?!\s)")
_GT = re.compile(r"(?<![\s-])>")
_BACKSLASH = re.compile(r"\\(?=[!-/:-@\[-`{-~])")
_MD_PUNCT = re.compile(r"[`*]|\](?=[(\[])")  # a link or an image needs "](" (or "][" and a definition)
_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


def markdown(s) -> str:
    """``s`` as Markdown text that reads as typed (see the module's docstring): no tag, link, code span or
    new block comes from it."""
    s = visible(_BREAKS.sub(" ", str(s)))
    s = _BACKSLASH.sub(r"\\\\", s)
    s = _ENTITY.sub("&amp;", s)
    s = _LT.sub("&lt;", s)
    s = _GT.sub("&gt;", s)
    s = _MD_PUNCT.sub(lambda m: "\\" + m.group(0), s)
    return _UNDERSCORE.sub(r"\\_", s)


def markdown_cell(s) -> str:
    """``s`` as the text of one Markdown table cell: :func:`markdown`, and ``|`` as ``\\|``."""
    return markdown(s).replace("|", "\\|")


def plot_text(s) -> str:
    """``s`` as a matplotlib label (a legend entry, a panel title): :func:`visible`, and ``$`` as ``\\$``
    (a pair of them would start mathtext: drawn as math, or a parse error that loses the figure)."""
    return visible(s).replace("$", "\\$")


def html_text(s) -> str:
    """``s`` as HTML text or an attribute's value: :func:`visible`, then every ``<``, ``>``, ``&``, ``"``
    and ``'`` escaped."""
    return html.escape(visible(s), quote=True)


__all__ = [
    "code",
    "is_invisible",
    "drawn_as_nothing",
    "visible",
    "terminal",
    "token",
    "markdown",
    "markdown_cell",
    "plot_text",
    "html_text",
]
