"""Training steps under DualPipeV (pp ranks, two model chunks each in a V) equal the single process.

The same seed, global batches and float32 as test_train_step.py: the step's loss, the evaluation
loss and every parameter after the step within 1e-5 relative of the (1, 1, 1) run. DualPipeV needs at least
2*pp microbatches and 2*pp chunks of blocks: the global batch of 8 sequences runs as 4
microbatches of 2 over 4 blocks at pp 2, as 8 of 1 over 8 blocks at pp 4 (each against the
single process with the same split).
"""
import pytest
import torch

from megalite.config import RunConfig
from megalite.distributed import mesh
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.parameters import params as P
from megalite.pipeline.partition import ChunkPlacement, stage_layers
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, evaluate, train_step

STEPS, GLOBAL, SEQ = 1, 8, 16


def _model(layers):
    return preset("tiny-llama", num_layers=layers, num_attention_heads=4, num_query_groups=2, seq_length=SEQ)


def _batches(vocab, dp, dp_rank, micro):
    """Step k's microbatches for this dp rank (the global batch split like GlobalBatchSampler)."""
    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=gen)
        inputs, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[step % GLOBAL, : 3 + step] = -100  # uneven target counts across microbatches
        per_rank = GLOBAL // dp
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        out.append([{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(micro), labels[mine].split(micro))])
    return out


def _cfg(tp, pp, dp, micro, **kw):
    return RunConfig.build(tp=tp, pp=pp, dp=dp, micro_batch_size=micro, global_batch_size=GLOBAL, lr=1e-3,
                           weight_decay=0.1, clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def _run(m, cfg, layers, micro):
    model = _model(layers)
    chunks = build_model_chunks(model, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    losses = [train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3).loss
              for mbs in _batches(model.vocab_size, m.dp_size, m.dp_rank, micro)]
    return losses, chunks


def _reference(layers, micro):
    m, cfg = single_process_mesh("cpu"), _cfg(1, 1, 1, micro)
    losses, chunks = _run(m, cfg, layers, micro)
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    return losses, params, evaluate(chunks, _batches(chunks[0].config.vocab_size, 1, 0, micro)[0], m, cfg)


def _dualpipev(tp, pp, dp, extra, ref_losses, ref_params, ref_eval):
    layers, micro = 2 * pp, GLOBAL // (2 * pp * dp)  # one block per model chunk, 2*pp microbatches per dp rank
    m = mesh.init_mesh(tp=tp, pp=pp, dp=dp)
    cfg = _cfg(tp, pp, dp, micro, virtual_stages=2, pipeline_schedule="dualpipev", **extra)
    losses, chunks = _run(m, cfg, layers, micro)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    eval_loss = evaluate(chunks, _batches(chunks[0].config.vocab_size, dp, m.dp_rank, micro)[0], m, cfg)
    torch.testing.assert_close(eval_loss, ref_eval, rtol=1e-5, atol=0)
    # The V: this rank's chunks hold model chunks pp_rank and 2pp-1-pp_rank; rank 0 the embedding and the head.
    expected = stage_layers(layers, pp, 2, m.pp_rank, placement=ChunkPlacement.V)
    assert [list(chunk.layer_ids) for chunk in chunks] == [list(r) for r in expected]
    assert [chunk.pre_process for chunk in chunks] == [m.pp_rank == 0, False]
    assert [chunk.post_process for chunk in chunks] == [False, m.pp_rank == 0]
    checked = 0
    for chunk in chunks:
        for name, p in chunk.logical_parameters():
            assert_tensor_close(p, P.shard_spec(p).shard(ref_params[name]), rtol=1e-5, what=name)
            checked += 1
    return checked


@pytest.mark.parametrize("tp, pp, dp, extra", [
    (1, 2, 1, {}),
    pytest.param(1, 4, 1, {}, marks=pytest.mark.slow),
    pytest.param(1, 2, 2, {"zero": 1}, marks=pytest.mark.slow),
    pytest.param(2, 2, 1, {"sequence_parallel": True}, marks=pytest.mark.slow),
])
def test_dualpipev_training_matches_single_process(tp, pp, dp, extra):
    ref_losses, ref_params, ref_eval = _reference(2 * pp, GLOBAL // (2 * pp * dp))
    checked = run_distributed(_dualpipev, tp * pp * dp, tp, pp, dp, extra, ref_losses, ref_params, ref_eval,
                              timeout_s=240)
    # every logical parameter compared on the rank holding it: blocks on every rank, embedding and head on 0
    assert all(n > 0 for n in checked)


def _main_capturing(argv):
    import contextlib
    import io

    from megalite.training.loop import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


@pytest.mark.parametrize("argv, needle", [
    (["--virtual-stages", "2", "--untie-embeddings-and-output-weights", "--global-batch-size", "6",
      "--micro-batch-size", "2"], "schedule 'dualpipev' needs at least 2*pp = 4 microbatches, got 3"),
    pytest.param(["--untie-embeddings-and-output-weights", "--global-batch-size", "8", "--micro-batch-size", "2"],
                 "set --virtual-stages 2", marks=pytest.mark.slow),
    pytest.param(["--virtual-stages", "2", "--global-batch-size", "8", "--micro-batch-size", "2"],
                 "add --untie-embeddings-and-output-weights", marks=pytest.mark.slow),
])
def test_bad_dualpipev_settings_stop_every_rank_in_one_line(argv, needle):
    results = run_distributed(_main_capturing, 2, ["--pp", "2", "--pipeline-schedule", "dualpipev", *argv],
                              timeout_s=60)
    assert all(code == 2 for code, _ in results)
    assert results[0][1].count("\n") == 1 and needle in results[0][1], results[0][1]
    assert results[1][1] == ""
