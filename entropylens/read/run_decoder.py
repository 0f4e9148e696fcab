"""The decoder a recorded run names: token ids -> text for a run under a runs root, from what its
run.json recorded (entropylens/token_text.py's module docstring: a saved copy, an inline vocabulary,
a tokenizer name), or the tokenizer a caller gives."""

from __future__ import annotations

import os
import tempfile
import warnings

from ..token_text import (
    SAVED_DIR,
    Decoder,
    TokenizerDecoder,
    TokenTextWarning,
    VocabDecoder,
    is_path,
    is_vocab,
    load_tokenizer,
    make_decoder,
    name_of,
    one_line,
    tokenizer_of,
)


def _run_dir(path, run: str, storage_options: dict | None):
    """The run's directory (a storage.Location) under the runs root ``path``: the run whose id (catalog.run_ids)
    is ``run``, else the one whose directory is named so. Raises catalog.QueryError (bad path, unknown run)."""
    from ..storage import location
    from .catalog import QueryError, find_runs, run_ids

    root = location(path, storage_options)
    every = find_runs(root)
    ids = run_ids(every, root)
    match = [d for d, rid in zip(every, ids) if rid == run] or [d for d in every if d.name == run]
    if not match:
        raise QueryError(f"unknown run {run}; runs here: {', '.join(ids)}")
    return match[0]


def _load_saved(d) -> object:
    """The tokenizer saved in ``d`` (a Location: local, or copied from object storage to a temporary folder)."""
    if not d.remote:
        return load_tokenizer(d.path)
    with tempfile.TemporaryDirectory(prefix="entropylens-tok-") as tmp:
        for p in d.files():
            with open(os.path.join(tmp, p.rsplit("/", 1)[-1]), "wb") as f:
                f.write(d.at(p).read_bytes())
        return load_tokenizer(tmp)  # the tokenizer is in memory once loaded


def _from_run_json(d, info: dict) -> Decoder:
    """The decoder run.json's tokenizer block names: saved copy, inline vocabulary, then name_or_path."""
    cfg = info.get("config") if isinstance(info, dict) else None  # run.json of any shape (catalog.checked_info)
    tok = (
        ((cfg if isinstance(cfg, dict) else {}).get("tokenizer") or info.get("tokenizer"))
        if isinstance(info, dict)
        else None
    )
    tok = tok if isinstance(tok, dict) else {}
    saved = d / SAVED_DIR  # always there (TRL, Recorder): run.json says whether one was kept
    try:
        has_copy = (saved / "tokenizer_config.json").isfile() or (saved / "tokenizer.json").isfile()
    except Exception:  # noqa: BLE001 - an unreachable store: no copy
        has_copy = False
    if has_copy:
        try:
            return TokenizerDecoder(_load_saved(saved), f"tokenizer saved with the run ({saved})")
        except Exception as e:  # noqa: BLE001
            warnings.warn(
                f"entropylens: the tokenizer saved with the run ({saved}) could not be loaded ({one_line(e)})",
                TokenTextWarning,
                stacklevel=3,
            )
    vocab = tok.get("vocab")
    if isinstance(vocab, list):
        return VocabDecoder(vocab, "the run's vocabulary (run.json)")
    name = tok.get("name_or_path")
    if isinstance(name, str) and name:
        try:
            return TokenizerDecoder(load_tokenizer(name), f"tokenizer {name} (run.json)")
        except Exception as e:  # noqa: BLE001
            warnings.warn(
                f"entropylens: tokenizer {name} (run.json) could not be loaded ({one_line(e)}); token "
                "ids are shown as ⟨id⟩",
                TokenTextWarning,
                stacklevel=3,
            )
    return Decoder()


def decoder_for_run(path, run: str, tokenizer=None, *, storage_options: dict | None = None) -> Decoder:
    """The decoder for run ``run`` under the runs root ``path`` (a local folder or an fsspec URL, as
    ``query.connect`` takes it): ``tokenizer`` when given (an object, a local path / cached name, or a list of
    strings), else what the run's run.json recorded (module docstring), else the fallback (ids as ⟨id⟩).
    A tokenizer that cannot be loaded gives a warning (naming it and why), never an error: a given one
    the fallback, run.json's saved copy its next source; an unknown run or path raises
    ``catalog.QueryError``."""
    import json

    if tokenizer is not None:
        return make_decoder(tokenizer, _given_source(tokenizer))
    d = _run_dir(path, run, storage_options)
    try:
        info = json.loads((d / "run.json").read_text())
    except Exception as e:  # noqa: BLE001 - a torn run.json: its tokenizer is not known
        warnings.warn(
            f"entropylens: {d / 'run.json'} could not be read ({one_line(e)}); token ids are shown as ⟨id⟩",
            TokenTextWarning,
            stacklevel=2,
        )
        return Decoder()
    return _from_run_json(d, info)


def _given_source(tokenizer) -> str:
    if is_vocab(tokenizer):
        return "the given vocabulary"
    if is_path(tokenizer):
        return f"tokenizer {os.fspath(tokenizer)} (given)"
    name = name_of(tokenizer_of(tokenizer)) if not isinstance(tokenizer, Decoder) else None
    return f"tokenizer {name} (given)" if name else f"the given tokenizer ({type(tokenizer_of(tokenizer)).__name__})"
