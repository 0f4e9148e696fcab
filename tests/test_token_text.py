"""entropylens.token_text: recorded token ids -> their text, from what the run recorded (a tokenizer saved with
the run, an inline vocabulary, a loadable name) or one passed in; ids as ⟨id⟩ otherwise. Tokenizers are built
here from a few sentences (no downloads)."""

from __future__ import annotations

import json
import uuid
import warnings

import pytest
import torch

from entropylens import Recorder, storage
from entropylens.demo.toy import config_for, task, train
from entropylens.read.query import connect
from entropylens.read.run_decoder import decoder_for_run
from entropylens.token_text import (
    HOW_TO_GET_TEXT,
    Decoder,
    TokenTextWarning,
    make_decoder,
    save_tokenizer,
    tokenizer_info,
)

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

TEXTS = ["the cat sat on the mat, café au lait", "naïve café: the cat", "hello world 你好 and the mat"]
PROBE = "the cat sat on the mat, naïve café 你好"  # spaces, punctuation, non-ASCII characters (whole tokens)


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer (GPT-2 / Qwen style: 'Ġ' marks a space) trained on TEXTS, in memory (no
    name_or_path)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _record(root, run, ids: list[int], **kw) -> None:
    """A run of one update whose one sequence is ``ids`` (token rows with those token ids)."""
    t = len(ids)
    mask = torch.ones(1, t, dtype=torch.bool)
    lp = torch.full((1, t), -0.5)
    with Recorder(root, run, config={"method": "grpo"}, fsync=False, **kw) as rec:
        rec.record_update(
            0, 0, mask=mask, advantages=torch.ones(1), logprobs=lp, old_logprobs=lp, tokens=torch.tensor([ids])
        )
        rec.record_step(0, grad_norm=1.0, lr=1e-3)


def _token_ids(root, run) -> list[int]:
    df = connect(root).execute("SELECT token_id FROM tokens WHERE run = ? ORDER BY pos", [run]).df()
    return df["token_id"].tolist()


def test_byte_level_tokens_join_to_the_decoded_text(bpe):
    ids = bpe.encode(PROBE)
    dec = make_decoder(bpe)
    toks = dec.tokens(ids)
    assert dec.has_text and len(toks) == len(ids)
    assert "".join(toks) == dec.text(ids) == bpe.decode(ids) == PROBE
    assert not any("Ġ" in s for s in toks) and any(s.startswith(" ") for s in toks)  # 'Ġ' is a real space
    assert any(not s.isascii() for s in toks)
    assert dec.tokens([ids[1]] * 3) == [toks[1]] * 3  # cached per id, the same string every time


def test_a_piece_of_a_character_shows_its_bytes(bpe):
    dec = make_decoder(bpe)
    ids = bpe.encode("zü")  # 'ü' is not a merged token here: two byte tokens, neither a whole character
    toks = dec.tokens(ids)
    assert dec.text(ids) == "zü"
    assert "\ufffd" not in "".join(toks) and "\\xc3" in toks[1]
    assert dec.tokens([10**6]) == ["⟨1000000⟩"]  # an id the tokenizer does not have


def test_a_tokenizer_given_to_the_recorder_is_saved_with_the_run(tmp_path, bpe):
    ids = bpe.encode(PROBE)
    _record(tmp_path, "a", ids, tokenizer=bpe)
    cfg = json.loads((tmp_path / "a" / "run.json").read_text())["config"]
    assert cfg["tokenizer"]["saved"] == "tokenizer" and cfg["tokenizer"]["name_or_path"] is None
    assert (tmp_path / "a" / "tokenizer").is_dir()
    dec = decoder_for_run(tmp_path, "a")
    assert dec.has_text and dec.source == f"tokenizer saved with the run ({tmp_path / 'a' / 'tokenizer'})"
    got = _token_ids(tmp_path, "a")
    assert got == ids and "".join(dec.tokens(got)) == dec.text(got) == PROBE


def test_the_saved_copy_on_object_storage(bpe):
    root = f"memory://el-token-text-{uuid.uuid4().hex[:8]}/runs"
    ids = bpe.encode(PROBE)
    _record(root, "a", ids, tokenizer=bpe)
    dec = decoder_for_run(root, "a")
    assert dec.source.startswith("tokenizer saved with the run (memory://") and dec.text(ids) == PROBE


def test_the_toys_vocabulary_is_inline_in_run_json(tmp_path):
    cfg = config_for("grpo", steps=1, prompts=2, group=2, minibatches=1, epochs=1, sft_steps=2)
    train(cfg, tmp_path, run="toy")
    info = json.loads((tmp_path / "toy" / "run.json").read_text())["config"]["tokenizer"]
    assert info["vocab"] == list(task.TOKEN_NAMES) and len(info["vocab"]) == task.VOCAB
    assert not (tmp_path / "toy" / "tokenizer").exists()
    dec = decoder_for_run(tmp_path, "toy")
    assert dec.has_text and dec.source == "the run's vocabulary (run.json)"
    assert dec.tokens([task.BOS, 0, 19, task.SEP, 22, 31]) == ["<s>", "A", "T", "|", "f22", "f31"]
    # each recorded response's text is its token ids decoded
    con = connect(tmp_path)
    seqs = con.execute("SELECT seq, text FROM sequences WHERE step = 0 ORDER BY seq").fetchall()
    assert len(seqs) == cfg.prompts * cfg.group
    for seq, text in seqs:
        ids = (
            con.execute('SELECT token_id FROM tokens WHERE step = 0 AND "update" = 0 AND seq = ? ORDER BY pos', [seq])
            .df()["token_id"]
            .tolist()
        )
        assert len(ids) == task.RESPONSE_LEN and text == dec.text(ids) == task.decode(ids)


def test_a_tokenizer_path_given_or_named_in_run_json(tmp_path, bpe):
    path = tmp_path / "tok"
    bpe.save_pretrained(path)
    ids = bpe.encode(PROBE)
    _record(tmp_path / "runs", "plain", ids)
    dec = decoder_for_run(tmp_path / "runs", "plain", tokenizer=path)  # given: a path
    assert dec.has_text and dec.source == f"tokenizer {path} (given)" and dec.text(ids) == PROBE
    assert decoder_for_run(tmp_path / "runs", "plain", tokenizer=bpe).source.startswith("the given tokenizer")
    _record(tmp_path / "runs", "named", ids, tokenizer=str(path))  # a loadable name: run.json names it, no copy
    info = json.loads((tmp_path / "runs" / "named" / "run.json").read_text())["config"]["tokenizer"]
    assert info == {"class": None, "name_or_path": str(path), "saved": None}
    assert not (tmp_path / "runs" / "named" / "tokenizer").exists()
    dec = decoder_for_run(tmp_path / "runs", "named")
    assert dec.source == f"tokenizer {path} (run.json)" and "".join(dec.tokens(ids)) == PROBE


def test_the_fallback_shows_ids(tmp_path):
    _record(tmp_path, "bare", [17, 3, 17])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no tokenizer recorded is not worth a warning
        dec = decoder_for_run(tmp_path, "bare")
    assert type(dec) is Decoder and not dec.has_text and dec.source == ""
    assert dec.tokens(_token_ids(tmp_path, "bare")) == ["⟨17⟩", "⟨3⟩", "⟨17⟩"]
    assert "tokenizer=" in HOW_TO_GET_TEXT and "--tokenizer" in HOW_TO_GET_TEXT


def test_a_tokenizer_that_cannot_be_loaded_warns_and_falls_back(tmp_path, bpe):
    _record(tmp_path / "runs", "a", [1, 2])
    missing = tmp_path / "no-such-tokenizer"
    with pytest.warns(TokenTextWarning, match="no-such-tokenizer") as caught:
        dec = decoder_for_run(tmp_path / "runs", "a", tokenizer=missing)
    assert not dec.has_text and dec.tokens([1]) == ["⟨1⟩"]
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    # run.json naming a tokenizer that is not here (a hub name never downloaded): a warning, the fallback
    _record(tmp_path / "runs", "gone", [1, 2], tokenizer="entropylens-test/never-downloaded")
    with pytest.warns(TokenTextWarning, match="never-downloaded"):
        assert not decoder_for_run(tmp_path / "runs", "gone").has_text
    # a damaged copy saved with the run: a warning naming it, then the fallback
    _record(tmp_path / "runs", "torn", [1, 2], tokenizer=bpe)
    (tmp_path / "runs" / "torn" / "tokenizer" / "tokenizer.json").write_text("{not json")
    with pytest.warns(TokenTextWarning, match="saved with the run"):
        assert not decoder_for_run(tmp_path / "runs", "torn").has_text


def test_tokenizer_info_and_save_rules(tmp_path, bpe):
    assert tokenizer_info(None) is None
    assert tokenizer_info(bpe)["saved"] == "tokenizer"  # built in memory: no name to load, so a copy
    assert tokenizer_info(bpe, save=False)["saved"] is None
    with pytest.raises(ValueError, match="list of strings"):
        tokenizer_info(["a", 2])
    with pytest.raises(ValueError, match="list of strings"):  # refused before anything is on disk
        Recorder(tmp_path, "bad", tokenizer=["a", 2])
    assert not (tmp_path / "bad").exists()
    d = storage.location(tmp_path / "d")
    assert not save_tokenizer(bpe, d, save=False) and not save_tokenizer(list(task.TOKEN_NAMES), d)
    assert save_tokenizer(bpe, d) and (tmp_path / "d" / "tokenizer" / "tokenizer.json").is_file()
