"""Pipeline benchmark: bubble fraction per schedule, and megalite vs torch.distributed.pipelining.

Part 1, bubble (equal stage cost; F = 1, B = 1, W = 1 time unit per microbatch and stage,
each divided by v for a virtual chunk; a full backward BWD costs B + W):
- "simulated": an exact discrete-event run of the schedule's instruction lists under the
  executor's semantics (a transfer batch completes when every peer has posted its side;
  transfers themselves free). Bubble = 1 - busy / makespan.
- "measured": the real executor (`run_pipeline`) on `--pp` forked gloo ranks whose chunks
  sleep `--op-ms` per unit (ZB-H1's W really deferred through the WeightGradStore). Bubble =
  1 - mean(busy per rank) / step time of the slowest rank (min over `--repeats` steps).
- "sim+lat": the same simulation with the measured latency of one transfer batch (half a
  ping-pong of the activation between two stages) added to every batch: what the formula
  leaves out on this machine.
- "formula": (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B,
  (p-1)/(3m+p-1) for ZB-H1 at F = B = W (its bubble is (p-1)(F+B-W); Qi et al. 2023), and
  for DualPipeV the published (p-1)(F&B + B - 3W) per rank (DeepSeek-V3 report, Table 2; the
  DualPipe repository's README; F, B, W per chunk, B a full backward) with F&B = F + B, which
  at F = B = W is (p-1)/(3m+p-1). That is the clock of DualPipe's F&B pairs run as one unit
  (the "F&B unit" line replays it: equal); megalite runs each pair's F then B, so an F whose
  input is ready does not wait for its B's gradient: the sim's (p-1)/(6m+p-1) is half of it.

Part 2, megalite's executor against torch.distributed.pipelining on the same GPT stages and data
(tools/pipeline_vs_torch.py says what it measures): step time, CPU time and heap peak per system, and the
losses, which must agree.
Timings are host wall-clock on shared CPUs: compare within one run only.

    python tools/bench_pipeline.py --pp 4 --microbatches 8 --virtual-stages 2 --op-ms 20
    python tools/bench_pipeline.py --skip-bubble --pp 4 --microbatches 8 --layers 8 --hidden 256 --seq 128
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, however this file is loaded
from pipeline_vs_torch import compare_world  # noqa: E402

from megalite.distributed import comm  # noqa: E402
from megalite.distributed import mesh as mesh_lib  # noqa: E402
from megalite.parameters import params  # noqa: E402
from megalite.pipeline import PipelineSpec, build_schedule, post_and_wait, run_pipeline  # noqa: E402
from megalite.pipeline.instructions import (BWD, BWD_INPUT, BWD_WEIGHT, FWD, SEND_KINDS,  # noqa: E402
                                            split_steps)
from megalite.pipeline.overlap import dualpipev_makespan  # noqa: E402
from megalite.pipeline.p2p import is_first_chunk, is_last_chunk, peer  # noqa: E402
from megalite.pipeline.schedules import chunk_placement  # noqa: E402
from megalite.parameters.weight_grad import deliver  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402

BUBBLE_CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", None), ("zb-h1", 1),  # None: --virtual-stages
                ("dualpipev", 2)]


def formula(name: str, p: int, m: int, v: int) -> float:
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if name in ("zb-h1", "dualpipev"):  # DualPipeV: (p-1)(F&B + B - 3W) per rank, F&B = F + B, F = B = W
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def dualpipev_unit_bubble(p: int, m: int) -> float:
    """DualPipeV's bubble with its F&B pairs run as one unit of F + B (pipeline/overlap.py), F = B = W."""
    cost = {FWD: 0.5, BWD: 1.0, BWD_INPUT: 0.5, BWD_WEIGHT: 0.5}  # per chunk: half a stage's unit
    return 1 - 3 * m / dualpipev_makespan(p, m, cost, pair_cost=cost[FWD] + cost[BWD])


# ---------------------------------------------------------------------------------------------
# Exact discrete-event simulation of a schedule
# ---------------------------------------------------------------------------------------------


def simulate_bubble(name: str, p: int, m: int, v: int, latency: float = 0.0) -> float:
    """1 - busy / makespan for unit costs F = B = W = 1/v under rendezvous batches.

    `latency` (in units of F) is added to every transfer batch's completion.
    """
    cost = {FWD: 1 / v, BWD: 2 / v, BWD_INPUT: 1 / v, BWD_WEIGHT: 1 / v}
    steps = [split_steps(ops) for ops in build_schedule(name, p, m, v)]
    placement = chunk_placement(name)
    position, clock = [0] * p, [0.0] * p
    posted: list[list | None] = [None] * p
    sent, received = {}, {}  # (sender, receiver) -> post times in order
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while position[s] < len(steps[s]):
                step = steps[s][position[s]]
                if not step[0].is_transfer:
                    clock[s] += cost[step[0].kind]
                else:
                    if posted[s] is None:
                        posted[s] = []
                        for op in step:
                            other = peer(op.kind, p, v, s, op.chunk, placement)[0]
                            is_send = op.kind in SEND_KINDS
                            pair = (s, other) if is_send else (other, s)
                            queue = (sent if is_send else received).setdefault(pair, [])
                            posted[s].append((pair, len(queue), is_send))
                            queue.append(clock[s])
                    times = []
                    for pair, k, is_send in posted[s]:
                        other = (received if is_send else sent).get(pair, [])
                        times.append(other[k] if len(other) > k else None)
                    if None in times:
                        break
                    clock[s] = max([clock[s]] + times) + latency
                    posted[s] = None
                position[s] += 1
                progress = True
    if any(position[s] < len(steps[s]) for s in range(p)):
        raise RuntimeError(f"{name} deadlocked in simulation; the verifier should have caught it")
    return 1 - 3 * m / max(clock)


# ---------------------------------------------------------------------------------------------
# Measured bubble: sleeping stages through the real executor
# ---------------------------------------------------------------------------------------------

_BUSY = [0.0]


def _sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    _BUSY[0] += time.perf_counter() - start


class _SleepFn(torch.autograd.Function):
    """y = x * w; forward sleeps F, backward sleeps B (+ W now, or W queued under ZB-H1)."""

    @staticmethod
    def forward(ctx, x, weight, unit):
        ctx.save_for_backward(x, weight)
        ctx.unit, ctx.weight = unit, weight
        _sleep(unit)
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        _sleep(ctx.unit)  # B: the input gradient
        grad_w = (grad * x).sum().reshape(1)
        deferred = params.deferred(ctx.weight)
        if deferred is None:
            _sleep(ctx.unit)  # W now
            return grad * weight, grad_w, None
        store, key = deferred
        param = ctx.weight
        store.put(key, lambda: (_sleep(ctx.unit), deliver(param, grad_w)))
        return grad * weight, None, None


class SleepChunk(torch.nn.Module):
    def __init__(self, unit_s: float, first: bool, last: bool, shape):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.unit_s, self.first, self.last, self.shape = unit_s, first, last, shape

    def forward(self, x, labels=None, reduction="mean"):
        if self.first:
            x = torch.ones(self.shape)  # ids are ignored: equal cost is the point
        y = _SleepFn.apply(x, self.weight, self.unit_s)
        return y.sum() if self.last else y


def _bubble_world(args, cases):
    mesh = mesh_lib.init_mesh(pp=args.pp)
    shape = (8, 2, 16)
    microbatches = [{"input_ids": torch.zeros(2, 8, dtype=torch.long),
                     "labels": torch.zeros(2, 8, dtype=torch.long)}] * args.microbatches
    # One transfer batch's latency: half a ping-pong of the activation between stages 0 and 1.
    buffer, rounds = torch.zeros(shape), 50
    comm.barrier(comm.world_group())
    start = time.perf_counter()
    for _ in range(rounds if mesh.pp_rank < 2 else 0):
        other = mesh.pp_ranks[1 - mesh.pp_rank]
        order = [("send", buffer, other), ("recv", buffer, other)]
        for op in (order if mesh.pp_rank == 0 else order[::-1]):
            post_and_wait([op], mesh.pp_group)
    out = {"latency": (time.perf_counter() - start) / (2 * rounds)}
    for name, v in cases:
        chunks = [SleepChunk(args.op_ms / 1e3 / v, is_first_chunk(args.pp, mesh.pp_rank, c),
                             is_last_chunk(args.pp, v, mesh.pp_rank, c, chunk_placement(name)), shape) for c in range(v)]
        best = None
        for _ in range(args.repeats + 1):  # the first run is a warm-up
            comm.barrier(comm.world_group())
            _BUSY[0] = 0.0
            start = time.perf_counter()
            run_pipeline(PipelineSpec(name, args.microbatches, shape, torch.float32, v), chunks, microbatches, mesh)
            elapsed = time.perf_counter() - start
            step = max(comm.all_gather_object(elapsed, comm.world_group()))
            busy = statistics.mean(comm.all_gather_object(_BUSY[0], comm.world_group()))
            if best is None or step < best[0]:
                best = (step, busy)
        out[(name, v)] = 1 - best[1] / best[0]
    return out


@reports_usage_errors
def main() -> None:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--virtual-stages", type=int, default=2)
    parser.add_argument("--op-ms", type=float, default=20.0, help="sleep per F, B or W unit (bubble part)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-bubble", action="store_true")
    parser.add_argument("--skip-compare", action="store_true")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    p, m, v = args.pp, args.microbatches, args.virtual_stages
    print(f"# {platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}, python {platform.python_version()}")
    print("# " + " ".join(["python", *sys.argv]))

    if not args.skip_bubble:
        cases = [(name, v if cv is None else cv) for name, cv in BUBBLE_CASES if name != "dualpipev" or m >= 2 * p]
        measured = run_distributed(_bubble_world, p, args, cases, timeout_s=600)[0]
        latency_ms = 1e3 * measured["latency"]
        print(f"\nbubble fraction, pp={p} m={m} v={v}, equal stage cost (F=B=W={args.op_ms} ms / v); "
              f"measured p2p batch latency {latency_ms:.2f} ms")
        print(f"{'schedule':<16}{'formula':>8}{'sim':>8}{'sim+lat':>9}{'measured':>10}{'meas-formula':>14}"
              f"{'meas-sim+lat':>14}")
        for name, cv in cases:
            f, sim, meas = formula(name, p, m, cv), simulate_bubble(name, p, m, cv), measured[(name, cv)]
            sim_latency = simulate_bubble(name, p, m, cv, latency_ms / args.op_ms)
            label = f"{name} v={cv}" if cv > 1 else name
            print(f"{label:<16}{f:>8.3f}{sim:>8.3f}{sim_latency:>9.3f}{meas:>10.3f}{100 * (meas - f):>+12.1f}pt"
                  f"{100 * (meas - sim_latency):>+12.1f}pt")
        if m >= 2 * p:
            print(f"dualpipev F&B unit: its pairs replayed as one unit of F + B: {dualpipev_unit_bubble(p, m):.3f} "
                  f"(the published formula's clock); megalite runs F then B: (p-1)/(6m+p-1) = "
                  f"{(p - 1) / (6 * m + p - 1):.3f}")

    if not args.skip_compare:
        results = run_distributed(compare_world, p, args, v, timeout_s=600)[0]
        print(f"\nGPT stages, megalite vs torch.distributed.pipelining: pp={p} m={m} layers={args.layers} "
              f"hidden={args.hidden} seq={args.seq} micro_batch={args.micro_batch} vocab={args.vocab}, gloo/CPU")
        print(f"{'schedule':<16}{'system':<10}{'best ms':>9}{'median ms':>11}{'cpu ms':>9}{'peak MiB':>10}"
              f"{'loss/token':>12}{'time ratio':>12}{'cpu ratio':>11}{'mem ratio':>11}")
        tokens = m * args.micro_batch * args.seq
        for name, cv in (("1f1b", 1), ("interleaved", v)):
            ref_time, _, ref_cpu, ref_mem, _ = results[(name, cv, "torch")]
            for system in ("megalite", "torch"):
                best, median, cpu, mem, loss = results[(name, cv, system)]
                label = f"{name} v={cv}" if cv > 1 else name
                print(f"{label:<16}{system:<10}{1e3 * best:>9.1f}{1e3 * median:>11.1f}{1e3 * cpu:>9.1f}"
                      f"{mem / 2**20:>10.1f}{loss / tokens:>12.6f}{best / ref_time:>12.3f}{cpu / ref_cpu:>11.3f}"
                      f"{mem / max(ref_mem, 1):>11.3f}")


if __name__ == "__main__":
    main()
