"""Data-parallel step benchmark: megalite's DP engine + ZeRO optimizer vs torch DDP + ZeroRedundancyOptimizer
and vs torch's FSDP2 (`fully_shard` per transformer block, then the root) for ZeRO-3.

Every system trains the same megalite GPT (tp=pp=1) on the same data on `--dp` forked gloo
ranks (CPU), with gradient accumulation over `--microbatches`, in `--precision` (bf16: megalite
trains in bf16 with fp32 master and gradients; FSDP2 gets the same policy,
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)). Printed per system:

- step time of the slowest rank (ms): the best and the median of the timed steps, the ratio
  of the best to the peer's (FSDP2, else torch's ZeRO; other processes on a shared machine only
  ever add time, so the best is the steadiest figure), and the median over rounds of the ratio
  of the two systems' steps in the same round (paired: both saw the same load);
- optimizer state bytes per rank (fp32 master/moments for megalite; AdamW state for torch);
- exposed communication per step: best step time minus the best of the same step with no
  communication at all ("local": forward/backward + a plain full AdamW step on each rank, no
  dp; ZeRO also saves (dp-1)/dp of that AdamW work, so this can go below zero). For megalite
  also the directly measured wait (median of finish_reduction + parameter all-gather);
- model-state bytes per rank at rest (every parameter, gradient and optimizer-state storage the
  system holds after a step, summed) and the peak of gathered (unsharded) parameter bytes,
  sampled for every system at the same points (each block's and the root's forward and backward
  boundaries; ZeRO 0-2 hold every parameter, so it is all of them).

Timings are host wall-clock on shared CPUs: compare systems within one run only.

    python tools/bench_dp.py --dp 2 --hidden 256 --layers 4 --seq 128 --micro-batch 4 --microbatches 2
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import os
import platform
import statistics
import sys
import time

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.distributed import comm  # noqa: E402
from megalite.distributed import mesh as mesh_lib  # noqa: E402
from megalite.model import GPTModel, preset  # noqa: E402
from megalite.data_parallel import DataParallel  # noqa: E402
from megalite.optim import DistributedOptimizer  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402

LR = 1e-4


def _batches(args, cfg, dp_rank, step):
    gen = torch.Generator().manual_seed(1000 * step + dp_rank)
    shape = (args.microbatches, args.micro_batch, args.seq)
    return torch.randint(0, cfg.vocab_size, shape, generator=gen), torch.randint(0, cfg.vocab_size, shape, generator=gen)


def _adam_state_bytes(opt) -> int:
    """Bytes of the optimizer's state tensors held by this rank (a DTensor: its local shard)."""
    tensors = [t.to_local() if hasattr(t, "to_local") else t for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _local_bytes(tensors) -> int:
    """Bytes of distinct storages (a DTensor counts its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


class GatheredPeak:
    """Peak bytes of full (unsharded) parameters, sampled at every block's and the model's forward and
    backward boundaries. A parameter counts when it is not a sharded DTensor and its storage has memory."""

    def __init__(self, model):
        self.model, self.peak = model, 0
        for module in [model, *model.layers]:
            module.register_forward_pre_hook(lambda *_: self.sample())
            module.register_forward_hook(lambda *_: self.sample())
            if module is not model:  # (the root's inputs are token ids: no gradient to hook)
                module.register_full_backward_pre_hook(lambda *_: self.sample())

    def sample(self) -> None:
        with torch._C.DisableTorchFunction():  # an observer: megalite's read guard must not gather for it
            full = [p for p in self.model.parameters() if not hasattr(p, "to_local")]
            self.peak = max(self.peak, _local_bytes(full))


def _global_tokens(args, dp):
    return args.microbatches * args.micro_batch * args.seq * dp


def _time_round_robin(m, args, systems):
    """Step every system in turn, round after round, so load from other processes hits all alike."""
    times = {name: [] for name in systems}
    for step in range(args.warmup + args.steps):
        for name, (run_step, _) in systems.items():
            comm.barrier(m.dp_group)
            start = time.perf_counter()
            run_step(step)
            elapsed = torch.tensor([time.perf_counter() - start])
            comm.all_reduce(elapsed, m.dp_group, op="max")  # the slowest rank sets the pace
            if step >= args.warmup:
                times[name].append(float(elapsed))
    return {name: {"step_s": statistics.median(times[name]), "best_s": min(times[name]), "times": times[name],
                   **info()} for name, (_, info) in systems.items()}


def _local(m, args, cfg):
    """No communication at all: the floor every data-parallel system is measured against."""
    model = GPTModel(cfg, m, seed=1, dtype=_dtype(args))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = _global_tokens(args, m.dp_size)

    def run_step(step):
        ids, labels = _batches(args, cfg, m.dp_rank, step)
        opt.zero_grad(set_to_none=True)
        for i in range(args.microbatches):
            (model(ids[i], labels[i], reduction="sum") / tokens).backward()
        opt.step()

    def info():  # AdamW creates its state lazily: count it after the steps
        return {"state_bytes": _adam_state_bytes(opt), "model_state_bytes": _torch_model_states(model, opt),
                "gathered_peak": _local_bytes(model.parameters())}

    return run_step, info


def _dtype(args):
    return torch.bfloat16 if args.precision == "bf16" else torch.float32


def _torch_model_states(model, opt) -> int:
    return _local_bytes([*model.parameters(), *(p.grad for p in model.parameters())]) + _adam_state_bytes(opt)


def _torch_ddp(m, args, cfg, zero: bool):
    model = GPTModel(cfg, m, seed=1, dtype=_dtype(args))
    ddp = DistributedDataParallel(model, process_group=m.dp_group, bucket_cap_mb=args.bucket_size * 4 / 2 ** 20)
    if zero:
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, process_group=m.dp_group,
                                      lr=LR)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    tokens = _global_tokens(args, m.dp_size)

    def run_step(step):
        ids, labels = _batches(args, cfg, m.dp_rank, step)
        opt.zero_grad(set_to_none=True)
        for i in range(args.microbatches):
            if i < args.microbatches - 1:
                with ddp.no_sync():
                    (ddp(ids[i], labels[i], reduction="sum") / tokens).backward()
            else:
                (ddp(ids[i], labels[i], reduction="sum") / tokens).backward()
        opt.step()

    def info():
        state = _adam_state_bytes(opt.optim if zero else opt)  # ZeRO: this rank's local optimizer
        states = _local_bytes([*model.parameters(), *(p.grad for p in model.parameters())]) + state
        return {"state_bytes": state, "model_state_bytes": states, "gathered_peak": _local_bytes(model.parameters())}

    return run_step, info


def _fsdp2(m, args, cfg):
    """torch FSDP2: fully_shard on every transformer block, then on the root (embedding, final norm,
    tied head), with megalite's ZeRO-3 defaults: reshard after forward (FSDP2 keeps its root
    gathered from forward to backward, its own heuristic), fp32 reduction, every microbatch."""
    model = GPTModel(cfg, m, seed=1)  # fp32 shards; the policy casts for compute, as megalite's gathers do
    mesh = DeviceMesh.from_group(m.dp_group, "cpu")
    policy = MixedPrecisionPolicy(param_dtype=_dtype(args), reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    peak = GatheredPeak(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = _global_tokens(args, m.dp_size)

    def run_step(step):  # reduce-scatters every microbatch, as megalite's ZeRO-3 does (same gradient memory)
        ids, labels = _batches(args, cfg, m.dp_rank, step)
        opt.zero_grad(set_to_none=True)
        for i in range(args.microbatches):
            (model(ids[i], labels[i], reduction="sum") / tokens).backward()
        opt.step()

    def info():
        return {"state_bytes": _adam_state_bytes(opt), "model_state_bytes": _torch_model_states(model, opt),
                "gathered_peak": peak.peak}

    return run_step, info


def _megalite(m, args, cfg, zero_stage: int):
    gpt = GPTModel(cfg, m, seed=1, dtype=_dtype(args))
    model = DataParallel(gpt, m, zero_stage=zero_stage, bucket_size=args.bucket_size, dp_reduction="sum")
    peak = GatheredPeak(gpt)
    opt = DistributedOptimizer(model)
    tokens = _global_tokens(args, m.dp_size)
    exposed = []

    def run_step(step):
        ids, labels = _batches(args, cfg, m.dp_rank, step)
        opt.zero_grad()
        for i in range(args.microbatches):
            model.set_last_microbatch(i == args.microbatches - 1)
            (model(ids[i], labels[i], reduction="sum") / tokens).backward()
        opt.step(lr=LR)
        exposed.append(sum(model.exposed_comm_seconds().values()))

    def info():
        report = opt.memory_report()
        return {"state_bytes": report["optimizer_state_bytes"], "gathered_peak": peak.peak,
                "model_state_bytes": report["param_bytes"] + report["grad_bytes"] + report["optimizer_state_bytes"],
                "measured_exposed_s": statistics.median(exposed[args.warmup:]), "buckets": len(model.layout.buckets)}

    return run_step, info


def _builders(args) -> dict:
    """System name -> builder(m, args, cfg) returning (run_step, info)."""
    builders = {"local (no dp comm)": _local}
    if "ddp" in args.torch:
        builders["torch DDP + AdamW"] = lambda m, a, c: _torch_ddp(m, a, c, zero=False)
        builders["torch DDP + ZeroRedundancyOptimizer"] = lambda m, a, c: _torch_ddp(m, a, c, zero=True)
    if "fsdp2" in args.torch:
        builders["torch FSDP2 (fully_shard per block)"] = _fsdp2
    for zero_stage in args.zero:
        builders[f"megalite zero {zero_stage}"] = lambda m, a, c, z=zero_stage: _megalite(m, a, c, z)
    return builders


def _model_config(args):
    return preset("tiny", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                  seq_length=args.seq)


def _bench_rank(args):
    m = mesh_lib.init_mesh(tp=1, pp=1)
    torch.set_num_threads(args.threads)
    cfg = _model_config(args)
    systems = {name: build(m, args, cfg) for name, build in _builders(args).items()}
    results = _time_round_robin(m, args, systems)
    params = sum(p.numel() for p in GPTModel(cfg, m, seed=1).parameters())
    return {"results": results, "params": params}


def _step_peak_bytes(run_step, step) -> int:
    """Most bytes allocated through torch's CPU allocator above the level at the step's start, during
    one step (the profiler's memory events in time order: gathered parameters, full gradients,
    communication buffers, activations; storage resizes included)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_step(step)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak


def _memory_rank(args, name):
    """--memory: one system alone in a fresh world: its model states at rest (every parameter, gradient
    and optimizer-state storage, summed) and the peak of one step above them (profiled)."""
    m = mesh_lib.init_mesh(tp=1, pp=1)
    torch.set_num_threads(args.threads)
    run_step, info = _builders(args)[name](m, args, _model_config(args))
    for step in range(args.warmup + 1):  # optimizer state exists after the first step
        run_step(step)
    peak = _step_peak_bytes(run_step, args.warmup + 1)
    return info()["model_state_bytes"], peak


@reports_usage_errors
def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--bucket-size", type=int, default=500_000, help="elements per bucket (both systems)")
    parser.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--torch", nargs="*", default=["ddp", "fsdp2"], choices=["ddp", "fsdp2"],
                        help="torch systems to compare with")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--memory", action="store_true", help="instead of timing: model states at rest and one "
                                                               "step's profiled peak, each system alone")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    args = parser.parse_args()

    if args.memory:
        print(f"# bench_dp --memory: per rank (max over ranks), each system alone; dp={args.dp} hidden={args.hidden} "
              f"layers={args.layers} seq={args.seq} micro_batch={args.micro_batch} microbatches={args.microbatches} "
              f"{args.precision}")
        print(f"{'system':<36} {'states at rest MiB':>19} {'step peak above MiB':>20} {'peak MiB':>9}")
        for name in _builders(args):
            per_rank = run_distributed(_memory_rank, args.dp, args, name, timeout_s=3600)
            rest, above = max(r[0] for r in per_rank), max(r[1] for r in per_rank)
            print(f"{name:<36} {rest / 2 ** 20:>19.2f} {above / 2 ** 20:>20.2f} {(rest + above) / 2 ** 20:>9.2f}")
        return
    out = run_distributed(_bench_rank, args.dp, args, timeout_s=3600)[0]
    results, params = out["results"], out["params"]
    local = results["local (no dp comm)"]["best_s"]
    peer_name = next((n for n in ("torch FSDP2 (fully_shard per block)", "torch DDP + ZeroRedundancyOptimizer")
                      if n in results), "local (no dp comm)")
    peer = results[peer_name]
    print(f"# bench_dp: dp={args.dp} params={params / 1e6:.2f}M hidden={args.hidden} layers={args.layers} "
          f"seq={args.seq} micro_batch={args.micro_batch} microbatches={args.microbatches} {args.precision} "
          f"bucket={args.bucket_size} elements, {args.steps} timed steps; torch {torch.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} cpus, gloo, {args.threads} thread(s)/rank; ratios vs {peer_name}")
    print(f"{'system':<36} {'best ms':>8} {'median ms':>10} {'best/peer':>10} {'paired/peer':>12} {'opt state MB':>13} "
          f"{'states MB':>10} {'gathered MB':>12} {'states+gathered /peer':>22} {'exposed comm ms':>16} "
          f"{'measured wait ms':>17}")
    for name, r in results.items():
        exposed = 0.0 if name.startswith("local") else 1e3 * (r["best_s"] - local)
        measured = f"{1e3 * r['measured_exposed_s']:.1f}" if "measured_exposed_s" in r else "-"
        total = r["model_state_bytes"] + r["gathered_peak"]
        paired = statistics.median(a / b for a, b in zip(r["times"], peer["times"]))  # same round: same load
        print(f"{name:<36} {1e3 * r['best_s']:>8.1f} {1e3 * r['step_s']:>10.1f} {r['best_s'] / peer['best_s']:>10.2f} "
              f"{paired:>12.2f} "
              f"{r['state_bytes'] / 2 ** 20:>13.2f} {r['model_state_bytes'] / 2 ** 20:>10.2f} "
              f"{r['gathered_peak'] / 2 ** 20:>12.2f} "
              f"{total / max(1, peer['model_state_bytes'] + peer['gathered_peak']):>22.2f} {exposed:>16.1f} "
              f"{measured:>17}")


if __name__ == "__main__":
    main()
