"""SFT data: records -> tokens and a loss mask (sft_preprocess.py) -> packed sequences (sft_dataset.py).

Judged by their own outputs: the exact ids, labels and position ids a record yields; the loss of a
batch equals the masked mean computed by hand from the records alone (the model on each record by
itself, the completion tokens' log-probabilities); packing never cuts a sample and loses none. A
packed batch equals the unpacked one once the model honours position_ids (skipped, saying so, before).
"""
import contextlib
import importlib.util
import inspect
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megalite.data import load_microbatches
from megalite.data.indexed_dataset import DataError, IndexedDataset
from megalite.data.sft_dataset import IGNORE, SFTDataset, build_sft_datasets, open_sft_pair, pack
from megalite.data.sft_preprocess import preprocess_sft
from megalite.data.tokenizer import ByteTokenizer
from megalite.model import GPTModel, preset

ROOT = Path(__file__).resolve().parents[2]
RECORDS = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "Say hi: ", "completion": "hello there"},
           {"prompt": "", "completion": "abc"}, {"prompt": "Q: capital of France? A: ", "completion": "Paris"}]
BYTE = ByteTokenizer()


def _write(tmp_path, records, name="sft.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def sft(tmp_path):
    preprocess_sft([str(_write(tmp_path, RECORDS))], str(tmp_path / "sft"), "byte")
    return str(tmp_path / "sft")


def test_preprocess_writes_the_tokens_and_the_mask(sft):
    tokens, mask = open_sft_pair(sft)
    assert len(tokens) == len(RECORDS) and mask.tokens.dtype == np.uint8
    for d, record in enumerate(RECORDS):
        prompt, completion = BYTE.encode(record["prompt"]), BYTE.encode(record["completion"])
        assert tokens[d].tolist() == prompt + completion + [BYTE.eod]
        assert mask[d].tolist() == [0] * len(prompt) + [1] * (len(completion) + 1)  # the eod: learn to stop


def test_a_sequence_holds_whole_samples_with_restarting_positions(sft):
    tokens, mask = open_sft_pair(sft)
    ds = SFTDataset(tokens, mask, 0, len(tokens), 40, seed=0)
    seen = []
    for i in range(len(ds)):
        item, cursor = ds[i], 0
        for doc in ds.samples(i):
            record = RECORDS[doc]
            prompt, completion = BYTE.encode(record["prompt"]), BYTE.encode(record["completion"])
            ids = prompt + completion + [BYTE.eod]
            n = len(ids) - 1
            assert item["input_ids"][cursor:cursor + n].tolist() == ids[:-1]
            assert item["labels"][cursor:cursor + n].tolist() == [IGNORE] * max(0, len(prompt) - 1) + ids[
                max(1, len(prompt)):]
            assert item["position_ids"][cursor:cursor + n].tolist() == list(range(n))
            cursor, seen = cursor + n, seen + [doc]
        assert (item["labels"][cursor:] == IGNORE).all() and (item["input_ids"][cursor:] == BYTE.eod).all()
        assert item["position_ids"][cursor:].tolist() == list(range(40 - cursor))
    assert sorted(seen) == list(range(len(RECORDS))) and len(ds) < len(RECORDS)  # packed, every sample once


@pytest.mark.parametrize("seed", range(5))
def test_packing_never_cuts_a_sample(seed):
    positions = np.random.default_rng(seed).integers(1, 33, size=200)
    bounds = pack(positions, 32, packing=True)
    assert bounds[0] == 0 and bounds[-1] == positions.size and (np.diff(bounds) > 0).all()
    for start, end in zip(bounds[:-1], bounds[1:]):
        assert positions[start:end].sum() <= 32  # the samples of one sequence fit whole
        if end < positions.size:
            assert positions[start:end + 1].sum() > 32  # next-fit: the next one did not
    assert pack(positions, 32, packing=False).tolist() == list(range(201))


def test_an_overlong_sample_is_refused_or_truncated(sft):
    tokens, mask = open_sft_pair(sft)
    with pytest.raises(DataError, match=r"sample 3 \(31 tokens\) and 0 more are longer than --seq-length 20 \+ 1; "
                                        r"raise --seq-length, or pass --sft-overlong truncate"):
        SFTDataset(tokens, mask, 0, len(tokens), 20, seed=0)
    ds = SFTDataset(tokens, mask, 0, len(tokens), 20, seed=0, truncate=True, packing=False)
    index = next(i for i in range(len(ds)) if ds.samples(i) == [3])
    assert ds[index]["input_ids"].tolist() == tokens[3][:20].tolist()  # its first 21 tokens: 20 positions


def _model():
    torch.manual_seed(0)
    return GPTModel(preset("tiny-llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                           ffn_hidden_size=64, seq_length=64))


def test_the_loss_is_the_masked_mean_by_hand(sft):
    """The mean over the completion tokens of every record, each record run alone, equals the batch's loss."""
    model = _model()
    total, count = 0.0, 0
    with torch.no_grad():
        for record in RECORDS:
            prompt, completion = BYTE.encode(record["prompt"]), BYTE.encode(record["completion"])
            ids = torch.tensor(prompt + completion + [BYTE.eod])
            logp = model(ids[None, :-1])[0, :, :BYTE.vocab_size].log_softmax(-1)  # [n - 1, V]
            for position in range(max(0, len(prompt) - 1), len(ids) - 1):  # targets: completion and eod
                total -= float(logp[position, ids[position + 1]])
                count += 1
        for packing in (False, True):
            ds = build_sft_datasets([sft], "1,0,0", 64, 0, BYTE, packing=packing)[0]
            batch = load_microbatches(ds, [list(range(len(ds)))])[0]
            assert int((batch["labels"] != IGNORE).sum()) == count == sum(
                len(r["completion"]) + 1 - (r["prompt"] == "") for r in RECORDS)  # a first token is no target
            if not packing:  # one sample per row, padding after it: the model sees each record alone
                loss = model(batch["input_ids"], batch["labels"], reduction="mean")
                assert float(loss) == pytest.approx(total / count, rel=1e-6)


HONOURS_POSITION_IDS = "position_ids" in inspect.signature(GPTModel.forward).parameters


@pytest.mark.skipif(not HONOURS_POSITION_IDS, reason="GPTModel.forward takes no position_ids yet (issue 45's "
                                                     "document masks): a packed batch would attend across samples")
def test_a_packed_batch_equals_the_unpacked_one(sft):
    results = []
    for packing in (False, True):
        model = _model()
        ds = build_sft_datasets([sft], "1,0,0", 64, 0, BYTE, packing=packing)[0]
        batch = load_microbatches(ds, [list(range(len(ds)))])[0]
        loss = model(batch["input_ids"], batch["labels"], reduction="sum", position_ids=batch["position_ids"])
        loss.backward()
        results.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (unpacked, grads), (packed, packed_grads) = results
    assert packed == pytest.approx(unpacked, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-6)


def _preprocess(argv):
    spec = importlib.util.spec_from_file_location("preprocess_tool", ROOT / "tools" / "preprocess_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tool.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("records,tokenizer,needle", [
    ([{"prompt": "a", "completion": "b"}, {"text": "x"}], "byte",
     "sft.jsonl:2: no \"prompt\" and \"completion\" strings and no \"messages\" (keys: ['text'])"),
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}], "byte",
     "sft.jsonl:1: a chat record (\"messages\") needs a tokenizer with a chat template: pass --tokenizer DIR"),
    ([{"messages": [{"role": "user", "content": "hi"}]}], "byte", "no \"assistant\" message"),
])
def test_bad_records_are_one_line(tmp_path, records, tokenizer, needle):
    code, out, err = _preprocess(["--sft", "--input", _write(tmp_path, records), "--output-prefix",
                                  tmp_path / "out", "--tokenizer", tokenizer])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.glob("out*"))  # nothing half written


def _chat_tokenizer(directory, template):
    """A small BPE tokenizer saved by transformers, with `template` as its chat template (or none)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(["system user assistant hi there how are you fine thanks"] * 3,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=specials, show_progress=False))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="[UNK]")
    fast.chat_template = template
    fast.save_pretrained(directory)
    return fast


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_records_train_on_the_assistant_turns_only(tmp_path):
    fast = _chat_tokenizer(tmp_path / "tok", TEMPLATE)
    messages = [{"role": "system", "content": "fine"}, {"role": "user", "content": "hi how are you"},
                {"role": "assistant", "content": "fine thanks"}, {"role": "user", "content": "there"},
                {"role": "assistant", "content": "hi there"}]
    code, out, err = _preprocess(["--sft", "--input", _write(tmp_path, [{"messages": messages}]),
                                  "--output-prefix", tmp_path / "chat", "--tokenizer", tmp_path / "tok"])
    assert code == 0, err
    tokens, mask = IndexedDataset(str(tmp_path / "chat")), IndexedDataset(str(tmp_path / "chat_loss_mask"))
    ids, trained = tokens[0].tolist(), mask[0].astype(bool)
    assert ids[:-1] == fast(fast.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    end = fast.convert_tokens_to_ids("<|im_end|>")
    expected = (fast("fine thanks", add_special_tokens=False)["input_ids"] + [end]
                + fast("hi there", add_special_tokens=False)["input_ids"] + [end])
    assert [i for i, t in zip(ids, trained) if t] == expected and not trained[-1]  # the eod: a boundary only


def test_a_tokenizer_without_a_chat_template_is_one_line(tmp_path):
    _chat_tokenizer(tmp_path / "tok", None)
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine"}]}]
    code, out, err = _preprocess(["--sft", "--input", _write(tmp_path, records), "--output-prefix", tmp_path / "c",
                                  "--tokenizer", tmp_path / "tok"])
    assert code == 2 and "has no chat template" in err and len(err.strip().splitlines()) == 1, err


def test_a_training_step_reports_the_global_masked_mean(sft, tmp_path):
    """Through the loop, 2 microbatches of unequal target counts: the step's loss is the mean over all
    targets of the step (not a mean of the microbatches' means), by hand from the saved weights."""
    from megalite.checkpoint import read_full_state
    from megalite.training import loop

    argv = ["--model", "tiny-llama", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--ffn-hidden-size", "64", "--seq-length", "64", "--sft", "--no-sft-packing",
            "--data-path", sft, "--split", "1,0,0", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "1", "--lr", "0", "--min-lr", "0", "--lr-warmup-iters", "0", "--eval-iters", "0",
            "--init-method-std", "0.5",  # per-token losses far apart: a mean of the microbatches' means would differ
            "--save", tmp_path / "ckpt", "--metrics-file", tmp_path / "m.jsonl"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert loop.main([str(a) for a in argv]) == 0
    config, full, _ = read_full_state(tmp_path / "ckpt")
    model = GPTModel(config)
    model.load_full_state_dict(full)
    losses = []
    with torch.no_grad():
        for record in RECORDS:
            prompt, completion = BYTE.encode(record["prompt"]), BYTE.encode(record["completion"])
            ids = torch.tensor(prompt + completion + [BYTE.eod])
            logp = model(ids[None, :-1])[0, :, :BYTE.vocab_size].log_softmax(-1)
            losses += [-float(logp[p, ids[p + 1]]) for p in range(max(0, len(prompt) - 1), len(ids) - 1)]
    logged = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])["loss"]
    assert logged == pytest.approx(sum(losses) / len(losses), rel=1e-5)


def test_sft_without_its_data_is_one_line(tmp_path, capsys):
    from megalite.training import loop

    assert loop.main(["--sft", "--train-iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "--sft trains on SFT samples: give --data-path PREFIX" in err and len(err.strip().splitlines()) == 1
    preprocess_sft([str(_write(tmp_path, RECORDS))], str(tmp_path / "plain"), "byte")
    (tmp_path / "plain_loss_mask.idx").unlink()  # plain (or half-copied) data: no mask beside it
    with pytest.raises(DataError, match="no loss mask .*plain_loss_mask.bin/.idx beside it; preprocess the records "
                                        "with tools/preprocess_data.py --sft"):
        build_sft_datasets([str(tmp_path / "plain")], "1,0,0", 64, 0, BYTE)
