"""Training steps with --grad-compression powersgd, through train_step and checkpoints.

- At rank >= min(n, m) (every matrix compressed, nothing lost) the steps equal the uncompressed
  single-process run, at (1, 1, 2) ZeRO 1 with accumulation and at (2, 1, 2) with SP.
- At rank 4 the compressed run depends on the replicas' gradients only through their sum (see
  powersgd.py), so it is the same run at dp 2 ZeRO 1 with accumulation, dp 4 ZeRO 0,
  (pp 2, dp 4) ZeRO 1, whose two copies of the tied embedding must stay identical, and
  (cp 2, dp 2), whose replicas are the dp x cp group.
- The dp group's bytes of a compressed step equal the planner's estimate; the step reports the
  compression ratio.
- A checkpoint resumes at the same layout with bit-identical losses; at dp 4 the stored residual
  shares arrive summed on replica 0 and the run continues with the uninterrupted losses; at tp 2
  each replica's share arrives sliced like the weights, and tp-sharded matrices restart their Q.
- fp16: an overflowing step (skipped by the loss scaler) leaves the residuals and Q untouched.
"""
import pytest
import torch

from megalite.distributed import comm
from megalite.parameters import params as P
from megalite.distributed import mesh as mesh_lib
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.config import RunConfig
from megalite.data_parallel.powersgd import first_q
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.plan.communication import communication_bytes
from megalite.plan.compression import compression_state_bytes
from megalite.testing import run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

MICRO, GLOBAL, SEQ, STEPS = 2, 8, 16, 4
FULL_RANK = dict(grad_compression="powersgd", powersgd_rank=10_000, powersgd_min_compression=0.0)
RANK4 = dict(grad_compression="powersgd", powersgd_rank=4, powersgd_warmup_steps=1)
QUIET = dict(log=lambda *_: None)


def _model():
    return preset("tiny", num_layers=2, hidden_size=64, seq_length=SEQ)


def _cfg(tp=1, pp=1, dp=1, **kw):
    return RunConfig.build(tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3, seed=3,
                           weight_decay=0.1, clip_grad=0.5, adam_eps=1e-6, **kw)


def _batches(step, dp, dp_rank):
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[step % GLOBAL, : 3 + step] = -100  # uneven target counts across ranks
    mine = slice(dp_rank * GLOBAL // dp, (dp_rank + 1) * GLOBAL // dp)
    return [{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(MICRO), labels[mine].split(MICRO))]


def _build(m, cfg):
    chunks = build_model_chunks(_model(), cfg, m)
    return chunks, build_optimizer(build_data_parallel(chunks, cfg, m), cfg)


def _train(chunks, optimizer, m, cfg, steps, ledgers=None):
    results = []
    for step in steps:
        comm.ledger.reset()
        results.append(train_step(optimizer.model, optimizer, _batches(step, m.dp_size, m.dp_rank), m, cfg,
                                  lr=1e-3 * (1 + 0.1 * step)))
        if ledgers is not None:
            ledgers.append(dict(comm.ledger.bytes))
    return results


def _losses(results):
    return [r.loss for r in results]


def _state(optimizer):
    """{name: (this rank's residual share, Q)} of every compressed parameter."""
    model, compressor = optimizer.model, optimizer.model.compression
    return {model.names[i]: (compressor.error_of(i).clone(), compressor.q_of(i).clone()) for i in compressor.matrices}


def _check_ledger(m, cfg, ledgers, results, model):
    """Every compressed step: the dp group's all-reduce bytes are the planner's (+ the 8-byte token
    count); the ratio is the plain reduction's bytes (the padded buffer in fp32) over them."""
    group = "dp" if m.cp_size == 1 else "dp_cp"
    planned = communication_bytes(_model(), cfg, m.pp_rank)
    assert f"{group}/reduce_scatter" not in planned
    assert model.compression.state_bytes() == compression_state_bytes(_model(), cfg, m.pp_rank)  # planner's memory
    for ledger, result in zip(ledgers[1:], results[1:]):  # step 1 is the warm-up
        assert ledger[(group, "all_reduce")] == planned[f"{group}/all_reduce"] + 8
        assert (group, "reduce_scatter") not in ledger
        assert result.grad_reduce_bytes == planned[f"{group}/all_reduce"]
        assert result.grad_compression_ratio == 4 * model.layout.numel / planned[f"{group}/all_reduce"]


def _dp2_world(ckpt_dir):
    """dp 2, ZeRO 1, accumulation 2: full rank equals plain; rank 4 saves after step 2 and resumes exactly."""
    m = mesh_lib.init_mesh(dp=2)
    cfg = _cfg(dp=2, zero=1, **FULL_RANK)
    full = _losses(_train(*_build(m, cfg), m, cfg, range(1, 4)))
    cfg = _cfg(dp=2, zero=1, **RANK4)
    chunks, optimizer = _build(m, cfg)
    ledgers = []
    results = _train(chunks, optimizer, m, cfg, [1, 2], ledgers)
    Checkpointer(ckpt_dir, m, **QUIET).save(2, chunks, optimizer, consumed_samples=2 * GLOBAL, model_config=_model(),
                                            train_config=cfg.to_dict())
    saved = _state(optimizer)
    results += _train(chunks, optimizer, m, cfg, [3, 4], ledgers)
    _check_ledger(m, cfg, ledgers, results, optimizer.model)
    chunks, optimizer = _build(m, cfg)
    load_checkpoint(ckpt_dir, chunks, optimizer, m, **QUIET)
    assert optimizer.model.compression.steps_done == 2
    resumed = _losses(_train(chunks, optimizer, m, cfg, [3, 4]))
    return dict(full=full, rank4=_losses(results), resumed=resumed, saved=saved)


def _dp4_world(ckpt_dir, saved_shares):
    """dp 4, ZeRO 0, no accumulation: the same compressed run; and the dp 2 checkpoint resumed here."""
    m = mesh_lib.init_mesh(dp=4)
    cfg = _cfg(dp=4, **RANK4)
    fresh = _losses(_train(*_build(m, cfg), m, cfg, range(1, STEPS + 1)))
    chunks, optimizer = _build(m, cfg)
    load_checkpoint(ckpt_dir, chunks, optimizer, m, **QUIET)
    for name, (error, q) in _state(optimizer).items():  # replica 0 holds the sum of the stored shares
        expected = sum(share[name][0] for share in saved_shares) if m.dp_rank == 0 else torch.zeros_like(error)
        torch.testing.assert_close(error, expected, rtol=1e-6, atol=1e-9, msg=name)
        assert torch.equal(q, saved_shares[0][name][1]), name
    resumed = _losses(_train(chunks, optimizer, m, cfg, [3, 4]))
    return dict(fresh=fresh, resumed=resumed)


def _pp2_dp4_world():
    """pp 2, dp 4, ZeRO 1: the same compressed run; the tied embedding's copies stay identical."""
    m = mesh_lib.init_mesh(pp=2, dp=4)
    cfg = _cfg(pp=2, dp=4, zero=1, **RANK4)
    chunks, optimizer = _build(m, cfg)
    ledgers = []
    results = _train(chunks, optimizer, m, cfg, range(1, STEPS + 1), ledgers)
    _check_ledger(m, cfg, ledgers, results, optimizer.model)
    tied = chunks[0].word_embeddings.weight if m.pp_rank == 0 else chunks[0].output_weight
    other = comm.all_gather(tied.detach().unsqueeze(0), m.embedding_group)
    assert torch.equal(other[0], other[1]), "the two copies of the tied embedding differ"
    return _losses(results)


def _cp2_world():
    """cp 2, dp 2: the replicas are dp x cp (each cp rank's gradient covers its tokens): the same run as dp 4."""
    m = mesh_lib.init_mesh(cp=2, dp=2)
    cfg = _cfg(cp=2, dp=2, zero=1, **RANK4)
    chunks, optimizer = _build(m, cfg)
    ledgers = []
    results = _train(chunks, optimizer, m, cfg, range(1, STEPS + 1), ledgers)
    _check_ledger(m, cfg, ledgers, results, optimizer.model)
    return _losses(results)


def _tp2_world(ckpt_dir, saved_shares):
    """tp 2 + SP, dp 2, ZeRO 2: full rank equals plain; rank 4's bytes are the planner's; the tp 1
    checkpoint loads its replicas' shares sliced like the weights, Q only where the shape is unchanged."""
    m = mesh_lib.init_mesh(tp=2, dp=2)
    cfg = _cfg(tp=2, dp=2, zero=2, sequence_parallel=True, **FULL_RANK)
    full_losses = _losses(_train(*_build(m, cfg), m, cfg, range(1, 4)))
    cfg = _cfg(tp=2, dp=2, zero=2, sequence_parallel=True, **RANK4)
    chunks, optimizer = _build(m, cfg)
    ledgers = []
    results = _train(chunks, optimizer, m, cfg, range(1, 4), ledgers)
    _check_ledger(m, cfg, ledgers, results, optimizer.model)
    chunks, optimizer = _build(m, cfg)
    load_checkpoint(ckpt_dir, chunks, optimizer, m, **QUIET)
    model, compressor = optimizer.model, optimizer.model.compression
    for index, matrix in compressor.matrices.items():
        name, param = model.names[index], model.params[index]
        spec, (saved_error, saved_q) = P.shard_spec(param), saved_shares[m.dp_rank][name]
        full = saved_error[tuple(slice(0, n) for n in spec.full_shape)]  # the tp 1 share, padding rows dropped
        assert torch.equal(compressor.error_of(index).view(param.shape), spec.shard(full)), name
        fresh = first_q(matrix.m, matrix.r, cfg.training.seed)
        assert torch.equal(compressor.q_of(index), fresh if spec.is_tp_sharded else saved_q), name
    return full_losses


def _fp16_world():
    """The first step overflows (loss scale 2^30): skipped, with the compressor's state untouched."""
    m = mesh_lib.init_mesh(dp=2)
    cfg = _cfg(dp=2, zero=1, precision="fp16", initial_loss_scale=2.0 ** 30, hysteresis=1,
               loss_scale_backoff=2.0 ** -20, grad_compression="powersgd", powersgd_rank=2)
    chunks, optimizer = _build(m, cfg)
    results = _train(chunks, optimizer, m, cfg, [1])
    compressor = optimizer.model.compression
    untouched = not compressor.error.any() and all(
        torch.equal(compressor.q_of(i), first_q(x.m, x.r, cfg.training.seed)) for i, x in compressor.matrices.items())
    results += _train(chunks, optimizer, m, cfg, [2, 3])
    return dict(skipped=[r.skipped for r in results], untouched=untouched, moved=bool(compressor.error.any()),
                losses=_losses(results))


def _reference():
    m, cfg = single_process_mesh("cpu"), _cfg()
    return _losses(_train(*_build(m, cfg), m, cfg, range(1, 4)))


@pytest.mark.slow  # 3.2 s; tests/data_parallel's PowerSGD tests stay quick
def test_compressed_training_full_rank_layouts_and_resume(tmp_path):
    reference = _reference()
    dp2 = run_distributed(_dp2_world, 2, str(tmp_path / "ckpt"), timeout_s=180)
    torch.testing.assert_close(dp2[0]["full"], reference, rtol=1e-5, atol=0)
    assert dp2[0]["resumed"] == dp2[0]["rank4"][2:], "resume at the same layout must be bit-identical"
    rank4 = dp2[0]["rank4"]
    torch.testing.assert_close(rank4[:1], reference[:1], rtol=1e-5, atol=0)  # the warm-up step is plain
    assert abs(rank4[2] - reference[2]) > 1e-4 * reference[2]  # then compressed: another run
    dp4 = run_distributed(_dp4_world, 4, str(tmp_path / "ckpt"), [r["saved"] for r in dp2], timeout_s=180)
    torch.testing.assert_close(dp4[0]["fresh"], rank4, rtol=1e-5, atol=0)
    torch.testing.assert_close(dp4[0]["resumed"], rank4[2:], rtol=1e-5, atol=0)
    pp2 = run_distributed(_pp2_dp4_world, 8, timeout_s=180)
    torch.testing.assert_close(pp2[0], rank4, rtol=1e-5, atol=0)
    cp2 = run_distributed(_cp2_world, 4, timeout_s=180)
    torch.testing.assert_close(cp2[0], rank4, rtol=1e-5, atol=0)
    tp2 = run_distributed(_tp2_world, 4, str(tmp_path / "ckpt"), [r["saved"] for r in dp2], timeout_s=180)
    torch.testing.assert_close(tp2[0], reference, rtol=1e-5, atol=0)
    fp16 = run_distributed(_fp16_world, 2, timeout_s=180)[0]
    assert fp16["skipped"] == [True, False, False] and fp16["untouched"] and fp16["moved"]
    assert all(torch.isfinite(torch.tensor(fp16["losses"])))
