"""Full training steps at (tp, pp, dp) equal the same steps at (1, 1, 1).

Same seed, same global batches, float32: the loss of every step and every parameter after
the last step must match the single-process run (~1e-5 relative). The reference runs in the
parent process; ranks compare their shards against it.
"""
import pytest
import torch

from megalite.parameters import params as P
from megalite.distributed import mesh
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.testing import assert_tensor_close, run_distributed
from megalite.config import RunConfig
import torch.nn.functional as F

from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, evaluate, train_step

STEPS, MICRO, GLOBAL, SEQ = 3, 2, 8, 16


def _model(name):
    if name == "tiny-llama":
        return preset(name, num_layers=4, num_attention_heads=4, num_query_groups=2, seq_length=SEQ)
    return preset(name, num_layers=4, seq_length=SEQ)


def _batches(vocab, dp, dp_rank):
    """Step k's microbatches for this dp rank: the global batch k split like GlobalBatchSampler."""
    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100)  # the same tokens every step, so the loss must fall
        ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=gen)
        inputs, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[step % GLOBAL, : 3 + step] = -100  # uneven target counts across ranks
        per_rank = GLOBAL // dp
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        out.append([{"input_ids": i, "labels": t}
                    for i, t in zip(inputs[mine].split(MICRO), labels[mine].split(MICRO))])
    return out


def _cfg(tp, pp, dp, **kw):
    # adam_eps=1e-6, above float32 gradient noise (~1e-10 here): the attention key bias has an
    # exactly zero true gradient (softmax ignores a per-query constant), so with eps=1e-8 Adam
    # would turn each layout's rounding noise into lr-sized, layout-dependent updates.
    return RunConfig.build(tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3,
                       weight_decay=0.1, clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def _run(name, m, cfg):
    model = _model(name)
    chunks = build_model_chunks(model, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    losses = [train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3).loss
              for mbs in _batches(model.vocab_size, m.dp_size, m.dp_rank)]
    return losses, chunks


def _reference(name):
    m, cfg = single_process_mesh("cpu"), _cfg(1, 1, 1)
    losses, chunks = _run(name, m, cfg)
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    # Evaluation after training, checked against a hand computation from the logits.
    mbs = _batches(chunks[0].config.vocab_size, 1, 0)[0]
    eval_loss = evaluate(chunks, mbs, m, cfg)
    with torch.no_grad():
        vocab = chunks[0].config.vocab_size
        logits = torch.cat([chunks[0](mb["input_ids"])[..., :vocab] for mb in mbs])
        labels = torch.cat([mb["labels"] for mb in mbs])
        by_hand = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100).item()
    assert abs(eval_loss - by_hand) <= 1e-5 * by_hand
    return losses, params, eval_loss


def _parallel(name, tp, pp, dp, extra, ref_losses, ref_params, ref_eval):
    m = mesh.init_mesh(tp=tp, pp=pp, dp=dp)
    cfg = _cfg(tp, pp, dp, **extra)
    losses, chunks = _run(name, m, cfg)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    eval_loss = evaluate(chunks, _batches(chunks[0].config.vocab_size, dp, m.dp_rank)[0], m, cfg)
    torch.testing.assert_close(eval_loss, ref_eval, rtol=1e-5, atol=0)
    for chunk in chunks:
        for name_, p in chunk.logical_parameters():
            # Tensor-relative: elementwise is ill-conditioned after Adam (see assert_tensor_close).
            assert_tensor_close(p, P.shard_spec(p).shard(ref_params[name_]), rtol=1e-5, what=name_)
    return losses


LAYOUTS = [
    (1, 1, 2, {}), (1, 1, 4, {"zero": 1}), (2, 1, 2, {"sequence_parallel": True, "zero": 2}),
    (1, 2, 2, {}), (2, 2, 2, {"zero": 1}), (1, 4, 1, {"pipeline_schedule": "gpipe"}),
    (1, 2, 1, {"virtual_stages": 2, "pipeline_schedule": "interleaved"}),
    (1, 2, 2, {"pipeline_schedule": "zb-h1", "zero": 1}),
    (2, 1, 2, {"sequence_parallel": True, "zero": 1, "overlap_param_gather": True, "fused_linear_cross_entropy": True}),
]


# The llama flavour shares every code path but its blocks; a smaller grid covers it.
LLAMA_LAYOUTS = [LAYOUTS[2], LAYOUTS[4], LAYOUTS[6]]


@pytest.mark.parametrize("name,layouts", [pytest.param("tiny", LAYOUTS, marks=pytest.mark.slow),  # 5 s
                                          ("tiny-llama", LLAMA_LAYOUTS)])
def test_training_steps_match_single_process(name, layouts):
    ref_losses, ref_params, ref_eval = _reference(name)
    assert ref_losses[-1] < ref_losses[0]
    for tp, pp, dp, extra in layouts:
        run_distributed(_parallel, tp * pp * dp, name, tp, pp, dp, extra, ref_losses, ref_params, ref_eval,
                        timeout_s=180)


def _overlap_order():
    m = mesh.init_mesh(tp=1, pp=2, dp=2)
    cfg = _cfg(1, 2, 2, ddp_bucket_size=20_000)  # small buckets, so several fill during backward
    model = _model("tiny")
    chunks = build_model_chunks(model, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    from megalite.distributed import comm

    for mbs in _batches(model.vocab_size, 2, m.dp_rank)[:2]:  # step 1 calibrates bucket counts
        comm.ledger.ring.clear()
        train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3)
    ops = [(r.group, r.op) for r in comm.recent_ops()]
    first_pp = min(i for i, (g, o) in enumerate(ops) if g == "pp")
    last_pp = max(i for i, (g, o) in enumerate(ops) if g == "pp")
    # (the dp all-reduce of the token count comes before the pipeline; skip it)
    first_dp = next(i for i, (g, o) in enumerate(ops) if i > first_pp and g == "dp"
                    and o in ("all_reduce", "reduce_scatter"))
    return m.pp_rank, first_dp, last_pp


def test_dp_reduction_overlaps_the_pipelines_last_backward():
    for stage, first_dp, last_pp in run_distributed(_overlap_order, 4):
        if stage == 1:  # the last stage sends its last input gradient after its last backward
            assert first_dp < last_pp, "dp buckets should start before the last stage's final send"
