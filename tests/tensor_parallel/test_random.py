"""Philox dropout streams: reproducible keys, and masks by Megatron's tp rules that are also
layout-free (a rank's mask is its part of the tp=1 mask)."""
import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.kernels import attention
from megalite.tensor_parallel import TensorParallelRNG, dropout
from megalite.tensor_parallel.random import dropout_site
from megalite.testing import run_distributed


def test_keys_are_reproducible_per_site_and_draw_and_the_state_round_trips():
    rng = TensorParallelRNG(seed=5)
    first = [rng.replicated.draw(site) for site in (0, 1, 1, 4)]
    assert len(set(first)) == 4 and all(0 <= key < 2 ** 63 for key in first)  # per site, per draw
    assert TensorParallelRNG(5).replicated.draw(4) == first[3]  # a site's n-th key ignores other sites
    assert TensorParallelRNG(5).tensor_parallel.draw(0) != first[0]  # the streams differ
    assert TensorParallelRNG(6).replicated.draw(0) != first[0]  # and the seeds
    counters, state = rng.counters(), rng.get_state()  # what recompute and checkpoints save
    keys = [rng.replicated.draw(1), rng.tensor_parallel.draw(2)]
    rng.set_counters(counters)
    assert [rng.replicated.draw(1), rng.tensor_parallel.draw(2)] == keys
    rng.set_state(state)
    assert [rng.replicated.draw(1), rng.tensor_parallel.draw(2)] == keys
    with pytest.raises(ValueError, match="load_rng=False"):  # a torch.Generator state of an old checkpoint
        rng.set_state({"replicated": torch.Generator().get_state(), "tensor_parallel": state["tensor_parallel"]})
    assert dropout_site(None, 0) == 0 and {dropout_site(layer, w) for layer in range(3) for w in range(3)} \
        == set(range(1, 10))


def _masks_world():
    m = mesh.init_mesh(tp=2)
    s, b, h, heads = 8, 2, 16, 4
    x = torch.ones(s, b, h)
    # replicated activation [s, b, h]: every rank builds the same mask
    full = dropout(x, 0.5, TensorParallelRNG(9).replicated, site=3)
    replicas = comm.all_gather(full.unsqueeze(0), m.tp_group)
    assert torch.equal(replicas[0], replicas[1])
    # sequence-parallel shard [s/tp, b, h]: this rank's rows of that same mask; ranks differ
    shard = dropout(x[: s // 2], 0.5, TensorParallelRNG(9).replicated, site=3, offset=m.tp_rank * x[: s // 2].numel())
    assert torch.equal(shard, full.chunk(2)[m.tp_rank])
    shards = comm.all_gather(shard.unsqueeze(0), m.tp_group)
    assert not torch.equal(shards[0], shards[1])
    # attention probabilities [b, heads/tp, s, s] of this rank's heads (q = k = 0, v = identity
    # exposes the mask): the tp=1 mask's heads, different on each rank
    key = TensorParallelRNG(9).tensor_parallel.draw(dropout_site(0, 0))
    q, v = torch.zeros(b, heads // 2, s, 8), torch.eye(8).expand(b, heads // 2, s, 8).contiguous()
    part = attention(q, q, v, causal=False, dropout_p=0.5, dropout_seed=key, dropout_offset=m.tp_rank * 2 * b * s * s)
    q1, v1 = torch.zeros(b, heads, s, 8), torch.eye(8).expand(b, heads, s, 8).contiguous()
    whole = attention(q1, q1, v1, causal=False, dropout_p=0.5, dropout_seed=key)
    assert torch.equal(part, whole[:, 2 * m.tp_rank: 2 * m.tp_rank + 2])
    parts = comm.all_gather(part.unsqueeze(0), m.tp_group)
    assert not torch.equal(parts[0], parts[1])
    return True


def test_masks_agree_where_replicated_and_are_the_ranks_parts_where_split():
    assert all(run_distributed(_masks_world, 2))
