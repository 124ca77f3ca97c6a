"""GradBuffers at dp=2: summed gradients, reductions overlapped with the last backward only,
ZeRO-2 freeing, bf16 reduction, and a parameter delivered twice (sink + autograd, like a tied embedding)."""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.parameters import params as P
from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.data_parallel.grad_buffers import GradBuffers
from megalite.tensor_parallel.layers import linear
from megalite.testing import run_distributed

DP, WIDTH, ROWS = 2, 8, 3


class Chain(nn.Module):
    """x [n, 8] -> scalar. `shared` is used through megalite's sink-routed linear and through F.linear."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.3)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x, extra_sink_use=False):
        x = linear(x, self.shared)  # weight grad -> the engine's grad sink when attached
        if extra_sink_use:
            x = linear(x, self.shared)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.linear(x, self.shared).square().sum()  # autograd path -> post-accumulate hook


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(DP, 2, ROWS, WIDTH, generator=g)  # [rank, microbatch, rows, width]


def _reference_grads():
    torch.manual_seed(0)
    model = Chain()
    sum(model(x) for x in _data().reshape(-1, ROWS, WIDTH)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _dp_calls():
    return sum(n for (g, op), n in comm.ledger.calls.items() if g == "dp")


def _world(m, zero_stage, reduce_dtype, check_misuse):
    torch.manual_seed(0)
    model = Chain()
    names = [n for n, _ in model.named_parameters()]
    engine = GradBuffers(list(model.parameters()), m.dp_group, bucket_size=64, zero_stage=zero_stage,
                               grad_reduce_dtype=reduce_dtype)
    x = _data()[m.dp_rank]
    engine.zero_grad()  # step 0 calibrates delivery counts (2 for `shared`)
    model(x[0]).backward()
    engine.finish_reduction()

    engine.zero_grad()
    comm.ledger.reset()
    with engine.no_sync():
        model(x[0]).backward()
    calls_after_accumulation = _dp_calls()
    seen = []
    x_last = x[1].clone().requires_grad_()
    x_last.register_hook(lambda grad: seen.append(_dp_calls()))  # fires near the very end of backward
    model(x_last).backward()
    engine.finish_reduction()
    out = dict(calls_after_accumulation=calls_after_accumulation, calls_before_backward_end=seen[0],
               calls_total=_dp_calls(), buckets=len(engine.layout.buckets), numel=engine.layout.numel,
               dp_bytes={op: n for (g, op), n in comm.ledger.bytes.items() if g == "dp"},
               grad_bytes=engine.grad_bytes(), shard_numel=engine.layout.shard_numel,
               main_grads_left=sum(P.main_grad(p) is not None for p in engine.params))
    model_names = list(reversed(names))  # engine.params is the reverse of model order
    if zero_stage == 0:
        out["grads"] = {model_names[i]: engine.main_grad(i).numpy().copy() for i in range(len(engine.params))}
    else:
        out["pieces"] = [(model_names[p.param], p.local_start, p.local_end,
                          engine.grad_shard[p.shard_start:p.shard_end].numpy().copy())
                         for p in engine.layout.owned_pieces(engine.shard_rank)]
    if check_misuse:  # a third delivery of `shared` after its bucket was launched must fail loudly
        engine.zero_grad()
        try:
            model(x[0], extra_sink_use=True).backward()
            out["misuse"] = "no error"
        except RuntimeError as exc:
            out["misuse"] = str(exc)
    return out


def _per_chunk_flags(m):
    """Two model chunks with separate backwards (like an interleaved pipeline): chunk A's buckets
    launch during A's last backward, before chunk B's last backward even starts."""
    torch.manual_seed(0)
    chunk_a = Chain()
    torch.manual_seed(0)
    chunk_b = Chain()  # the same weights: both chunks' grads equal the reference
    engine = GradBuffers(list(chunk_a.parameters()) + list(chunk_b.parameters()), m.dp_group, bucket_size=64)
    x = _data()[m.dp_rank]
    for step in range(2):  # step 0 calibrates
        engine.zero_grad()
        comm.ledger.reset()
        engine.set_last_microbatch(False)
        chunk_a(x[0]).backward()
        chunk_b(x[0]).backward()
        engine.set_last_microbatch(True, params=list(chunk_a.parameters()))
        chunk_a(x[1]).backward()
        calls_after_a = _dp_calls()
        engine.set_last_microbatch(True, params=list(chunk_b.parameters()))
        chunk_b(x[1]).backward()
        engine.finish_reduction()
    a_buckets = {engine.layout.slots[i].bucket for i, p in enumerate(engine.params)
                 if any(p is q for q in chunk_a.parameters())}
    b_buckets = {engine.layout.slots[i].bucket for i, p in enumerate(engine.params)
                 if any(p is q for q in chunk_b.parameters())}
    only_a = len(a_buckets - b_buckets)
    grads = {f"a.{n}": P.main_grad(p).numpy().copy() for n, p in chunk_a.named_parameters()}
    grads.update({f"b.{n}": P.main_grad(p).numpy().copy() for n, p in chunk_b.named_parameters()})
    return dict(calls_after_a=calls_after_a, only_a=only_a, grads=grads)


CONFIGS = [(0, torch.float32), (1, torch.float32), (2, torch.float32), (0, torch.bfloat16), (1, torch.bfloat16)]


def _all_configs():
    m = mesh_lib.init_mesh()
    out = {config: _world(m, *config, check_misuse=config == (0, torch.float32)) for config in CONFIGS}
    out["per_chunk"] = _per_chunk_flags(m)
    return out


def test_reduced_grads_are_the_sum_and_overlap_backward():
    ref = _reference_grads()
    per_rank = run_distributed(_all_configs, DP)
    for rank, results in enumerate(per_rank):
        for (zero_stage, reduce_dtype), out in ((c, results[c]) for c in CONFIGS):
            _check(rank, zero_stage, reduce_dtype, out, ref)
        chunked = results["per_chunk"]
        assert chunked["only_a"] >= 3
        assert chunked["calls_after_a"] >= chunked["only_a"] - 1, chunked["calls_after_a"]
        for name, grad in chunked["grads"].items():
            torch.testing.assert_close(torch.from_numpy(grad), ref[name[2:]], rtol=1e-5, atol=1e-6, msg=name)


def _check(rank, zero_stage, reduce_dtype, out, ref):
    tol = dict(rtol=1e-5, atol=1e-6) if reduce_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    what = f"rank {rank} zero {zero_stage} {reduce_dtype}"
    assert out["calls_after_accumulation"] == 0, "no dp communication during accumulation microbatches"
    assert out["buckets"] >= 4
    assert out["calls_before_backward_end"] >= out["buckets"] - 1, \
        f"{what}: only {out['calls_before_backward_end']} of {out['buckets']} buckets started before backward ended"
    assert out["calls_total"] == out["buckets"]
    elem = 4 if reduce_dtype == torch.float32 else 2
    op = "all_reduce" if zero_stage == 0 else "reduce_scatter"
    assert out["dp_bytes"] == {op: elem * out["numel"]}, what
    if zero_stage == 0:
        for name, grad in out["grads"].items():
            torch.testing.assert_close(torch.from_numpy(grad), ref[name], **tol, msg=f"{what} {name}")
    else:
        assert sum(hi - lo for _, lo, hi, _ in out["pieces"]) > 0
        for name, lo, hi, values in out["pieces"]:
            torch.testing.assert_close(torch.from_numpy(values), ref[name].reshape(-1)[lo:hi], **tol, msg=what)
    if zero_stage == 2:
        assert out["grad_bytes"] == 4 * out["shard_numel"], "ZeRO-2 keeps only the reduced shard"
        assert out["main_grads_left"] == 0
    if "misuse" in out:
        assert "after its bucket's dp reduction started" in out["misuse"], out["misuse"]
