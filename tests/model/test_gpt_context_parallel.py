"""GPT with context parallelism vs the same model at cp = 1, both flavours and both comm types.

The reference runs in the parent process on the whole batch. Each cp rank is handed its zigzag
chunks of the ids and labels; the loss sums of the cp ranks add up to the reference's, and
every gradient summed over cp (parameters are replicated across cp; under sequence
parallelism also over tp for the partial ones) equals the reference's shard. GPT-2 checks the
learned position table at global positions, Llama RoPE at global positions and grouped-query
attention (8 query heads over 4 kv heads). With dropout on, the masks are drawn over the
logical (whole-sequence) tensors, so each cp rank drops exactly the reference's elements of its
two zigzag chunks: hidden dropout under both comm types, attention dropout under Ulysses.
"""
import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.parameters import params as P
from megalite.context_parallel import split_sequence
from megalite.model import GPTModel, preset
from megalite.testing import assert_tensor_close, run_distributed

B, S = 2, 16
FLAVOURS = ("tiny", "tiny-llama")
DROPOUT = {"tiny+dropout": dict(hidden_dropout=0.2, attention_dropout=0.2),  # Ulysses: both dropouts
           "tiny-llama+dropout": dict(hidden_dropout=0.2)}                   # ring: hidden dropout only


def _config(name):
    preset_name, dropout = name.split("+")[0], DROPOUT.get(name, {})
    if preset_name == "tiny-llama":
        return preset(preset_name, num_layers=2, num_attention_heads=8, num_query_groups=4, seq_length=32, **dropout)
    return preset(preset_name, num_layers=2, seq_length=32, **dropout)


def _batch(vocab):
    gen = torch.Generator().manual_seed(42)
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    labels = torch.randint(0, vocab, (B, S), generator=gen)
    labels[0, :3] = -100
    labels[1, -5:] = -100  # in the last chunk: ignored tokens on other ranks too
    return ids, labels


def _reference(name):
    model = GPTModel(_config(name), seed=7)
    loss = model(*_batch(model.config.vocab_size), reduction="sum")
    loss.backward()
    return loss.item(), {n: P.shard_spec(p).assemble([p.grad]) for n, p in model.logical_parameters()}


@pytest.fixture(scope="module")
def references():
    return {name: _reference(name) for name in FLAVOURS + tuple(DROPOUT)}


def _check_model(m, name, comm_type, reference, sequence_parallel, recompute="none"):
    ref_loss, ref_grads = reference
    model = GPTModel(_config(name), m, seed=7, sequence_parallel=sequence_parallel, cp_comm_type=comm_type,
                     recompute=recompute)
    ids, labels = (split_sequence(t, m.cp_rank, m.cp_size) for t in _batch(model.config.vocab_size))
    loss = model(ids, labels, reduction="sum")
    loss.backward()
    total = comm.all_reduce(loss.detach().clone(), m.cp_group).item()  # the train step sums over dp x cp
    torch.testing.assert_close(total, ref_loss, rtol=1e-5, atol=0)
    for logical, p in model.logical_parameters():
        grad = p.grad.clone()
        if P.is_sequence_parallel_grad(p):
            grad = comm.all_reduce(grad, m.tp_group)
        grad = comm.all_reduce(grad, m.cp_group)  # replicated over cp: summed like over dp
        assert_tensor_close(grad, P.shard_spec(p).shard(ref_grads[logical]), rtol=1e-5,
                            what=f"{name} {comm_type} {recompute} {logical}")
    with pytest.raises(ValueError, match="reduction='mean' under context parallelism"):
        model(ids, labels)
    return name, sum(1 for _ in model.logical_parameters())


def _world(tp, cp, sequence_parallel, references):
    m = mesh.init_mesh(tp=tp, cp=cp)
    checked = [_check_model(m, name, comm_type, references[name], sequence_parallel)
               for name in FLAVOURS for comm_type in ("p2p", "a2a")]
    if cp == 2:  # the same dropout masks as the whole sequence's (zigzag rows, Ulysses heads)
        checked.append(_check_model(m, "tiny+dropout", "a2a", references["tiny+dropout"], sequence_parallel))
        checked.append(_check_model(m, "tiny-llama+dropout", "p2p", references["tiny-llama+dropout"],
                                    sequence_parallel))
    if tp == 1 and cp == 2:  # recompute re-runs the ring in backward
        checked.append(_check_model(m, "tiny-llama", "p2p", references["tiny-llama"], False, "selective"))
        checked.append(_check_model(m, "tiny", "a2a", references["tiny"], False, "full"))
    refusal = None
    if tp == 2:  # tiny-llama's preset: 2 kv heads, 1 per tp rank, cannot be split over cp = 2
        try:
            GPTModel(preset("tiny-llama", num_layers=1), m, cp_comm_type="a2a")
        except ValueError as exc:
            refusal = str(exc)
    return checked, refusal


@pytest.mark.parametrize("tp,cp,sequence_parallel", [(1, 2, False), (2, 2, True), (1, 4, False)])
def test_context_parallel_gpt_matches_cp1(tp, cp, sequence_parallel, references):
    results = run_distributed(_world, tp * cp, tp, cp, sequence_parallel, references)
    for checked, refusal in results:
        assert len(checked) == {(1, 2): 8, (2, 2): 6, (1, 4): 4}[(tp, cp)]
        assert all(count == len(references[name][1]) for name, count in checked), "every gradient compared"
        if tp == 2:
            assert refusal is not None and "num_query_groups/tp = 2/2 = 1 is not divisible by cp=2" in refusal
