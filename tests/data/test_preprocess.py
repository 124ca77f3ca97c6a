"""tools/preprocess_data.py: text, directories and JSON lines -> .bin/.idx -> the same text back."""
import importlib.util
import os

import pytest

from data_helpers import random_texts, tiny_tokenizer_json, write_jsonl
from megalite.data import ByteTokenizer, IndexedDataset, load_tokenizer, preprocess_files
from megalite.data.indexed_dataset import DataError

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "preprocess_data.py")


def _load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _decoded_documents(prefix):
    ds, tokenizer = IndexedDataset(prefix), ByteTokenizer()
    docs = [ds[i].tolist() for i in range(len(ds))]
    assert all(doc[-1] == tokenizer.eod and tokenizer.eod not in doc[:-1] for doc in docs)
    return [tokenizer.decode(doc[:-1]) for doc in docs]


def test_cli_round_trip_recovers_text(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    texts = random_texts(30, seed=1)
    (corpus / "b.txt").write_text(texts[0], encoding="utf-8")
    (corpus / "a.txt").write_text(texts[1], encoding="utf-8")
    (corpus / "sub" / "c.txt").write_text(texts[2], encoding="utf-8")
    (corpus / "empty.txt").write_text("")
    (corpus / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8: skipped
    write_jsonl(str(tmp_path / "docs.jsonl"), texts[3:])

    tool = _load_tool()
    assert tool.main(["--input", str(corpus), str(tmp_path / "docs.jsonl"), "--output-prefix",
                      str(tmp_path / "out" / "c"), "--workers", "1"]) == 0
    err = capsys.readouterr().err
    assert "100.0%" in err and "30 documents" in err and "1 empty, 1 not UTF-8" in err
    # directory files in sorted path order (a, b, sub/c), then the JSON lines in file order
    assert _decoded_documents(str(tmp_path / "out" / "c")) == [texts[1], texts[0], texts[2]] + texts[3:]

    # several worker processes give byte-identical files
    tool.main(["--input", str(corpus), str(tmp_path / "docs.jsonl"), "--output-prefix",
               str(tmp_path / "out" / "w"), "--workers", "3", "--no-progress"])
    for suffix in (".bin", ".idx"):
        assert ((tmp_path / "out" / ("w_text_document" + suffix)).read_bytes()
                == (tmp_path / "out" / ("c_text_document" + suffix)).read_bytes())


def test_json_keys_and_errors(tmp_path):
    path = str(tmp_path / "d.jsonl")
    with open(path, "w") as f:
        f.write('{"text": "first", "title": "T1"}\n{"text": "second", "title": "T2"}\n')
    stats = preprocess_files([path], str(tmp_path / "k"), "byte", json_keys=("text", "title"))
    assert stats.outputs == {"text": str(tmp_path / "k_text"), "title": str(tmp_path / "k_title")}
    assert _decoded_documents(str(tmp_path / "k_text")) == ["first", "second"]
    assert _decoded_documents(str(tmp_path / "k_title")) == ["T1", "T2"]

    with pytest.raises(DataError, match="--json-keys"):
        preprocess_files([path], str(tmp_path / "x"), "byte", json_keys=("body",))
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        preprocess_files([str(tmp_path / "bad.jsonl")], str(tmp_path / "y"), "byte")
    with pytest.raises(FileNotFoundError, match="--input"):
        preprocess_files([str(tmp_path / "nowhere")], str(tmp_path / "z"), "byte")
    assert not os.path.exists(tmp_path / "x.bin") and not os.path.exists(tmp_path / "y.idx")


def test_the_tool_refuses_bad_input_in_one_line(tmp_path, capsys):
    tool = _load_tool()
    (tmp_path / "empty").mkdir()
    (tmp_path / "not_a_tokenizer.json").write_text("hello")
    cases = {"not_json.jsonl": ('{"text": "fine"}\nnot json\n', "not_json.jsonl:2: not valid JSON"),
             "no_key.jsonl": ('{"body": "x"}\n', "no_key.jsonl:1: no key 'text'"),
             "number.jsonl": ('{"text": 5}\n', "no_key.jsonl:1: 'text' is a int, not a string".replace(
                 "no_key", "number")),
             "list.jsonl": ('[1, 2]\n', "list.jsonl:1: a JSON list, not an object"),
             "latin1.jsonl": (b'{"text": "caf\xe9"}\n', "not UTF-8 text")}
    runs = [([str(tmp_path / "empty")], "no input files found"),
            ([str(tmp_path / "missing.txt")], "is neither a file nor a directory"),
            ([str(tmp_path / "empty"), "--tokenizer", str(tmp_path / "not_a_tokenizer.json")],
             "is not a HuggingFace tokenizer.json"),
            ([str(tmp_path / "empty"), "--workers", "many"], "argument --workers: invalid int value")]
    for name, (text, needle) in cases.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        runs.append(([str(tmp_path / name)], needle))
    for inputs, needle in runs:
        argv = ["--input", *inputs, "--output-prefix", str(tmp_path / "o")]
        try:
            code = tool.main(argv + ["--no-progress"])
        except SystemExit as exc:
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, (inputs, err)
    assert not os.path.exists(tmp_path / "o.bin")


def test_hf_tokenizer_preprocessing_with_workers(tmp_path):
    tiny_tokenizer_json(tmp_path / "tok.json", with_eos=True)
    tokenizer = load_tokenizer(str(tmp_path / "tok.json"))
    texts = ["the cat sat on the mat", "a dog", "the food the cat ate"] * 4
    write_jsonl(str(tmp_path / "d.jsonl"), texts)
    for workers in (1, 2):
        preprocess_files([str(tmp_path / "d.jsonl")], str(tmp_path / f"w{workers}"), tokenizer, workers=workers)
    ds = IndexedDataset(str(tmp_path / "w2"))
    assert ds.vocab_size == tokenizer.vocab_size and ds.eod == tokenizer.eod
    assert [ds[i].tolist() for i in range(len(ds))] == [tokenizer.encode(t) + [tokenizer.eod] for t in texts]
    assert (tmp_path / "w1.bin").read_bytes() == (tmp_path / "w2.bin").read_bytes()


def test_the_tool_refuses_what_it_used_to_accept(tmp_path, capsys):
    """Issue 40: --workers 0, an output prefix that is a directory, and input of which no document
    could be read ended in exit 0 (or a traceback); each is one line, exit 2, and nothing written."""
    tool = _load_tool()
    (tmp_path / "good.txt").write_text("hello world\n")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "outdir").mkdir()
    cases = [(["--input", str(tmp_path / "good.txt"), "--workers", "0"], "--workers 0: give 1 or more"),
             (["--input", str(tmp_path / "good.txt"), "--output-prefix", str(tmp_path / "outdir")],
              f"--output-prefix {tmp_path / 'outdir'} is a directory"),
             (["--input", str(tmp_path / "latin1.txt")], "no document could be read (0 empty, 1 not UTF-8); nothing "
                                                         "written")]
    for argv, needle in cases:
        if "--output-prefix" not in argv:
            argv = argv + ["--output-prefix", str(tmp_path / "o")]
        code = tool.main(argv + ["--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err, (argv, err)
    assert not list(tmp_path.glob("o*.bin")) and not list(tmp_path.glob("o*.idx"))
