"""tools/generate.py end to end: an HF directory and an imported megalite checkpoint, at tp 1 in process
and at tp 2 under a 2-rank gloo world; the printed text is the prompt and transformers' greedy tokens
(byte tokenizer; ids past its 257 shown as <id>). Mistakes are one line, exit 2."""
import contextlib
import importlib.util
import io
import os
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "generation"))
sys.path.insert(0, str(ROOT / "tests" / "data"))
from test_generate import hf_model, transformers_tokens  # noqa: E402
from test_sft import TEMPLATE, _chat_tokenizer  # noqa: E402

from megalite.data.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402


def _tool():
    spec = importlib.util.spec_from_file_location("generate_tool", ROOT / "tools" / "generate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _tool().main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """(hf directory, imported checkpoint, the expected text of each prompt)."""
    root = tmp_path_factory.mktemp("generate")
    hf = hf_model("llama3")
    hf.save_pretrained(root / "hf")
    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / "tools" / "convert_checkpoint.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    convert.import_from_hf(root / "hf", root / "ckpt", progress=False)
    byte, prompts = ByteTokenizer(), ["Hello", "ab"]
    tool = _tool()
    tokens = [transformers_tokens(hf, [byte.encode(p)], new=10)[0] for p in prompts]
    return root / "hf", root / "ckpt", [p + tool.text_of(byte, t) for p, t in zip(prompts, tokens)]


def test_one_prompt_streams_and_a_batch_prints_each(sources):
    hf_dir, ckpt, expected = sources
    common = ["--max-new-tokens", 10, "--ignore-eos", "--tokenizer", "byte"]
    code, out, err = _run(["--hf", hf_dir, "--prompt", "Hello", *common])
    assert code == 0 and out == expected[0] + "\n", err
    code, out, err = _run(["--load", ckpt, "--prompt", "Hello", "--prompt", "ab", *common])
    assert code == 0 and out == f"[0] {expected[0]}\n[1] {expected[1]}\n", err


def _tp2(argv):
    return _run(argv)


@pytest.mark.slow  # tp 2 generation itself is in the quick tier (tests/generation/test_generate.py)
def test_tp2_prints_the_same_text(sources):
    hf_dir, ckpt, expected = sources
    results = run_distributed(_tp2, 2, ["--load", str(ckpt), "--prompt", "Hello", "--prompt", "ab",
                                        "--max-new-tokens", "10", "--ignore-eos"])
    assert results[0][1] == f"[0] {expected[0]}\n[1] {expected[1]}\n" and results[1][1] == ""
    assert all(code == 0 for code, _, _ in results)


@pytest.mark.parametrize("argv,needle", [
    (["--pp", "2"], "--pp 2: generation runs the whole model on each tp group"),
    (["--max-new-tokens", "400"], "past the model's seq_length 256"),
    (["--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
])
def test_mistakes_are_one_line(sources, argv, needle):
    code, out, err = _run(["--load", sources[1], "--prompt", "Hello", *argv])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1 and out == "", err


def test_no_prompt_and_no_checkpoint_are_one_line(tmp_path):
    code, _, err = _run(["--load", tmp_path, "--prompt", "x"])
    assert code == 2 and "holds no megalite checkpoint" in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _run(["--load", tmp_path])
    assert code == 2 and "no prompt" in err, err


def test_chat_prompts_go_through_the_template(tmp_path):
    """--chat: the prompt as a user turn, rendered by the directory's chat template (its special tokens
    read as such), then transformers' greedy tokens; a tokenizer without a template is one line."""
    hf = hf_model("llama3")
    hf.save_pretrained(tmp_path)
    fast = _chat_tokenizer(tmp_path, TEMPLATE)
    rendered = fast.apply_chat_template([{"role": "user", "content": "hi there"}], tokenize=False,
                                        add_generation_prompt=True)
    tokenizer = HFTokenizer(str(tmp_path / "tokenizer.json"))
    ids = tokenizer.encode(rendered)
    assert ids == fast(rendered, add_special_tokens=False)["input_ids"]
    assert fast.convert_tokens_to_ids("<|im_start|>") in ids  # the template's special tokens read as such
    expected = transformers_tokens(hf, [ids], new=6)[0]
    code, out, err = _run(["--hf", tmp_path, "--chat", "--prompt", "hi there", "--max-new-tokens", 6, "--ignore-eos"])
    assert code == 0 and out == "hi there" + _tool().text_of(tokenizer, expected) + "\n", err
    code, out, err = _run(["--hf", tmp_path, "--chat", "--prompt", "hi", "--tokenizer", "byte"])
    assert code == 2 and "--chat needs a tokenizer with a chat template" in err, err
