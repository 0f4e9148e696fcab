"""docs/api.md from the public API's own signatures and docstrings (Args / Returns / Raises).

    python -m entropylens.api_doc > docs/api.md

tests/test_api_doc.py checks that docs/api.md is :func:`api_markdown` and that every entry's ``Args:`` names
its parameters, so the page cannot drift from the code. The objects are imported and read with
:mod:`inspect`, except the TRL and verl entry points: importing those modules imports TRL or verl (optional,
and verl is not importable without its own environment), so their signatures and docstrings are read from
the source files with :mod:`ast`. Importing this module imports nothing of the package.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE = Path(__file__).resolve().parent  # entropylens/
SECTIONS = ("Args:", "Returns:", "Raises:")  # the docstring sections rendered as text blocks
ONE_LINE = 100  # a signature longer than this is written one parameter a line

HEADER = """# Python API

The signatures and docstrings of entropylens' public Python API, each with its arguments (`Args`), what
it returns (`Returns`) and the errors it raises on bad input (`Raises`). This page is generated from the
code by `python -m entropylens.api_doc > docs/api.md`, and `tests/test_api_doc.py` checks that it
matches: edit the docstrings, then regenerate it.
"""


@dataclass(frozen=True)
class Entry:
    """One object of the page: ``qualname`` in ``module``, imported as ``imported`` (shown above its
    signature; "": nothing shown); ``source``: read from the module's file with :mod:`ast` (the module
    imports TRL or verl)."""

    module: str
    qualname: str
    imported: str
    source: bool = False


ENTRIES: tuple[Entry, ...] = (
    Entry("entropylens.record.recorder", "Recorder", "from entropylens import Recorder"),
    *(
        Entry("entropylens.record.recorder", f"Recorder.{name}", "")
        for name in (
            "record_update",
            "record_step",
            "record_sequences",
            "watch_logits",
            "probe",
            "end_step",
            "commit",
            "step_summary",
            "should_stop",
            "stop_reason",
            "on_alarm",
            "close",
        )
    ),
    Entry("entropylens.rl.losses", "policy_loss", "from entropylens import policy_loss"),
    Entry(
        "entropylens.integrations.torch", "policy_update", "from entropylens.integrations.torch import policy_update"
    ),
    Entry("entropylens.read.query", "open", "import entropylens; entropylens.open(...)"),
    Entry("entropylens.read.query", "connect", "from entropylens import connect"),
    Entry("entropylens.read.query", "run_analysis", "from entropylens import run_analysis"),
    Entry("entropylens.report.build", "write_report", "from entropylens import write_report"),
    Entry(
        "entropylens.integrations.trl_trainer",
        "EntropyLensGRPOTrainer",
        "from entropylens.integrations.trl import EntropyLensGRPOTrainer",
        source=True,
    ),
    Entry(
        "entropylens.integrations.verl.config",
        "EntropyLensLossConfig",
        "actor_rollout_ref.actor.policy_loss._target_=entropylens.integrations.verl.EntropyLensLossConfig",
        source=True,
    ),
    Entry(
        "entropylens.integrations.verl.loss_fn",
        "EntropyLensLoss",
        "from entropylens.integrations.verl import EntropyLensLoss",
        source=True,
    ),
    Entry(
        "entropylens.integrations.verl.trainer",
        "EntropyLensTrainer",
        "trainer.use_v1=true trainer.v1.trainer_mode=entropylens",
        source=True,
    ),
)


@dataclass(frozen=True)
class Param:
    """A parameter as the page shows it: ``kind`` an :class:`inspect.Parameter` kind; ``annotation`` and
    ``default`` as source text (None: none)."""

    kind: int  # an inspect.Parameter kind (an IntEnum)
    name: str
    annotation: str | None = None
    default: str | None = None

    @property
    def documented_name(self) -> str:
        """The name an ``Args:`` entry gives it: ``*args`` / ``**kwargs`` with their stars."""
        stars: dict[int, str] = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        return stars.get(self.kind, "") + self.name

    def text(self) -> str:
        out = self.documented_name + (f": {self.annotation}" if self.annotation else "")
        if self.default is not None:
            out += f" = {self.default}" if self.annotation else f"={self.default}"
        return out


@dataclass(frozen=True)
class Documented:
    """What the page shows of one entry: ``kind`` "class", "dataclass", "function", "method" or
    "property"; ``params`` (without self); ``returns``: the return annotation's text (None: none written)."""

    entry: Entry
    kind: str
    params: tuple[Param, ...]
    returns: str | None
    doc: str

    @property
    def name(self) -> str:
        return self.entry.qualname

    @property
    def returns_something(self) -> bool:
        """A function or property whose annotation is not ``None`` (or that has none)."""
        return self.kind in ("function", "method", "property") and self.returns != "None"

    def signature(self) -> str:
        """The signature as Python, one line where it fits, else one parameter a line."""
        if self.kind == "property":
            return f"{self.name}: {self.returns}  # a read-only property"
        if self.kind == "dataclass":
            base = self.entry.qualname
            fields = "\n".join(f"    {p.text()}" for p in self.params)
            return f"@dataclass\nclass {base}(PolicyLossConfig):  # verl's PolicyLossConfig fields first\n{fields}"
        parts = _with_markers(self.params)
        ret = f" -> {self.returns}" if self.returns else ""
        line = f"{self.name}({', '.join(parts)}){ret}"
        if len(line) <= ONE_LINE:
            return line
        body = "".join(f"    {p},\n" for p in parts)
        return f"{self.name}(\n{body}){ret}"


def _with_markers(params: tuple[Param, ...]) -> list[str]:
    """The parameters' texts with ``/`` after the positional-only ones and ``*`` before the keyword-only
    ones (where no ``*args`` stands there)."""
    out: list[str] = []
    kinds = [p.kind for p in params]
    for i, p in enumerate(params):
        if p.kind == inspect.Parameter.KEYWORD_ONLY and inspect.Parameter.VAR_POSITIONAL not in kinds[:i]:
            if i == 0 or kinds[i - 1] != inspect.Parameter.KEYWORD_ONLY:
                out.append("*")
        out.append(p.text())
        if p.kind == inspect.Parameter.POSITIONAL_ONLY and (
            i + 1 == len(params) or kinds[i + 1] != inspect.Parameter.POSITIONAL_ONLY
        ):
            out.append("/")
    return out


# ------------------------------------------------------------------------------------------------ reading
def _annotation(a) -> str | None:
    if a is inspect.Parameter.empty:
        return None
    return a if isinstance(a, str) else inspect.formatannotation(a)


def _from_signature(sig: inspect.Signature, drop_self: bool) -> tuple[tuple[Param, ...], str | None]:
    params = list(sig.parameters.values())[1:] if drop_self else list(sig.parameters.values())
    out = tuple(
        Param(
            p.kind,
            p.name,
            _annotation(p.annotation),
            None if p.default is inspect.Parameter.empty else repr(p.default),
        )
        for p in params
    )
    return out, _annotation(sig.return_annotation)


def _imported(entry: Entry) -> Documented:
    obj: Any = importlib.import_module(entry.module)  # then the attribute the entry names
    owner = None
    for part in entry.qualname.split("."):
        owner, obj = obj, getattr(obj, part)  # a property, read from its class, is the property itself
    if isinstance(obj, property):
        assert obj.fget is not None  # a documented property has a getter
        _, ret = _from_signature(inspect.signature(obj.fget), drop_self=True)
        return Documented(entry, "property", (), ret, inspect.getdoc(obj) or "")
    if inspect.isclass(obj):
        params, _ = _from_signature(inspect.signature(obj), drop_self=False)
        return Documented(entry, "class", params, None, inspect.getdoc(obj) or "")
    method = inspect.isclass(owner)
    params, ret = _from_signature(inspect.signature(obj), drop_self=method)
    return Documented(entry, "method" if method else "function", params, ret, inspect.getdoc(obj) or "")


def _source_file(module: str) -> Path:
    """A module's file, found without importing its package (verl's ``__init__`` imports verl)."""
    parts = module.split(".")[1:]
    return PACKAGE.joinpath(*parts[:-1], parts[-1] + ".py")


def _unparse(node) -> str | None:
    return None if node is None else ast.unparse(node)


def _from_ast(args: ast.arguments, drop_self: bool) -> tuple[Param, ...]:
    P = inspect.Parameter
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [
        Param(
            P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
            a.arg,
            _unparse(a.annotation),
            _unparse(d),
        )
        for i, (a, d) in enumerate(zip(positional, defaults))
    ]
    if args.vararg is not None:
        out.append(Param(P.VAR_POSITIONAL, args.vararg.arg, _unparse(args.vararg.annotation)))
    out += [
        Param(P.KEYWORD_ONLY, a.arg, _unparse(a.annotation), _unparse(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults)
    ]
    if args.kwarg is not None:
        out.append(Param(P.VAR_KEYWORD, args.kwarg.arg, _unparse(args.kwarg.annotation)))
    return tuple(out[1:] if drop_self else out)


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any(
        (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) == "dataclass"
        for d in (dec.func if isinstance(dec, ast.Call) else dec for dec in node.decorator_list)
    )


def _read_source(entry: Entry) -> Documented:
    """A class read from its module's source: its docstring and its ``__init__``'s parameters (a dataclass:
    the fields its own body declares)."""
    tree = ast.parse(_source_file(entry.module).read_text(encoding="utf-8"))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == entry.qualname)
    doc = ast.get_docstring(node) or ""
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is not None:
        return Documented(entry, "class", _from_ast(init.args, drop_self=True), None, doc)
    if not _is_dataclass(node):
        raise ValueError(f"{entry.qualname}: no __init__ in {entry.module}")
    fields = tuple(
        Param(inspect.Parameter.KEYWORD_ONLY, n.target.id, _unparse(n.annotation), _unparse(n.value))
        for n in node.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    )
    return Documented(entry, "dataclass", fields, None, doc)


def documented(entry: Entry) -> Documented:
    """The signature and docstring of ``entry``."""
    return _read_source(entry) if entry.source else _imported(entry)


# ------------------------------------------------------------------------------------------------ writing
def split_docstring(doc: str) -> list[tuple[str, str]]:
    """The docstring as ("prose", text) and ("section", text) blocks, in order: a section is a line of
    :data:`SECTIONS` and the indented (or blank) lines under it."""
    blocks: list[tuple[str, list[str]]] = []
    for line in doc.splitlines():
        if line.strip() in SECTIONS and not line.startswith(" "):
            blocks.append(("section", [line]))
        elif blocks and blocks[-1][0] == "section" and (line.startswith(" ") or not line.strip()):
            blocks[-1][1].append(line)
        elif blocks and blocks[-1][0] == "prose":
            blocks[-1][1].append(line)
        else:
            blocks.append(("prose", [line]))
    return [(kind, "\n".join(lines).strip("\n")) for kind, lines in blocks if "".join(lines).strip()]


def _section_markdown(d: Documented) -> str:
    out = [f"## {d.name}", ""] + ([f"`{d.entry.imported}`", ""] if d.entry.imported else [])
    out += ["```python", d.signature(), "```", ""]
    blocks = split_docstring(d.doc)
    for i, (kind, text) in enumerate(blocks):
        if kind == "prose":
            out += [text, ""]
            continue
        first = i == 0 or blocks[i - 1][0] != "section"  # the sections one after another: one text block
        last = i + 1 == len(blocks) or blocks[i + 1][0] != "section"
        out += (["```text"] if first else [""]) + [text] + (["```", ""] if last else [])
    return "\n".join(out)


def api_markdown() -> str:
    """docs/api.md: the header, then one section per entry of :data:`ENTRIES`, in that order."""
    return HEADER + "".join("\n" + _section_markdown(documented(e)) for e in ENTRIES)


if __name__ == "__main__":
    print(api_markdown(), end="")
