"""Global grad norm / clipping over a (tp=2, pp=2, dp=2) mesh vs torch.nn.utils.clip_grad_norm_ at (1,1,1)."""
import math

import torch

from megalite.parameters import params as P
from megalite.distributed import mesh as mesh_lib
from megalite.optim.clip import (SQUARE_CHUNK, allreduce_sequence_parallel_grads, clip_grad_norm, global_grad_norm,
                                 square_sum)
from megalite.parameters.sharding import ShardSpec
from megalite.testing import run_distributed

H, V, F = 6, 8, 8  # hidden, vocab, ffn


def _full_model():
    """name -> (full param, full grad, stage, shard dim or None, attributes). Deterministic."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    entries = {"embedding": ((V, H), 0, 0, {"tied_across_stages": True})}
    for stage in (0, 1):
        entries.update({
            f"s{stage}.qkv.weight": ((3 * F, H), stage, 0, {}),     # column-parallel, fused [q; k; v]
            f"s{stage}.qkv.bias": ((3 * F,), stage, 0, {}),
            f"s{stage}.proj.weight": ((H, F), stage, 1, {}),        # row-parallel
            f"s{stage}.proj.bias": ((H,), stage, None, {"sequence_parallel_grad": True}),
            f"s{stage}.norm.weight": ((H,), stage, None, {"sequence_parallel_grad": True}),
        })
    full = {}
    for name, (shape, stage, dim, attrs) in entries.items():
        full[name] = (rnd(*shape), rnd(*shape) * (3.0 if "proj" in name else 1.0), stage, dim, attrs)
    return full


def _reference(max_norm):
    full = _full_model()
    params = []
    for value, grad, *_ in full.values():
        p = torch.nn.Parameter(value.clone())
        p.grad = grad.clone()
        params.append(p)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm), {name: p.grad for name, p in zip(full, params)}


def _local_params(m):
    """This rank's params with grads: tp shards of its stage, plus the tied embedding copy on the last stage."""
    params, names = [], []
    for name, (value, grad, stage, dim, attrs) in _full_model().items():
        on_last = name == "embedding" and m.is_last_stage
        if stage != m.pp_rank and not on_last:
            continue
        blocks = (F, F, F) if "qkv" in name else None
        spec = ShardSpec(tuple(value.shape), dim, m.tp_rank, m.tp_size, blocks=blocks) if dim is not None \
            else ShardSpec(tuple(value.shape))
        p = torch.nn.Parameter(spec.shard(value))
        P.declare(p, shard_spec=spec, **attrs)
        local_grad = spec.shard(grad)
        if attrs.get("sequence_parallel_grad"):
            # Partial per tp rank; the sum over tp is the full gradient.
            noise = torch.randn(local_grad.shape, generator=torch.Generator().manual_seed(7))
            local_grad = local_grad / m.tp_size + (noise if m.tp_rank == 0 else -noise)
        p.grad = local_grad
        params.append(p)
        names.append(name)
    return names, params


def _clip_in_world(max_norm):
    m = mesh_lib.init_mesh(tp=2, pp=2)
    names, params = _local_params(m)
    assert allreduce_sequence_parallel_grads(params, m.tp_group) == 2
    norm_before = float(global_grad_norm(params, m))
    returned = float(clip_grad_norm(params, max_norm, m))
    clipped = {name: (P.shard_spec(p), p.grad.numpy().copy()) for name, p in zip(names, params)}  # by value

    # An inf in a copy this rank does not count (tp_rank 1's replica of a norm weight) is still seen everywhere.
    names, params = _local_params(m)
    allreduce_sequence_parallel_grads(params, m.tp_group)
    if m.rank == 5:
        params[names.index(f"s{m.pp_rank}.norm.weight")].grad[0] = float("inf")
    poisoned = float(global_grad_norm(params, m))
    return norm_before, returned, clipped, poisoned


def test_global_norm_and_clipping_match_single_process_reference():
    max_norm = 1.0
    ref_norm, ref_grads = _reference(max_norm)
    results = run_distributed(_clip_in_world, 8, max_norm)
    for rank, (norm_before, returned, clipped, poisoned) in enumerate(results):
        assert math.isclose(norm_before, ref_norm, rel_tol=1e-6), (rank, norm_before, ref_norm)
        assert math.isclose(returned, ref_norm, rel_tol=1e-6)
        assert ref_norm > 5 * max_norm, "the test must actually clip"
        for name, (spec, grad) in clipped.items():
            torch.testing.assert_close(torch.from_numpy(grad), spec.shard(ref_grads[name]), rtol=1e-5, atol=1e-6,
                                       msg=f"rank {rank} {name}")
        # Rank 5 is (tp 1, dp 0, pp 1): its model replica (dp_rank 0 = ranks 0, 1, 4, 5) must see the inf.
        # The norm sums over tp x pp only (dp replicas hold identical reduced grads), so dp_rank 1 does not.
        dp_rank = mesh_lib.rank_to_coords(rank, 2, 2, 2)[1]
        assert math.isfinite(poisoned) == (dp_rank == 1), f"rank {rank}: {poisoned}"


def test_single_process_equals_torch():
    full = _full_model()
    ours, theirs = [], []
    for value, grad, *_ in full.values():
        for bucket in (ours, theirs):
            p = torch.nn.Parameter(value.clone())
            p.grad = grad.clone()
            bucket.append(p)
    m = mesh_lib.single_process_mesh("cpu")
    norm = clip_grad_norm(ours, 0.5, m)
    ref = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_square_sum_is_accurate_where_the_cpu_norm_kernel_is_not():
    """A gradient norm's square over 4M elements, against float64: CPU's vector_norm is 1.6e-4 off here
    (it accumulates float32 lane by lane), square_sum within float32 rounding, across chunk edges."""
    torch.manual_seed(0)
    grad = torch.randn(4 * SQUARE_CHUNK * 4 + 5)  # not a whole number of chunks
    exact = grad.double().square().sum().item()
    assert abs(square_sum(grad).item() / exact - 1) < 1e-6
    assert abs(square_sum(grad[: SQUARE_CHUNK - 3]).item() / grad[: SQUARE_CHUNK - 3].double().square().sum().item()
               - 1) < 1e-6
    assert square_sum(grad.to(torch.bfloat16)).dtype == torch.float32
    grad[SQUARE_CHUNK + 7] = float("inf")
    assert not torch.isfinite(square_sum(grad))  # an overflow anywhere still shows
