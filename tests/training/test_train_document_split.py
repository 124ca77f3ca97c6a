"""Training on packed documents under the per-document cp split (--cp-split documents) equals the
single process: every step's loss (1e-5 relative) and every parameter after the last step, at
(cp 2 ring), (cp 2 Ulysses), (tp 2, SP, cp 2) and (pp 2, cp 2) (slow tier). The data are
tests/training/test_train_step_documents.py's (lengths 1, 15, 5, 3, 7, 8 and a whole-sequence
document at cp 2's chunks of 4 tokens). A DeepSeek-shaped model (latent attention, MTP, an MoE capacity that
drops routes by position) at (cp 2 ring), (cp 2 Ulysses) and (tp 2, SP, cp 2) too (slow). The flag's refusals
are one line each."""
import contextlib
import io
import os
import sys

import pytest

from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.parameters import params as P
from megalite.testing import run_distributed
from megalite.training.loop import main

sys.path.insert(0, os.path.dirname(__file__))
from test_train_step_documents import DEEPSEEK, STEPS, _cfg, _parallel, _run, _single_process_reference  # noqa: E402

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


# DeepSeek's pieces under the split: latent attention, an MoE block whose capacity drops routes, two MTP
# depths (no window: the split refuses one)
SPLIT_DEEPSEEK = {**{k: v for k, v in DEEPSEEK.items() if k != "window_size"}, "moe_expert_capacity_factor": 0.25,
                  "moe_token_drop_policy": "position"}  # the token order decides the drops


@pytest.mark.slow  # a DeepSeek-shaped model in 2- and 4-rank worlds; quick at the model level:
# tests/model/test_document_split_deepseek.py
@pytest.mark.parametrize("tp, extra", [(1, {"cp": 2}), (1, {"cp": 2, "cp_comm_type": "a2a"}),
                                       (2, {"cp": 2, "sequence_parallel": True})],
                         ids=["cp2-ring", "cp2-ulysses", "tp2-sp-cp2"])  # tp 2: etp 1, capacity over tp x cp
def test_deepseek_training_under_the_document_split_matches_single_process(tp, extra):
    losses, chunks = _run(single_process_mesh("cpu"), _cfg(1, 1, **SPLIT_DEEPSEEK))
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    dropless = {k: v for k, v in SPLIT_DEEPSEEK.items() if k != "moe_expert_capacity_factor"}
    # the drops move the loss by more than the parity's tolerance (6.5e-5 relative at step 1)
    assert _run(single_process_mesh("cpu"), _cfg(1, 1, **dropless))[0][0] != pytest.approx(losses[0], rel=2e-5)
    extra = {**extra, **SPLIT_DEEPSEEK, "cp_split": "documents"}
    world = tp * extra["cp"]
    assert run_distributed(_parallel, world, tp, 1, extra, losses, params) == [STEPS] * world


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
