"""GPT at tp = 2, 4 (with and without sequence parallelism, and with the fused output layer and
cross entropy) vs the same model at tp = 1.

The reference runs in the parent process (no mesh); ranks compare their loss and every
gradient shard with the reference's full gradients sliced by each parameter's ShardSpec.
"""
import pytest
import torch

from megalite.parameters import params as P
from megalite.distributed import comm, mesh
from megalite.model import GPTModel, preset
from megalite.testing import run_distributed

B, S = 2, 16


def _batch(vocab):
    gen = torch.Generator().manual_seed(42)
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    labels = torch.randint(0, vocab, (B, S), generator=gen)
    labels[0, :3] = -100
    return ids, labels


def _config(name):
    # hidden_dropout stays 0: masks on different layouts differ by design.
    if name == "tiny-llama":  # 8 query heads in 4 groups: grouped-query attention that splits 4 ways
        return preset(name, num_layers=2, num_attention_heads=8, num_query_groups=4)
    return preset(name, num_layers=2)


def _reference(name):
    cfg = _config(name)
    model = GPTModel(cfg, seed=7)
    ids, labels = _batch(cfg.vocab_size)
    loss = model(ids, labels)
    loss.backward()
    grads = {n: P.shard_spec(p).assemble([p.grad]) for n, p in model.logical_parameters()}  # unpadded
    return loss.item(), grads


def _parallel(name, tp, sequence_parallel, ref_loss, ref_grads, fused=False):
    m = mesh.init_mesh(tp=tp)
    cfg = _config(name)
    model = GPTModel(cfg, m, seed=7, sequence_parallel=sequence_parallel, fused_linear_cross_entropy=fused)
    ids, labels = _batch(cfg.vocab_size)
    loss = model(ids, labels)
    loss.backward()
    torch.testing.assert_close(loss.item(), ref_loss, rtol=1e-5, atol=0)
    checked = 0
    for name_, p in model.logical_parameters():
        grad = p.grad
        if P.is_sequence_parallel_grad(p):
            grad = comm.all_reduce(grad.clone(), m.tp_group)  # partial per sequence shard
        expected = P.shard_spec(p).shard(ref_grads[name_])
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6, msg=lambda s: f"{name_}: {s}")
        checked += 1
    return checked


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_tensor_parallel_matches_tp1(name):
    ref_loss, ref_grads = _reference(name)
    # the last two: the output layer and cross entropy fused (no logits kept), vs the unfused tp=1
    for tp, sp, fused in ((2, False, False), (2, True, False), (4, False, False), (4, True, False),
                          (2, True, True), (4, False, True)):
        checked = run_distributed(_parallel, tp, name, tp, sp, ref_loss, ref_grads, fused)
        assert all(c == len(ref_grads) for c in checked), (tp, sp, fused, checked)


def _count_bytes(name, tp, sequence_parallel):
    m = mesh.init_mesh(tp=tp)
    cfg = _config(name)
    model = GPTModel(cfg, m, sequence_parallel=sequence_parallel)
    ids, labels = _batch(cfg.vocab_size)
    comm.ledger.reset()
    model(ids, labels, reduction="sum").backward()
    return dict(comm.ledger.bytes), dict(comm.ledger.calls)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_bytes_match_megatron_count(sequence_parallel):
    name, tp = "tiny", 2
    cfg = _config(name)
    bytes_, calls = run_distributed(_count_bytes, tp, name, tp, sequence_parallel)[0]
    L, act = cfg.num_layers, B * S * cfg.hidden_size * 4  # one [s, b, h] fp32 activation, in bytes
    ce = B * S * (2 * tp + 1) * 4  # cross entropy: one all-reduce of per-rank max/sum-exp slots + target logit
    if not sequence_parallel:
        # Per layer 4 all-reduces of b*s*h (2 forward after the row-parallel layers, 2 backward
        # before the column-parallel ones), plus embedding (forward) and head input (backward).
        assert calls[("tp", "all_reduce")] == 4 * L + 2 + 1
        assert bytes_[("tp", "all_reduce")] == 4 * L * act + 2 * act + ce
        assert ("tp", "all_gather") not in bytes_ and ("tp", "reduce_scatter") not in bytes_
    else:
        # Each all-reduce becomes a reduce-scatter + all-gather pair of the same full size; and the
        # column-parallel layers (QKV, MLP-in, the head) keep only the sequence shard for backward,
        # so each re-gathers its input there: 2 more all-gathers per layer, 1 for the head.
        assert calls[("tp", "reduce_scatter")] == 4 * L + 2
        assert calls[("tp", "all_gather")] == 4 * L + 2 + 2 * L + 1
        assert bytes_[("tp", "reduce_scatter")] == (4 * L + 2) * act
        assert bytes_[("tp", "all_gather")] == (6 * L + 3) * act
        assert calls[("tp", "all_reduce")] == 1 and bytes_[("tp", "all_reduce")] == ce
