"""Training on packed documents under the per-document cp split (--cp-split documents) equals the
single process: every step's loss (1e-5 relative) and every parameter after the last step, at
(cp 2 ring), (cp 2 Ulysses), (tp 2, SP, cp 2) and (pp 2, cp 2) (slow tier). The data are
tests/training/test_train_step_documents.py's (lengths 1, 15, 5, 3, 7, 8 and a whole-sequence
document at cp 2's chunks of 4 tokens). The flag's refusals are one line each."""
import contextlib
import io
import os
import sys

import pytest

from megalite.config import RunConfig
from megalite.testing import run_distributed
from megalite.training.loop import main

sys.path.insert(0, os.path.dirname(__file__))
from test_train_step_documents import STEPS, _parallel, _single_process_reference  # noqa: E402

DOCUMENTS = {"reset_position_ids": True, "reset_attention_mask": True}


# slow, as test_train_step_documents.py's cp layouts (~9 s here); the quick tier has
# tests/model/test_gpt_document_split.py and tests/context_parallel/test_document_split.py
@pytest.mark.parametrize("tp, extra", [
    pytest.param(1, {"cp": 2}, marks=pytest.mark.slow),
    pytest.param(1, {"cp": 2, "cp_comm_type": "a2a"}, marks=pytest.mark.slow),
    pytest.param(2, {"cp": 2, "sequence_parallel": True}, marks=pytest.mark.slow),
    pytest.param(1, {"cp": 2, "pp": 2}, marks=pytest.mark.slow)])  # each stage derives the split itself
def test_packed_training_under_the_document_split_matches_single_process(tp, extra):
    losses, params = _single_process_reference()
    world = tp * extra["cp"] * extra.get("pp", 1)
    settings = {**extra, "cp_split": "documents"}
    assert run_distributed(_parallel, world, tp, 1, settings, losses, params) == [STEPS] * world


@pytest.mark.parametrize("flags, message", [
    ({}, "--cp-split documents splits packed documents: add --reset-attention-mask (or --sft)"),
    ({**DOCUMENTS, "window_size": 8}, "--cp-split documents with --window-size balances the work worse"),
    ({**DOCUMENTS, "cp": 2, "attention_dropout": 0.1},
     "--cp-split documents does not run with --hidden-dropout/--attention-dropout yet")])
def test_document_split_refusals(flags, message):
    problems = RunConfig.build(cp_split="documents", **flags).validate()
    assert [p for p in problems if message in p] and all("\n" not in p for p in problems), problems


MLA = {"model": "tiny-llama", "multi_latent_attention": True, "kv_lora_rank": 32, "qk_head_dim": 16,
       "qk_pos_emb_head_dim": 8, "v_head_dim": 16}


@pytest.mark.parametrize("flags", [{"num_experts": 4, "moe_expert_capacity_factor": 1.0}, {"mtp_num_layers": 1}, MLA])
def test_the_split_runs_moe_mtp_and_latent_attention(flags):
    cfg = RunConfig.build(cp_split="documents", cp=2, **DOCUMENTS, **flags)
    cfg.gpt_config()  # a model that builds, so the split's check ran
    assert cfg.validate() == []


def _main_err(argv) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def test_the_training_program_refuses_the_split_without_documents_in_one_line():
    code, err = run_distributed(_main_err, 1, ["--cp-split", "documents", "--mock-data", "--train-iters", "1"],
                                timeout_s=120)[0]
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--cp-split documents splits packed" in err, err
