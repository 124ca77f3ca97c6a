"""megalite's pipeline executor against torch.distributed.pipelining on the same GPT stages: the second part
of tools/bench_pipeline.py (run it from there: `python tools/bench_pipeline.py --skip-bubble ...`).

The same GPT stages and data through megalite's executor and through torch.distributed.pipelining
(Schedule1F1B, ScheduleInterleaved1F1B) on CPU/gloo, the two systems alternating step by step: step time
of the slowest rank (best and median over the timed steps), CPU time per step summed over ranks (robust to
other load on the machine), and peak heap growth during the step (glibc mallinfo2 sampled at every block's
forward and backward hook, max over ranks), with ratios megalite / torch. Both see grads scaled by
1 / global tokens (scale_grads off); the printed losses must agree.
"""
from __future__ import annotations

import ctypes
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

from megalite.distributed import comm
from megalite.distributed import mesh as mesh_lib
from megalite.model import GPTModel, preset
from megalite.pipeline import PipelineSpec, run_pipeline, stage_layers


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


def compare_world(args, v_interleaved):
    """One rank's part (run by run_distributed over --pp ranks): {(schedule, v, system): (best s, median s,
    CPU s, heap peak bytes, summed loss)}."""
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
