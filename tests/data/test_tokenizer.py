"""Tokenizers: byte-level round trip, HF tokenizer.json wrapper, clear errors."""
import sys

import pytest

from data_helpers import tiny_tokenizer_json
from megalite.data import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trip_and_ids():
    tokenizer = load_tokenizer(None)
    assert isinstance(tokenizer, ByteTokenizer) and isinstance(load_tokenizer("byte"), ByteTokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    text = "héllo wörld € 😀\n"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tokenizer.decode(ids + [tokenizer.eod]) == text  # eod is not text
    assert tokenizer.encode_array(text).tolist() == ids


def test_hf_tokenizer_json_wrapper(tmp_path):
    raw = tiny_tokenizer_json(tmp_path / "with_eos.json", with_eos=True)
    tokenizer = load_tokenizer(str(tmp_path / "with_eos.json"))
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.eod == raw.token_to_id("<|endoftext|>")
    assert tokenizer.vocab_size == raw.get_vocab_size()
    ids = tokenizer.encode("the cat sat")
    assert ids == raw.encode("the cat sat").ids and tokenizer.decode(ids) == raw.decode(ids)

    tiny_tokenizer_json(tmp_path / "no_eos.json", with_eos=False)
    no_eos = load_tokenizer(str(tmp_path / "no_eos.json"))
    assert no_eos.eod == no_eos.vocab_size - 1  # a fresh id was reserved for end-of-document
    assert no_eos.decode(no_eos.encode("the dog") + [no_eos.eod]) == no_eos.decode(no_eos.encode("the dog"))
    assert no_eos.name != tokenizer.name


def test_tokenizer_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    (tmp_path / "t.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # simulate the package being absent
    with pytest.raises(ImportError, match="pip install tokenizers"):
        load_tokenizer(str(tmp_path / "t.json"))


def test_a_tokenizer_directory_is_read_like_its_tokenizer_json(tmp_path):
    """Megatron's HuggingFaceTokenizer takes a saved tokenizer directory (issue 49, item 11); a directory
    that exists was 'does not exist'."""
    from megalite.data.tokenizer import HFTokenizer

    (tmp_path / "tok").mkdir()
    tiny_tokenizer_json(tmp_path / "tok" / "tokenizer.json", with_eos=True)
    from_dir, from_file = HFTokenizer(str(tmp_path / "tok")), HFTokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    assert from_dir.vocab_size == from_file.vocab_size and from_dir.eod == from_file.eod
    assert from_dir.encode("hello world") == from_file.encode("hello world")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
        HFTokenizer(str(tmp_path / "empty"))
