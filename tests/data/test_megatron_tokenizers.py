"""Megatron-LM's tokenizers (--tokenizer-type) and its preprocessing names (PREFIX_text_document), issue 49
item 11. Every tokenizer is built here from small files the test writes (nothing downloaded)."""
import base64
import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

from megalite.cli import parse_args
from megalite.config.checks import data_problems
from megalite.data import IndexedDataset, load_tokenizer
from megalite.data.indexed_dataset import DataError

_spec = importlib.util.spec_from_file_location(
    "preprocess_data_megatron", pathlib.Path(__file__).resolve().parents[2] / "tools" / "preprocess_data.py")
preprocess_data = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(preprocess_data)

TEXTS = ["the cat sat on the mat", "a dog ate the cat food", "then the theme"]


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _preprocess(tmp_path, argv, records=None) -> tuple[int, str]:
    source = _jsonl(tmp_path / "docs.jsonl", records or [{"text": t} for t in TEXTS])
    prefix = str(tmp_path / "out")
    return preprocess_data.main(["--input", source, "--output-prefix", prefix, "--no-progress", *argv]), prefix


def _documents(prefix) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def _hf_directory(tmp_path) -> pathlib.Path:
    """A transformers tokenizer saved with save_pretrained, whose eos is <|im_end|> (not <|endoftext|>)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    raw = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    raw.train_from_iterator(TEXTS * 4, tokenizers.trainers.BpeTrainer(
        vocab_size=60, special_tokens=["[UNK]", "<|endoftext|>", "<|im_end|>"], show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", unk_token="[UNK]")
    fast.save_pretrained(str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_huggingface_directory_is_a_tokenizer(tmp_path):
    """A directory that exists was "does not exist": now its tokenizer.json, its configured eos the end of
    document, equal to transformers' own tokenizer of that directory."""
    import transformers

    directory = _hf_directory(tmp_path)
    ours, theirs = load_tokenizer(str(directory)), transformers.AutoTokenizer.from_pretrained(str(directory))
    assert ours.eod == theirs.eos_token_id == theirs.convert_tokens_to_ids("<|im_end|>")
    assert ours.vocab_size == len(theirs)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    cfg, _ = parse_args(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(directory)])
    assert cfg.data.tokenizer == str(directory)
    code, prefix = _preprocess(tmp_path, ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                          str(directory)])
    assert code == 0 and _documents(prefix) == [ours.encode(t) + [ours.eod] for t in TEXTS]
    assert data_problems(parse_args(["--data-path", prefix, "--tokenizer", str(directory)])[0].data) == []
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))


def test_sentencepiece_model(tmp_path, monkeypatch, capsys):
    sentencepiece = pytest.importorskip("sentencepiece")
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS * 20), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=40, model_type="bpe", minloglevel=2)
    model_file = str(tmp_path / "sp.model")
    reference = sentencepiece.SentencePieceProcessor(model_file=model_file)
    ours = load_tokenizer(model_file)
    assert (ours.vocab_size, ours.eod) == (reference.get_piece_size(), reference.eos_id())
    assert ours.encode(TEXTS[0]) == reference.encode(TEXTS[0]) and ours.decode(ours.encode(TEXTS[2])) == TEXTS[2]
    code, prefix = _preprocess(tmp_path, ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                                          model_file])
    assert code == 0 and _documents(prefix) == [reference.encode(t) + [reference.eos_id()] for t in TEXTS]
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    code, _ = _preprocess(tmp_path, ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model_file])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'megalite[sentencepiece]'" in err[0]


def _tiktoken_vocabulary(path, merges: list[bytes]) -> str:
    """Megatron's TikTokenizer file: a JSON list of {rank, token_bytes (base64), token_str}, bytes first."""
    tokens = [bytes([i]) for i in range(256)] + merges
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str":
                                 t.decode("utf-8", "replace")} for i, t in enumerate(tokens)]))
    return str(path)


def test_tiktokenizer_offsets_ranks_past_the_special_ids(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tiktoken")
    vocabulary = _tiktoken_vocabulary(tmp_path / "tt.json", [b"th", b"the", b" the"])
    argv = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", vocabulary, "--tiktoken-num-special-tokens", "10"]
    tokenizer = load_tokenizer(parse_args(argv)[0].data.tokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod) == (10 + 259, 2)  # <unk> <s> </s> <SPECIAL_3..9>, then ranks
    assert tokenizer.encode("the a the") == [10 + 257, 10 + 32, 10 + 97, 10 + 258]
    assert tokenizer.decode(tokenizer.encode("the a the") + [2]) == "the a the"
    capped = load_tokenizer(parse_args(argv + ["--vocab-size", "266"])[0].data.tokenizer)  # the first 256 ranks
    assert capped.vocab_size == 266 and capped.encode("the") == [10 + ord(c) for c in "the"]
    code, prefix = _preprocess(tmp_path, argv[:4])
    assert code == 0 and _documents(prefix)[2][:2] == [1000 + 257, 1000 + 110]  # "the" "n" with 1000 specials
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    code, _ = _preprocess(tmp_path, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'megalite[tiktoken]'" in err[0]


def test_null_tokenizer_reads_ids(tmp_path, capsys):
    cfg, _ = parse_args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"])
    assert cfg.data.tokenizer == "null:10" and cfg.model.vocab_size is None  # the model's is the tokenizer's: 11
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.encode("3 1 4")) == (11, 10, [3, 1, 4])
    code, prefix = _preprocess(tmp_path, ["--tokenizer-type", "NullTokenizer", "--vocab-size", "10"],
                               [{"text": "1 2 3"}, {"text": "9 0"}])
    assert code == 0 and _documents(prefix) == [[1, 2, 3, 10], [9, 0, 10]]
    capsys.readouterr()
    code, _ = _preprocess(tmp_path, ["--tokenizer-type", "NullTokenizer"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "needs --vocab-size" in err[0]
    with pytest.raises(DataError, match="outside 0..9"):
        tokenizer.encode("3 12")


def test_preprocessing_writes_megatrons_names_and_both_are_read(tmp_path):
    """PREFIX_{key}_document per key, as Megatron's tool; --data-path reads the Megatron name, the bare
    PREFIX when one such pair is beside it, and the old PREFIX.bin (tests/data/test_preprocess.py)."""
    records = [{"text": t, "title": t.split()[0]} for t in TEXTS]
    code, prefix = _preprocess(tmp_path, ["--json-keys", "text", "title"], records)
    assert code == 0
    for key in ("text", "title"):
        assert (tmp_path / f"out_{key}_document.bin").is_file() and (tmp_path / f"out_{key}_document.idx").is_file()
    assert not (tmp_path / "out.bin").exists()
    titles = _documents(prefix + "_title_document")
    assert titles == [list(r["title"].encode()) + [256] for r in records]
    with pytest.raises(DataError, match="several preprocessed keys"):
        IndexedDataset(prefix)
    assert "several preprocessed keys" in data_problems(parse_args(["--data-path", prefix])[0].data)[0]
    (tmp_path / "one").mkdir()
    code, single = _preprocess(tmp_path / "one", [])
    assert code == 0 and np.array_equal(IndexedDataset(single).tokens,
                                        IndexedDataset(single + "_text_document").tokens)
    assert data_problems(parse_args(["--data-path", single])[0].data) == []
