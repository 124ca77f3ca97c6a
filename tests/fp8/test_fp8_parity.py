"""FP8 training is layout-free: at (tp 2, SP), (tp 2, pp 2, dp 2) and ZeRO-3 (with and without the
FP8 parameter gather) the losses and weights equal the FP8 single process (float32, 1e-5).

The reference runs in the parent process; each layout's ranks compare against it. The tp-sharded
casts agree only because their amax is all-reduced over tp (a per-shard scale fails these tests).
"""
import pytest
import torch

from megalite import comm, mesh, params as P
from megalite.config import RunConfig
from megalite.mesh import single_process_mesh
from megalite.model import preset
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

STEPS, MICRO, GLOBAL, SEQ = 2, 2, 8, 16


def _model():
    return preset("tiny-llama", num_layers=2, num_attention_heads=4, num_query_groups=2, seq_length=SEQ)


def _batches(vocab, dp, dp_rank):
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
        per_rank = GLOBAL // dp
        mine = ids[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        out.append([{"input_ids": i[:, :-1], "labels": i[:, 1:]} for i in mine.split(MICRO)])
    return out


def _cfg(tp=1, pp=1, dp=1, **kw):
    return RunConfig.build(tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3,
                           weight_decay=0.1, clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def _run(m, cfg):
    model = _model()
    chunks = build_model_chunks(model, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    comm.ledger.reset()
    losses = [train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3)["loss"]
              for mbs in _batches(model.vocab_size, m.dp_size, m.dp_rank)]
    return losses, chunks, optimizer.model


def _reference(recipe):
    torch.set_num_threads(1)
    losses, chunks, _ = _run(single_process_mesh("cpu"), _cfg(fp8_format="hybrid", fp8_recipe=recipe))
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    return losses, params


def _parallel(tp, pp, dp, extra, ref_losses, ref_params):
    m = mesh.init_mesh(tp=tp, pp=pp, dp=dp)
    losses, chunks, dp_model = _run(m, _cfg(tp, pp, dp, fp8_format="hybrid", **extra))
    ledger = dict(comm.ledger.bytes)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    with dp_model.gathered():  # ZeRO-3 holds only its shard between steps
        for chunk in chunks:
            for name, p in chunk.logical_parameters():
                assert_tensor_close(p, P.shard_spec(p).shard(ref_params[name]), rtol=1e-5, what=name)
    return ledger


@pytest.fixture(scope="module")
def tensorwise():
    return _reference("tensorwise")


def test_fp8_differs_from_fp32_but_trains(tensorwise):
    fp32_losses, _, _ = _run(single_process_mesh("cpu"), _cfg())
    assert tensorwise[0] != fp32_losses  # the GEMMs did run in FP8
    torch.testing.assert_close(tensorwise[0], fp32_losses, rtol=0.02, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_pp2_dp2_matches_the_fp8_single_process(recipe):
    ref = _reference(recipe)
    run_distributed(_parallel, 4, 1, 2, 2, {"fp8_recipe": recipe, "zero": 1}, *ref, timeout_s=300)


@pytest.mark.slow
def test_zero3_with_and_without_the_fp8_param_gather_matches(tensorwise):
    plain = run_distributed(_parallel, 2, 1, 1, 2, {"zero": 3}, *tensorwise, timeout_s=240)[0]
    fp8 = run_distributed(_parallel, 2, 1, 1, 2, {"zero": 3, "fp8_param_gather": True}, *tensorwise,
                          timeout_s=240)[0]
    gathered = plain[("dp", "all_gather")], fp8[("dp", "all_gather")]
    assert gathered[1] < 0.3 * gathered[0], gathered  # fp32 training: 1 byte of 4 for the blocks' weights
