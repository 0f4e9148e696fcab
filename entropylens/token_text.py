"""The text of recorded tokens: token ids (tokens.token_id) -> the strings a token viewer shows.

    from entropylens.read.run_decoder import decoder_for_run
    dec = decoder_for_run("runs", "grpo-s0")        # what the run recorded, else ids as ⟨17⟩
    dec.tokens([15, 2, 9])  -> ['The', ' cat', ' sat']   # each id's own text (cached per id)
    dec.text([15, 2, 9])    -> 'The cat sat'
    dec.has_text, dec.source                         # False for the fallback; where the text comes from

Where the text comes from (``read/run_decoder.decoder_for_run``, first found wins):
  1. a tokenizer passed by the caller (an object with ``decode``, a local path or a cached hub name, or a
     list of token strings);
  2. run.json's ``config.tokenizer`` (written by :func:`tokenizer_info`: the Recorder's ``tokenizer=``, TRL,
     verl): the copy saved with the run (``<run>/tokenizer/``, :func:`save_tokenizer`), an inline
     vocabulary (``vocab``: id -> string), or ``name_or_path`` loaded from local files;
  3. the fallback: each id as ``⟨17⟩`` (``has_text`` False; :data:`HOW_TO_GET_TEXT` says how to get text).
Tokenizers are loaded with ``AutoTokenizer.from_pretrained(..., local_files_only=True)``: never the
network. One that cannot be loaded gives one warning (:class:`TokenTextWarning`, naming it and why), never
an error: a given one then means the fallback, run.json's saved copy its next source.
"""

from __future__ import annotations

import os
import tempfile
import warnings

HOW_TO_GET_TEXT = (
    "Token texts need a tokenizer: pass one to the Recorder (Recorder(..., tokenizer=tok_or_path)) or "
    "to entropylens report/show --tokenizer PATH; TRL and verl record theirs themselves."
)
SAVED_DIR = "tokenizer"  # the run's own copy of its tokenizer: <run>/tokenizer/ (save_pretrained's files)
_REPLACEMENT = "\ufffd"  # what decode gives for bytes that are not a whole UTF-8 character


class TokenTextWarning(UserWarning):
    """A tokenizer could not be loaded or saved (the ids are then shown as ⟨id⟩, or the next source used)."""


def one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


# ----------------------------------------------------------------------------------- decoders
class Decoder:
    """Token ids -> text. This base class is the fallback: no text, each id shown as ``⟨17⟩``."""

    has_text = False
    source = ""  # one short phrase: where the text comes from ("" for the fallback)
    separator = " "  # what a viewer shows between two tokens: word-level tokens carry no spaces of their own

    def __init__(self) -> None:
        self._cache: dict[int, str] = {}

    def tokens(self, ids) -> list[str]:
        """Each id's own display string (one per id, in order; cached per id)."""
        out = []
        for i in ids:
            i = int(i)
            s = self._cache.get(i)
            if s is None:
                s = self._cache[i] = self._token(i)
            out.append(s)
        return out

    def text(self, ids) -> str:
        """The whole decoded text of ``ids``: the tokens joined by :attr:`separator`."""
        return self.separator.join(self.tokens(ids))

    def _token(self, i: int) -> str:
        return f"⟨{i}⟩"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.source or 'ids only'})"


class VocabDecoder(Decoder):
    """A plain vocabulary (``vocab[id]`` is the token's string): word-level, so a text is its tokens joined
    with spaces. Ids outside the list are shown as ``⟨id⟩``."""

    has_text = True

    def __init__(self, vocab, source: str = "the given vocabulary") -> None:
        super().__init__()
        self.vocab = [str(v) for v in vocab]
        self.source = source

    def _token(self, i: int) -> str:
        return self.vocab[i] if 0 <= i < len(self.vocab) else super()._token(i)


class TokenizerDecoder(Decoder):
    """A Hugging Face tokenizer (or any object with ``decode``; a processor's ``.tokenizer`` is used).
    A token's string is ``decode([id])`` (byte-level BPE's 'Ġ' comes out as a space); a piece that is only
    part of a UTF-8 character (decode gives U+FFFD) shows its bytes (``\\xe4\\xb8``) or its raw piece; a
    SentencePiece '▁' keeps its leading space."""

    has_text = True
    separator = ""  # a tokenizer's tokens carry their own spaces

    def __init__(self, tokenizer, source: str | None = None) -> None:
        super().__init__()
        self.tokenizer = tokenizer_of(tokenizer)
        self.source = source or f"tokenizer {name_of(self.tokenizer) or type(self.tokenizer).__name__}"

    def text(self, ids) -> str:
        return self._decode([int(i) for i in ids])

    def _decode(self, ids: list[int]) -> str:
        try:  # no clean-up of spaces before punctuation: the tokens' own strings join to the text
            return self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        except TypeError:  # a decode without that option (tokenizers.Tokenizer)
            return self.tokenizer.decode(ids)

    def _piece(self, i: int) -> str | None:
        tok = self.tokenizer
        fn = getattr(tok, "convert_ids_to_tokens", None) or getattr(tok, "id_to_token", None)
        try:
            piece = fn(i) if fn is not None else None
        except Exception:  # noqa: BLE001 - an id the vocabulary does not have
            return None
        return piece if isinstance(piece, str) else None

    def _token(self, i: int) -> str:
        try:
            s = self._decode([i])
        except Exception:  # noqa: BLE001 - an id outside the vocabulary (padding -1, ...)
            return super()._token(i)
        piece = self._piece(i)
        if piece is None and not s:  # an id the vocabulary does not have
            return super()._token(i)
        if _REPLACEMENT in s and piece is not None and _REPLACEMENT not in piece:  # part of a character
            raw = _byte_level_bytes(piece)
            return raw.decode("utf-8", errors="backslashreplace") if raw is not None else piece
        if piece is not None and piece.startswith("▁") and s and not s.startswith(" "):
            s = " " + s  # SentencePiece drops a word's space when the token is decoded alone
        return s


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters -> bytes: the printable bytes stand for themselves, the other 68
    (controls, space, ...) are the characters 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    out.update({chr(256 + k): b for k, b in enumerate(others)})
    return out


_BYTE_LEVEL: dict[str, int] | None = None


def _byte_level_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level BPE piece stands for ('Ġä¸' -> b' \\xe4\\xb8'), or None if it is not one."""
    global _BYTE_LEVEL
    if _BYTE_LEVEL is None:
        _BYTE_LEVEL = _byte_level_alphabet()
    if not piece or any(c not in _BYTE_LEVEL for c in piece):
        return None
    return bytes(_BYTE_LEVEL[c] for c in piece)


# ----------------------------------------------------------------------------------- tokenizers
def tokenizer_of(obj):
    """The tokenizer itself: a processor holds its tokenizer as ``.tokenizer``."""
    return getattr(obj, "tokenizer", obj)


def name_of(tok) -> str | None:
    return getattr(tok, "name_or_path", None) or None


def is_vocab(x) -> bool:
    return isinstance(x, (list, tuple))


def is_path(x) -> bool:
    return isinstance(x, (str, os.PathLike))


def load_tokenizer(name_or_path):
    """``AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)``: a local directory, or a hub
    name already in the local cache; never the network. Raises what transformers raises."""
    name = os.path.expanduser(os.fspath(name_or_path))
    looks_local = os.path.isabs(name) or name.startswith(".") or name.count("/") > 1 or os.sep != "/" and os.sep in name
    if looks_local and not os.path.isdir(name):  # not a hub name: say so (transformers calls it a bad repo id)
        raise FileNotFoundError(f"no such directory: {name}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, local_files_only=True)


def make_decoder(tokenizer, source: str | None = None) -> Decoder:
    """A :class:`Decoder` for ``tokenizer``: None (the fallback), a Decoder (itself), a list / tuple of token
    strings, a local path or cached hub name (loaded; one that cannot be loaded: a warning and the
    fallback), or a tokenizer object (``decode``)."""
    if tokenizer is None:
        return Decoder()
    if isinstance(tokenizer, Decoder):
        return tokenizer
    if is_vocab(tokenizer):
        return VocabDecoder(tokenizer, source or "the given vocabulary")
    if is_path(tokenizer):
        name = os.fspath(tokenizer)
        try:
            tok = load_tokenizer(name)
        except Exception as e:  # noqa: BLE001 - whatever transformers raises: say so, show ids
            warnings.warn(
                f"entropylens: tokenizer {name} could not be loaded ({one_line(e)}); token ids are shown as ⟨id⟩",
                TokenTextWarning,
                stacklevel=2,
            )
            return Decoder()
        return TokenizerDecoder(tok, source or f"tokenizer {name}")
    if callable(getattr(tokenizer_of(tokenizer), "decode", None)):
        return TokenizerDecoder(tokenizer, source)
    raise TypeError(
        f"tokenizer: expected a tokenizer (with decode), a path or a list of token strings, got "
        f"{type(tokenizer).__name__}"
    )


def tokenizer_info(tokenizer, save=None) -> dict | None:
    """run.json's ``config.tokenizer`` for ``tokenizer`` (None: none given):
    ``{"class", "name_or_path", "saved"}``: the class and what ``AutoTokenizer.from_pretrained`` loads
    (an object's ``name_or_path``, or the path given; an existing local path made absolute); ``saved``
    names the run's own copy (``"tokenizer"``) where :func:`save_tokenizer` with the same ``save`` keeps
    one. A list / tuple of strings is a vocabulary stored inline: ``{"class": "vocabulary", "vocab": [...]}``
    (id -> string)."""
    if tokenizer is None:
        return None
    if is_vocab(tokenizer):
        if not all(isinstance(v, str) for v in tokenizer):
            raise ValueError("tokenizer: a vocabulary must be a list of strings (token id -> its text)")
        return {"class": "vocabulary", "name_or_path": None, "saved": None, "vocab": list(tokenizer)}
    if is_path(tokenizer):
        name = os.fspath(tokenizer)
        name = os.path.abspath(name) if os.path.exists(name) else name
        return {"class": None, "name_or_path": name, "saved": SAVED_DIR if save is True else None}
    tok = tokenizer_of(tokenizer)
    name = name_of(tok)
    keeps = save is True or (save is None and not name)
    return {"class": type(tok).__name__, "name_or_path": name, "saved": SAVED_DIR if keeps else None}


def save_tokenizer(tokenizer, run_dir, save=None) -> bool:
    """Keeps a copy of the tokenizer in the run directory (``<run>/tokenizer/``, ``save_pretrained``'s files;
    ``run_dir``: a path, URL or storage.Location) where run.json could not name one to load (an object
    built in memory: no name_or_path), or when ``save=True`` (a path is then loaded and saved);
    ``save=False`` never; a vocabulary list is inline in run.json (nothing saved). A tokenizer that cannot
    be saved: a warning, training goes on. Returns whether a copy was saved. A token viewer decodes the
    recorded ids with it (``read/run_decoder.decoder_for_run``)."""
    from pathlib import Path

    from .storage import location

    if tokenizer is None or save is False or is_vocab(tokenizer):
        return False
    if is_path(tokenizer):
        if save is not True:
            return False
        try:
            tok = load_tokenizer(tokenizer)
        except Exception as e:  # noqa: BLE001
            warnings.warn(
                f"entropylens: tokenizer {os.fspath(tokenizer)} could not be loaded to save it with the "
                f"run ({one_line(e)})",
                TokenTextWarning,
                stacklevel=2,
            )
            return False
    else:
        tok = tokenizer_of(tokenizer)
        if save is None and name_of(tok):
            return False
    with tempfile.TemporaryDirectory(prefix="entropylens-tok-") as tmp:
        try:
            tok.save_pretrained(tmp)
        except Exception as e:  # noqa: BLE001 - a tokenizer that cannot save: say so, train on
            warnings.warn(
                f"entropylens: the tokenizer could not be saved with the run ({one_line(e)})",
                TokenTextWarning,
                stacklevel=2,
            )
            return False
        target = location(run_dir) / SAVED_DIR
        target.mkdirs()
        for f in sorted(Path(tmp).iterdir()):
            if f.is_file():
                (target / f.name).write_bytes(f.read_bytes())
    return True


__all__ = [
    "Decoder",
    "VocabDecoder",
    "TokenizerDecoder",
    "TokenTextWarning",
    "HOW_TO_GET_TEXT",
    "make_decoder",
    "load_tokenizer",
    "tokenizer_info",
    "save_tokenizer",
    "tokenizer_of",
]
