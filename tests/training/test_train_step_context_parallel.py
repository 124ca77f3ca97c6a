"""Full training steps with context parallelism equal the same steps at cp = 1.

One forked world of 4 ranks runs every layout in turn, each on a mesh of its own: (tp 2, cp 2)
with sequence parallelism, (cp 2, pp 2) under 1F1B, interleaving, ZB-H1 and GPipe, (cp 2, dp 2)
with ZeRO 1 and 2, and cp 4; ring attention (p2p) and Ulysses (a2a); GPT-2 (learned positions)
and Llama (RoPE, 8 query heads over 4 kv heads). Every layout trains STEPS steps through
`megalite.training.step.train_step` on whole-sequence microbatches (the step hands each cp
rank its zigzag chunks), in float32, from the same seed and data as the single-process
reference: every step's loss and global grad norm, the evaluation loss and every parameter
after the last step must match it (~1e-5 relative). The last step's bytes per group in
`comm.ledger` must equal the planner's formulas (megalite.plan.communication).
"""
import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.parameters import params as P
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.plan import communication as C
from megalite.plan.params import stage_params
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, evaluate, train_step

STEPS, MICRO, GLOBAL, SEQ = 2, 2, 8, 16


def _model(name):
    if name == "tiny-llama":  # 2 kv heads per tp rank at tp 2: Ulysses can split them over cp 2
        return preset(name, num_layers=4, num_attention_heads=8, num_query_groups=4, seq_length=SEQ)
    return preset(name, num_layers=4, seq_length=SEQ)


def _batches(vocab, dp, dp_rank):
    """Step k's whole-sequence microbatches for this dp rank (the global batch split like GlobalBatchSampler)."""
    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100)  # the same tokens every step, so the loss must fall
        ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=gen)
        inputs, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[step % GLOBAL, : 3 + step] = -100  # uneven target counts across dp and cp ranks
        labels[(step + 3) % GLOBAL, -5:] = -100  # in the last chunk, held by cp rank 0
        per_rank = GLOBAL // dp
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        out.append([{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(MICRO), labels[mine].split(MICRO))])
    return out


def _cfg(tp=1, pp=1, dp=1, cp=1, **kw):
    # adam_eps above float32 noise: see tests/training/test_train_step.py
    return RunConfig.build(tp=tp, pp=pp, dp=dp, cp=cp, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3,
                           weight_decay=0.1, clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def _reference(name, precision="fp32"):
    m, cfg = single_process_mesh("cpu"), _cfg(precision=precision)
    chunks = build_model_chunks(_model(name), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    results = [train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3) for mbs in _batches(257, 1, 0)]
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    eval_loss = evaluate(chunks, _batches(257, 1, 0)[0], m, cfg)
    return [r.loss for r in results], [r.grad_norm for r in results], params, eval_loss


# Low precision: cp > 1 against cp = 1 in the same dtype, losses and grad norms to its rounding.
LOW_PRECISION_RTOL = {"bf16": 2e-2, "fp16": 5e-3}


@pytest.fixture(scope="module")
def references():
    keys = {(name, settings.get("precision", "fp32")) for _, runs in LAYOUTS for name, settings in runs}
    return {key: _reference(*key) for key in sorted(keys)}


def _ledger_matches_the_planner(m, cfg, model, ledger):
    """The last step's bytes per group equal the planner's; dp x cp up to the buckets' padding."""
    expected = C.communication_bytes(model.chunks[0].config, cfg, m.pp_rank)
    exact = ("tp", "cp", "pp", "embedding")
    got = {f"{g}/{op}": n for (g, op), n in ledger.items() if g in exact}
    assert got == {k: v for k, v in expected.items() if k.split("/")[0] in exact}, (got, expected)
    params = sum(p.numel() for p in model.params)
    assert params == stage_params(model.chunks[0].config, cfg, m.pp_rank)
    padding, group = model.layout.numel - params, C.dp_group_name(cfg)
    for key, n in expected.items():
        if key.startswith(group + "/"):
            tokens = 8 if key.endswith("all_reduce") else 0  # the step's token count (float64) shares the group
            element = n // params  # bytes per element of this op (grad_reduce_dtype or the parameters' dtype)
            assert ledger[tuple(key.split("/"))] - tokens == n + element * padding, (key, ledger, n, padding)
    return sorted(k for k in got if k.startswith("cp/"))


def _train_and_compare(m, name, cfg, reference, what):
    ref_losses, ref_norms, ref_params, ref_eval = reference
    rtol = LOW_PRECISION_RTOL.get(cfg.precision.precision, 1e-5)
    chunks = build_model_chunks(_model(name), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    batches = _batches(257, m.dp_size, m.dp_rank)
    results = []
    for step, mbs in enumerate(batches):
        if step == STEPS - 1:
            comm.ledger.reset()
        results.append(train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3))
    cp_keys = _ledger_matches_the_planner(m, cfg, optimizer.model, dict(comm.ledger.bytes))
    torch.testing.assert_close([r.loss for r in results], ref_losses, rtol=rtol, atol=0, msg=what)
    torch.testing.assert_close([float(r.grad_norm) for r in results], [float(n) for n in ref_norms], rtol=rtol,
                               atol=0, msg=what)
    torch.testing.assert_close(evaluate(chunks, batches[0], m, cfg), ref_eval, rtol=rtol, atol=0, msg=what)
    if rtol > 1e-5:
        return cp_keys  # after Adam, low-precision parameters differ by whole rounding steps
    for chunk in chunks:
        for logical, p in chunk.logical_parameters():
            assert_tensor_close(p, P.shard_spec(p).shard(ref_params[logical]), rtol=1e-5, what=f"{what} {logical}")
    return cp_keys


LAYOUTS = [  # (tp, pp, dp, cp), [(model, settings), ...]; one mesh per layout, every run on it
    ((2, 1, 1, 2), [("tiny", dict(sequence_parallel=True)),
                    ("tiny-llama", dict(sequence_parallel=True, cp_comm_type="a2a", fused_linear_cross_entropy=True))]),
    ((1, 2, 1, 2), [("tiny", dict()),
                    ("tiny-llama", dict(virtual_stages=2, cp_comm_type="a2a")),
                    ("tiny-llama", dict(pipeline_schedule="zb-h1", recompute="selective")),
                    ("tiny", dict(pipeline_schedule="gpipe", cp_comm_type="a2a", recompute="full"))]),
    ((1, 1, 2, 2), [("tiny", dict(zero=1)),
                    ("tiny-llama", dict(zero=1, cp_comm_type="a2a")),
                    ("tiny-llama", dict(zero=2, overlap_param_gather=True)),
                    ("tiny-llama", dict(zero=1, precision="bf16")),
                    ("tiny", dict(precision="fp16", cp_comm_type="a2a"))]),
    ((1, 1, 1, 4), [("tiny-llama", dict(zero=1, recompute="selective")),
                    ("tiny", dict(cp_comm_type="a2a"))]),
]


def _world(references):
    checked = []
    for (tp, pp, dp, cp), runs in LAYOUTS:
        m = mesh.init_mesh(tp=tp, pp=pp, dp=dp, cp=cp, replace=True)
        for name, settings in runs:
            cfg = _cfg(tp, pp, dp, cp, **settings)
            what = f"{name} tp={tp} pp={pp} dp={dp} cp={cp} {settings}"
            reference = references[(name, cfg.precision.precision.value)]
            checked.append(((tp, pp, dp, cp), name, cfg.parallel.cp_comm_type.value,
                            _train_and_compare(m, name, cfg, reference, what)))
    return checked


@pytest.mark.slow
def test_context_parallel_training_steps_match_cp1(references):
    ref_losses = references[("tiny", "fp32")][0]
    assert ref_losses[-1] < ref_losses[0]
    for checked in run_distributed(_world, 4, references, timeout_s=300):
        assert len(checked) == sum(len(runs) for _, runs in LAYOUTS)
        for layout, name, comm_type, cp_keys in checked:  # the cp group carried the attention's traffic
            assert cp_keys == (["cp/recv", "cp/send"] if comm_type == "p2p" else ["cp/all_to_all"]), layout
