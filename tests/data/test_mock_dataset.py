"""--mock-data: synthetic token ids, a pure function of (seed, split, data position), over the model's
own vocabulary; the llama3-1b preset's real 128k vocabulary trains and plans without a corpus."""
import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

from megalite.data import DataError, GlobalBatchSampler, MockDataset, build_mock_datasets, load_microbatches
from megalite.testing import run_distributed
from megalite.training.loop import main

SMALL_LLAMA3 = ["--model", "llama3-1b", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
                "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-length", "16"]


def test_samples_are_a_function_of_seed_split_and_position():
    ds = MockDataset(vocab_size=1000, seq_length=12, seed=3)
    sample = ds[5]
    assert sample["input_ids"].dtype == torch.long and sample["input_ids"].shape == (12,)
    assert torch.equal(sample["labels"][:-1], sample["input_ids"][1:])  # labels already shifted
    # the same position in a new object (another rank, a resumed run) reads the same ids
    assert torch.equal(MockDataset(1000, 12, 3)[5]["input_ids"], sample["input_ids"])
    assert np.array_equal(ds.tokens(5), np.random.default_rng([3, 0, 5]).integers(0, 1000, 13))
    assert not torch.equal(ds[6]["input_ids"], sample["input_ids"])
    assert not torch.equal(MockDataset(1000, 12, 4)[5]["input_ids"], sample["input_ids"])
    assert not torch.equal(MockDataset(1000, 12, 3, "valid")[5]["input_ids"], sample["input_ids"])
    ids = torch.stack([ds[i]["input_ids"] for i in range(400)])  # 4800 draws over 1000 ids: all in range, spread
    assert 0 <= ids.min() and ids.max() < 1000 and ids.unique().numel() > 900
    with pytest.raises(IndexError, match="out of range"):
        ds[len(ds)]


def test_splits_and_the_sampler_stay_in_the_first_epoch():
    train, valid, test = build_mock_datasets(50, 8, seed=1, split="98,2,0")
    assert test is None and valid.split == "valid" and len(train) >= 2 ** 40
    sampler = GlobalBatchSampler(len(train), global_batch_size=4, micro_batch_size=2, dp_rank=1, dp_size=2,
                                 consumed_samples=10 ** 9)
    (first,) = next(iter(sampler))  # this rank: one microbatch of 2
    assert first == [10 ** 9 + 2, 10 ** 9 + 3]  # position p reads sample p: no permutation of 2^40 samples
    batch = load_microbatches(train, [first])[0]
    assert batch["input_ids"].shape == (2, 8)
    with pytest.raises(DataError, match="training split weight 0"):
        build_mock_datasets(50, 8, split="0,1,0")


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_print_config_and_dry_run_use_the_presets_vocabulary():
    code, out, _ = _run(["--model", "llama3-1b", "--mock-data", "--print-config"])
    assert code == 0 and "#   vocab_size = 128256" in out and "#   params = 1235814400" in out
    code, out, _ = _run(["--model", "llama3-1b", "--print-config"])  # a corpus: the named preset's vocabulary
    assert code == 0 and "#   vocab_size = 128256" in out  # (issue 49: the byte tokenizer's 257 ids pad up to it)
    code, out, _ = _run(["--print-config"])  # the default preset: the tokenizer's, as before
    assert code == 0 and "#   vocab_size = 257" in out
    code, out, _ = _run(["--model", "llama3-1b", "--mock-data", "--bf16", "--micro-batch-size", "4", "--dry-run"])
    assert code == 0 and "parameters            2.472 GB" in out  # 1.236e9 bf16 parameters, the head tied


def test_mock_data_refuses_a_corpus():
    code, _, err = _run(["--mock-data", "--data-path", "my_corpus", "--dry-run"])
    assert code == 2 and "drop --data-path/--tokenizer, or drop --mock-data" in err and "Traceback" not in err


def test_llama3_shaped_model_trains_on_its_128k_vocabulary(tmp_path):
    metrics = tmp_path / "m.jsonl"
    argv = SMALL_LLAMA3 + ["--mock-data", "--micro-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
                           "--eval-iters", "1", "--eval-interval", "2", "--metrics-file", str(metrics)]
    assert run_distributed(main, 1, argv, timeout_s=120) == [0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    # near-uniform logits at init over the true 128256 ids (the byte tokenizer's 257 would give ~5.5)
    assert len(losses) == 2 and all(abs(loss - math.log(128256)) < 0.5 for loss in losses), losses
    assert [r for r in records if "eval_loss" in r]


def test_the_planner_knows_the_preset(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool_mock", path)
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    assert plan.main(["--model", "llama3-1b", "--mock-data", "--bf16", "--micro-batch-size", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["param_bytes"] == 2 * 1235814400  # bf16, 128256 x 2048 embedding counted once (tied)
