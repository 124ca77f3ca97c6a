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

Part 2, the same GPT stages and data through megalite's executor and through
torch.distributed.pipelining (Schedule1F1B, ScheduleInterleaved1F1B) on CPU/gloo, the two
systems alternating step by step: step time of the slowest rank (best and median over the
timed steps), CPU time per step summed over ranks (robust to other load on the machine),
and peak heap growth during the step (glibc mallinfo2 sampled at every block's forward and
backward hook, max over ranks), with ratios megalite / torch. Both see grads scaled by
1 / global tokens (scale_grads off); the printed losses must agree.
Timings are host wall-clock on shared CPUs: compare within one run only.

    python tools/bench_pipeline.py --pp 4 --microbatches 8 --virtual-stages 2 --op-ms 20
    python tools/bench_pipeline.py --skip-bubble --pp 4 --microbatches 8 --layers 8 --hidden 256 --seq 128
"""
from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.pipelining import PipelineStage

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.distributed import comm  # noqa: E402
from megalite.distributed import mesh as mesh_lib  # noqa: E402
from megalite.model import GPTModel, preset  # noqa: E402
from megalite.parameters import params  # noqa: E402
from megalite.pipeline import PipelineSpec, build_schedule, post_and_wait, run_pipeline, stage_layers  # noqa: E402
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


# ---------------------------------------------------------------------------------------------
# megalite vs torch.distributed.pipelining on the same GPT stages
# ---------------------------------------------------------------------------------------------


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


class HeapPeak:
    """Peak glibc heap in use (small + mmapped blocks), sampled at module hooks."""

    def __init__(self):
        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = _Mallinfo2
        self.base = self.peak = 0

    def used(self) -> int:
        info = self._libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def sample(self, *_):
        self.peak = max(self.peak, self.used())

    def reset(self):
        self.base = self.peak = self.used()

    def watch(self, module: torch.nn.Module):
        for block in [module, *getattr(module, "layers", [])]:
            block.register_forward_hook(self.sample)
            block.register_full_backward_hook(self.sample)


class _LogitsLoss:
    """torch pipelining's loss_fn: sum of CE over real vocab columns, scaled like megalite's."""

    def __init__(self, vocab: int, scale: float):
        self.vocab, self.scale = vocab, scale

    def __call__(self, logits, target):  # logits [b, s, V_pad], target [b, s]
        logits = logits[..., : self.vocab].reshape(-1, self.vocab)
        return F.cross_entropy(logits, target.reshape(-1), ignore_index=-100, reduction="sum") * self.scale


def _compare_world(args, v_interleaved):
    # The first stage's input is token ids: its block hooks see no input gradient (harmless).
    warnings.filterwarnings("ignore", message="Full backward hook is firing")

    mesh = mesh_lib.init_mesh(pp=args.pp)
    cfg = preset("tiny", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 seq_length=args.seq, vocab_size=args.vocab)
    ids, labels, microbatches = _random_gpt_batch(args, cfg.vocab_size)
    scale = 1.0 / labels.numel()
    shape = (args.seq, args.micro_batch, args.hidden)
    heap = HeapPeak()
    results = {}
    for name, torch_cls, v in (("1f1b", Schedule1F1B, 1), ("interleaved", ScheduleInterleaved1F1B, v_interleaved)):
        torch_chunks = _build_gpt_chunks(cfg, mesh, args.pp, v, heap)
        torch_step = _torch_pipelining_step(torch_cls, torch_chunks, mesh, args, cfg.vocab_size, v, ids, labels, scale)

        def megalite_step(chunks, name=name, v=v):
            return run_pipeline(PipelineSpec(name, args.microbatches, shape, torch.float32, v), chunks, microbatches,
                                mesh, scale)

        # Alternate the systems step by step so both see the same background load.
        systems = (("torch", torch_chunks, torch_step),
                   ("megalite", _build_gpt_chunks(cfg, mesh, args.pp, v, heap), megalite_step))
        measured = _time_systems_alternating(systems, args.warmup, args.steps, heap)
        for system, (times, cpus, peaks, loss) in measured.items():
            total = sum(comm.all_gather_object(loss, comm.world_group()))
            results[(name, v, system)] = (min(times), statistics.median(times), min(cpus), max(peaks), total)
    return results


def _random_gpt_batch(args, vocab_size: int):
    """Seeded token ids and labels [microbatches * micro_batch, seq], and the same split per microbatch."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (args.microbatches * args.micro_batch, args.seq), generator=gen)
    labels = torch.randint(0, vocab_size, ids.shape, generator=gen)
    microbatches = [{"input_ids": i, "labels": l} for i, l in
                    zip(ids.split(args.micro_batch), labels.split(args.micro_batch))]
    return ids, labels, microbatches


def _build_gpt_chunks(cfg, mesh, pp: int, v: int, heap: HeapPeak) -> list[GPTModel]:
    """This rank's v model chunks (same seed for both systems), each watched by the heap sampler."""
    chunks = [GPTModel(cfg, mesh, seed=7, layer_ids=layer_ids, pre_process=mesh.is_first_stage and c == 0,
                       post_process=mesh.is_last_stage and c == v - 1)
              for c, layer_ids in enumerate(stage_layers(cfg.num_layers, pp, v, mesh.pp_rank))]
    for chunk in chunks:
        heap.watch(chunk)
    return chunks


def _torch_pipelining_step(torch_cls, chunks, mesh, args, vocab_size: int, v: int, ids, labels, scale: float):
    """A step function running torch.distributed.pipelining's schedule over `chunks`; returns the summed loss."""
    stages = [PipelineStage(chunk, c * args.pp + mesh.pp_rank, args.pp * v, mesh.device, group=mesh.pp_group)
              for c, chunk in enumerate(chunks)]
    loss_fn = _LogitsLoss(vocab_size, scale)
    if v == 1:
        schedule = torch_cls(stages[0], args.microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = torch_cls(stages, args.microbatches, loss_fn=loss_fn, scale_grads=False)

    def torch_step(chunks):
        losses = [] if mesh.is_last_stage else None
        kwargs = {"target": labels, "losses": losses} if mesh.is_last_stage else {}
        schedule.step(ids, **kwargs) if mesh.is_first_stage else schedule.step(**kwargs)
        return float(sum(l.detach() for l in losses)) / scale if losses else 0.0
    return torch_step


def _time_systems_alternating(systems, warmup: int, steps: int, heap: HeapPeak) -> dict:
    """{system: (step times, CPU times, heap peaks over the timed rounds, last loss)}; each round steps every system."""
    measured = {system: ([], [], [], 0.0) for system, _, _ in systems}
    for i in range(warmup + steps):
        for system, chunks, step_fn in systems:
            slowest, cpu_total, peak, loss = _measure_step(chunks, step_fn, heap)
            times, cpus, peaks, _ = measured[system]
            if i >= warmup:
                times.append(slowest)
                cpus.append(cpu_total)
                peaks.append(peak)
            measured[system] = (times, cpus, peaks, loss)
    return measured


def _measure_step(chunks, step_fn, heap: HeapPeak):
    """One step from cleared grads: (slowest rank's time, CPU time over ranks, max heap growth, this rank's loss)."""
    for chunk in chunks:
        for p in chunk.parameters():
            p.grad = None
    comm.barrier(comm.world_group())
    heap.reset()
    start, cpu_start = time.perf_counter(), time.process_time()
    loss = step_fn(chunks)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    heap.sample()
    slowest = max(comm.all_gather_object(elapsed, comm.world_group()))
    cpu_total = sum(comm.all_gather_object(cpu, comm.world_group()))
    peak = max(comm.all_gather_object(heap.peak - heap.base, comm.world_group()))
    return slowest, cpu_total, peak, loss


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
        results = run_distributed(_compare_world, p, args, v, timeout_s=600)[0]
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
