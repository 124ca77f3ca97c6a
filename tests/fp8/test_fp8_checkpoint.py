"""An FP8 run's checkpoint holds nothing FP8-specific (current scaling keeps no amax history):
resuming equals the uninterrupted run, and the checkpoint loads into a run without FP8 and back."""
import pathlib
import sys

import pytest
import torch

from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.distributed.mesh import single_process_mesh

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "checkpoint"))
from ckpt_helpers import GLOBAL, build, full_params, model_config, train, train_config  # noqa: E402

QUIET = dict(log=lambda *_: None)


def _save(directory, step, chunks, optimizer, m, model, cfg):
    Checkpointer(directory, m, **QUIET).save(step, chunks, optimizer, consumed_samples=step * GLOBAL,
                                             model_config=model, train_config=cfg)


@pytest.mark.slow
def test_fp8_resumes_exactly_and_its_checkpoint_is_a_plain_one(tmp_path):
    torch.set_num_threads(1)
    m, model = single_process_mesh("cpu"), model_config("llama")
    fp8, plain = train_config(fp8_format="hybrid"), train_config()
    chunks, optimizer = build(model, fp8, m)
    train(chunks, optimizer, m, fp8, [1, 2])
    _save(tmp_path / "fp8", 2, chunks, optimizer, m, model, fp8)
    saved = full_params(chunks)
    uninterrupted = train(chunks, optimizer, m, fp8, [3, 4])

    chunks, optimizer = build(model, fp8, m)  # resume: the same losses, bit for bit
    assert load_checkpoint(tmp_path / "fp8", chunks, optimizer, m, **QUIET).step == 2
    assert train(chunks, optimizer, m, fp8, [3, 4]) == uninterrupted

    chunks, optimizer = build(model, plain, m)  # into a run without FP8: the same weights
    load_checkpoint(tmp_path / "fp8", chunks, optimizer, m, **QUIET)
    assert all(torch.equal(p, saved[n]) for n, p in full_params(chunks).items())
    train(chunks, optimizer, m, plain, [3])
    _save(tmp_path / "plain", 3, chunks, optimizer, m, model, plain)
    after_plain = full_params(chunks)
    chunks, optimizer = build(model, fp8, m)  # and back into FP8
    load_checkpoint(tmp_path / "plain", chunks, optimizer, m, **QUIET)
    assert all(torch.equal(p, after_plain[n]) for n, p in full_params(chunks).items())
    assert all(torch.isfinite(torch.tensor(loss)) for loss in train(chunks, optimizer, m, fp8, [4]))
