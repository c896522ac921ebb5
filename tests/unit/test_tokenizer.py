"""The tokenizer wrapper and the character tokenizer: exact round trips, specials, HF loading."""

from __future__ import annotations

import json

import pytest

from services.models import Tokenizer, load_tokenizer, make_char_tokenizer

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +-=*\n\t.?!"
TEXT = "what is 12+30?\n  answer:\t42.\n\n"


def test_round_trip_is_exact_including_whitespace():
    tok = make_char_tokenizer(CHARS + ":")
    ids = tok.encode(TEXT)
    assert len(ids) == len(TEXT)  # one token per character, nothing added
    assert tok.decode(ids) == TEXT


def test_special_tokens():
    tok = make_char_tokenizer(CHARS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(CHARS)
    assert tok.encode("ab", add_special_tokens=True) == tok.encode("ab")  # no template to add
    ids = [tok.bos_token_id, *tok.encode("a b"), tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids) == "a b"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>a b<eos><pad>"
    assert tok.encode("a<eos>") == [tok.encode("a")[0], tok.eos_token_id]


def test_custom_specials_and_roles():
    tok = make_char_tokenizer("xy", specials=("[PAD]", "[BOS]", "[EOS]", "[SEP]"))
    assert tok.token_to_id("[SEP]") == 3 and tok.encode("yx") == [5, 4]
    assert make_char_tokenizer("xy", specials=("[PAD]",)).eos_token_id is None


def test_words_are_single_tokens_decoded_as_text_and_saved(tmp_path):
    tok = make_char_tokenizer("ab<>/", words=("<tool_call>", "</tool_call>"))
    ids = tok.encode("a<tool_call>b</tool_call><")
    assert len(ids) == 5 and ids[1] == tok.token_to_id("<tool_call>") == 3 + 5
    assert tok.decode([*ids, tok.eos_token_id]) == "a<tool_call>b</tool_call><"  # kept, unlike specials
    tok.save(tmp_path)
    assert load_tokenizer(tmp_path).encode("</tool_call>a") == [tok.token_to_id("</tool_call>"), tok.encode("a")[0]]
    with pytest.raises(ValueError, match="words"):
        make_char_tokenizer("ab", words=("a",))
    with pytest.raises(ValueError, match="words"):
        make_char_tokenizer("ab", words=("<eos>",))


def test_bad_inputs():
    tok = make_char_tokenizer("ab")
    with pytest.raises(ValueError, match="text"):
        tok.encode("abc")
    with pytest.raises(ValueError, match="chars"):
        make_char_tokenizer("aba")
    with pytest.raises(ValueError, match="chars"):
        make_char_tokenizer("")
    with pytest.raises(ValueError, match="eos_token"):
        Tokenizer(tok.inner, eos_token="</s>")


def test_save_and_load(tmp_path):
    tok = make_char_tokenizer(CHARS + ":")
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["pad_token"], config["bos_token"], config["eos_token"]) == ("<pad>", "<bos>", "<eos>")
    for source in (tmp_path, tmp_path / "tokenizer.json"):
        loaded = load_tokenizer(source)
        assert loaded.encode(TEXT) == tok.encode(TEXT)
        assert loaded.decode(loaded.encode(TEXT)) == TEXT
        assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)


def test_load_reads_added_token_dicts_and_missing_config(tmp_path):
    tok = make_char_tokenizer("ab")
    tok.save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<eos>", "special": True}, "bos_token": None})
    )
    loaded = load_tokenizer(tmp_path)
    assert (loaded.eos_token_id, loaded.bos_token_id, loaded.pad_token_id) == (2, None, None)
    (tmp_path / "tokenizer_config.json").unlink()
    assert load_tokenizer(tmp_path).eos_token_id is None
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "nowhere")


def test_loadable_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = make_char_tokenizer(CHARS + ":")
    tok.save(tmp_path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    ids = fast.encode(TEXT, add_special_tokens=False)
    assert ids == tok.encode(TEXT)
    assert fast.decode(ids) == TEXT
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (auto.pad_token_id, auto.bos_token_id, auto.eos_token_id) == (0, 1, 2)
    assert auto.decode(auto.encode(TEXT, add_special_tokens=False) + [2], skip_special_tokens=True) == TEXT
