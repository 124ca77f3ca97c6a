"""Training steps on packed documents (microbatches with restarting position_ids, as
--reset-position-ids --reset-attention-mask make them) at (dp 2), (tp 2, SP), (pp 2), ZeRO 3, MoE
(ep 2), (cp 2 ring) and (cp 2 Ulysses) equal the single
process: every step's loss and every parameter after the last step (float32, 1e-5 relative), and a
DeepSeek-shaped model (latent attention, MoE, MTP) under a window at the cp layouts. The flags'
refusals are one line each."""
import pytest
import torch

from megalite.distributed import mesh
from megalite.parameters import params as P
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

STEPS, MICRO, GLOBAL, SEQ = 2, 2, 4, 16
LENGTHS = ([16], [1, 15], [5, 3, 1, 7], [8, 8])  # per sample of the global batch: 1-token and whole-sequence


def _batches(vocab, dp, dp_rank):
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[2, 4] = -100  # a masked target: the mean is over the unmasked targets of the global batch
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in LENGTHS])
    mine = slice(dp_rank * GLOBAL // dp, (dp_rank + 1) * GLOBAL // dp)
    step = [{"input_ids": i, "labels": t, "position_ids": p} for i, t, p in
            zip(inputs[mine].split(MICRO), labels[mine].split(MICRO), positions[mine].split(MICRO))]
    return [step] * STEPS


MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-2)


# DeepSeek's pieces: latent attention (d_qk 24 != d_v 16), an MoE block with group-limited routing, two MTP
# depths, and a window of 6 over the documents
DEEPSEEK = dict(model="deepseek-tiny", hidden_size=64, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=16,
                qk_pos_emb_head_dim=8, v_head_dim=16, mtp_num_layers=2, window_size=6)


def _cfg(tp, dp, **kw):
    settings = dict(model="tiny-llama", num_layers=2, seq_length=SEQ)
    return RunConfig.build(tp=tp, dp=dp, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3, seed=3,
                           adam_eps=1e-6, reset_position_ids=True, reset_attention_mask=True, **{**settings, **kw})


def _run(m, cfg, documents=True):
    model = cfg.gpt_config()
    chunks = build_model_chunks(model, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    batches = _batches(model.vocab_size, m.dp_size, m.dp_rank)
    if not documents:  # one causal sequence per sample
        batches = [[{k: v for k, v in mb.items() if k != "position_ids"} for mb in step] for step in batches]
    losses = [train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3).loss for mbs in batches]
    return losses, chunks


def _parallel(tp, dp, extra, ref_losses, ref_params):
    extra = dict(extra)
    pp, cp = extra.pop("pp", 1), extra.pop("cp", 1)
    cfg = _cfg(tp, dp, pp=pp, cp=cp, **extra)
    moe = cfg.gpt_config().moe  # the mesh's expert groups are built for the model's experts
    m = mesh.init_mesh(tp=tp, dp=dp, pp=pp, cp=cp, ep=cfg.parallel.ep,
                       num_experts=moe.num_experts if moe is not None else 0)
    losses, chunks = _run(m, cfg)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)  # step 2's loss follows step 1's update
    if extra.get("zero") == 3:  # parameters live as shards between steps: the losses say it
        return len(losses)
    for chunk in chunks:
        for name, p in chunk.logical_parameters():
            assert_tensor_close(p, P.shard_spec(p).shard(ref_params[name]), rtol=1e-5, what=name)
    return len(losses)


LAYOUTS = {"dense": [(1, 2, {"zero": 1}), (2, 1, {"sequence_parallel": True}), (1, 1, {"pp": 2}), (1, 2, {"zero": 3})],
           "moe": [(1, 2, {"ep": 2, **MOE})]}


@pytest.mark.slow  # ~14 s on a shared 2-core machine; the quick tier has tests/model/test_gpt_documents.py
@pytest.mark.parametrize("model", ["dense", "moe"])
def test_packed_training_matches_single_process(model):
    settings = MOE if model == "moe" else {}
    losses, chunks = _run(single_process_mesh("cpu"), _cfg(1, 1, **settings))
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    unpacked = _run(single_process_mesh("cpu"), _cfg(1, 1, **settings), documents=False)[0]
    assert unpacked[0] != pytest.approx(losses[0], rel=1e-4)
    for tp, dp, extra in LAYOUTS[model]:
        world = tp * dp * extra.get("pp", 1)
        assert run_distributed(_parallel, world, tp, dp, extra, losses, params) == [STEPS] * world


def _single_process_reference():
    losses, chunks = _run(single_process_mesh("cpu"), _cfg(1, 1))
    return losses, {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}


# slow, as the other layouts' (the quick tier has tests/model/test_gpt_documents_cp.py): the ring, Ulysses,
# and cp composed with (tp 2, SP), (pp 2) and (dp 2, ZeRO 1)
@pytest.mark.parametrize("tp, dp, extra", [
    pytest.param(1, 1, {"cp": 2}, marks=pytest.mark.slow),
    pytest.param(1, 1, {"cp": 2, "cp_comm_type": "a2a"}, marks=pytest.mark.slow),
    pytest.param(2, 1, {"cp": 2, "sequence_parallel": True}, marks=pytest.mark.slow),
    pytest.param(1, 1, {"cp": 2, "pp": 2, "cp_comm_type": "a2a"}, marks=pytest.mark.slow),
    pytest.param(1, 2, {"cp": 2, "zero": 1}, marks=pytest.mark.slow)])
def test_packed_training_with_context_parallelism_matches_single_process(tp, dp, extra):
    """Documents crossing the cp chunk edges (chunks of 4 tokens): lengths 1, 15, 5, 3, 7, 8."""
    losses, params = _single_process_reference()
    world = tp * dp * extra["cp"] * extra.get("pp", 1)
    assert run_distributed(_parallel, world, tp, dp, extra, losses, params) == [STEPS] * world


@pytest.mark.slow  # ~3-9 s each: a DeepSeek-shaped model in 2- and 4-rank worlds
@pytest.mark.parametrize("tp, extra", [(1, {"cp": 2}), (1, {"cp": 2, "cp_comm_type": "a2a"}),
                                       (2, {"cp": 2, "sequence_parallel": True}),
                                       (1, {"cp": 2, "pp": 2, "cp_comm_type": "a2a"})],
                         ids=["cp2-ring", "cp2-ulysses", "tp2-sp-cp2", "pp2-cp2-ulysses"])
def test_packed_deepseek_training_with_context_parallelism_matches_single_process(tp, extra):
    """Latent attention and MTP on packed documents under a window at cp 2, with tp 2 + SP, and with pp 2
    (MTP on the last stage with its copy of the embedding; quick at the model level:
    tests/model/test_deepseek_documents_cp.py): the losses and every parameter after two steps."""
    losses, chunks = _run(single_process_mesh("cpu"), _cfg(1, 1, **DEEPSEEK))
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    extra = {**extra, **DEEPSEEK}
    assert _cfg(tp, 1, **extra).validate() == []  # refused until this test proved it
    world = tp * extra["cp"] * extra.get("pp", 1)
    assert run_distributed(_parallel, world, tp, 1, extra, losses, params) == [STEPS] * world


@pytest.mark.parametrize("flags, message", [
    (dict(reset_attention_mask=True), "pass --reset-position-ids and --reset-attention-mask together"),
    (dict(reset_attention_mask=True, reset_position_ids=True, cuda_graph=True),
     "--reset-attention-mask does not run with --cuda-graph yet"),
    (dict(eod_mask_loss=True, mock_data=True), "--eod-mask-loss needs documents")])
def test_document_flags_refusals(flags, message):
    problems = RunConfig.build(**flags).validate()
    assert [p for p in problems if message in p] and all("\n" not in p for p in problems), problems
