"""Measure this machine and write a hardware profile the planner reads (`tools/plan.py --calibrate OUT.json`).

What is measured (each a median over repeats, so a brief burst of another process's load moves it less):
  GEMMs          n x n x n products for n = 16 ... 2048 (CPU) or 256 ... 8192 (GPU) in each precision:
                 TFLOP/s; the profile's peak is the best of them (a CPU's datasheet peak is not known
                 here; on a known GPU the datasheet peak), its curve each size's fraction of it;
  contention     (CPU) the same GEMM loop in 1, 2, 4, 8 processes at once: how much each slows down,
                 on this machine as loaded as it is (cores, SMT, other users);
  copy           an out-of-place copy (x.clone(): allocation included, as eager ops allocate their
                 outputs) of 4 MiB, in bytes read + written per second;
  elementwise    a tanh-GeLU forward + backward over 4 MiB: the rate of kernels that also compute
                 (a CPU's vector math is slower than its memory; a GPU's is not);
  attention      causal scaled_dot_product_attention forward + backward: its fraction of peak;
  collectives    all-reduce over forked gloo (or NCCL) ranks, 4 KiB ... 16 MiB: bus bandwidth
                 (nccl-tests convention) and the fixed cost per call, fitted to time = latency +
                 bytes * bus factor / busbw; a CPU over 2 and 4 ranks (the fixed cost grows with
                 the group where ranks outnumber the cores), a GPU over 2 devices when it has them;
  host overhead  megalite's own pieces at negligible size (hidden 16, 8 tokens): one block's forward
                 + backward, the rest of a microbatch (embedding, head, loss), the rest of a step
                 (optimizer, bookkeeping) — what a step costs besides arithmetic on this host.
The planner itself never imports torch; this module does.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from megalite.distributed import comm
from megalite.config import Precision, RunConfig
from megalite.cpu_features import cpu_flags, has_native_bf16
from megalite.distributed.mesh import init_mesh
from megalite.plan.hardware import HardwareProfile
from megalite.tensor_parallel.random import TensorParallelRNG
from megalite.testing import run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

# datasheet dense peaks of known GPUs (TFLOP/s): a calibrated GPU profile reports efficiency against them
KNOWN_PEAKS = {"A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}, "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
               "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, device: torch.device, min_seconds: float = 0.05, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of fn() over a loop lasting at least `min_seconds`."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    once = max(time.perf_counter() - start, 1e-7)
    loops = max(1, int(min_seconds / once))
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(loops):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) / loops)
    return statistics.median(samples)


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 natively: a CUDA GPU that supports it, or a CPU whose flags
    name bf16 instructions (x86 AVX512-BF16 or AMX-BF16, Arm's BF16 extension). Without them torch
    converts every bf16 element, and a 2048^3 GEMM takes seconds to minutes."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = cpu_flags()  # None where not Linux: assume not (--calibrate-bf16 measures it anyway)
    return flags is not None and has_native_bf16(flags)


def affordable_sizes(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...], calls: int,
                     size_budget_s: float) -> tuple[int, ...]:
    """The sizes, smallest first, whose `calls` GEMMs fit `size_budget_s` seconds, by the faster of
    two probe products each (the first pays for first touches); the first size that does not fit
    ends the list (a larger one costs more). The smallest is always kept, so a profile has a curve."""
    kept = []
    for n in sorted(sizes):
        a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
        seconds = []
        for _ in range(2):
            _sync(device)
            start = time.perf_counter()
            torch.mm(a, b)
            _sync(device)
            seconds.append(time.perf_counter() - start)
            if kept and calls * seconds[0] > 2 * size_budget_s:  # far over: no second probe
                break
        if kept and calls * min(seconds) > size_budget_s:
            break
        kept.append(n)
    return tuple(kept)


def measure_gemms(device: torch.device, precision: str, sizes: tuple[int, ...], rounds: int = 5,
                  size_budget_s: float | None = None) -> dict[int, float]:
    """n -> TFLOP/s of an n x n x n GEMM at `precision`: the median of `rounds` passes over all sizes
    (round-robin, so a burst of another process's load hits every size alike, not one). With
    `size_budget_s`, only the sizes whose passes take at most that long each (`affordable_sizes`;
    a pass is at least three products: warm-up, probe, one timed)."""
    dtype = Precision(precision).torch_dtype
    if size_budget_s is not None:
        sizes = affordable_sizes(device, dtype, sizes, 3 * rounds, size_budget_s)
    operands = {n: (torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype))
                for n in sizes}
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(rounds):
        for n, (a, b) in operands.items():
            samples[n].append(_median_seconds(lambda: torch.mm(a, b), device, min_seconds=0.03, repeats=1))
    return {n: 2 * n ** 3 / statistics.median(times) / 1e12 for n, times in samples.items()}


def _gemm_worker(n: int, threads: int, conn) -> None:
    """One contention process: on each `loops` received, time that many n x n GEMMs and send the seconds."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    while (loops := conn.recv()) is not None:
        start = time.perf_counter()
        for _ in range(loops):
            torch.mm(a, b)
        conn.send(time.perf_counter() - start)


def measure_rank_slowdown(counts: tuple[int, ...], n: int = 256, seconds: float = 0.3,
                          rounds: int = 5) -> dict[int, float]:
    """k -> how much slower each of k processes running the same GEMM loop at once is than one alone
    (the median process); what k ranks on this machine, as loaded as it is now, cost each other.

    The processes compute with this process's thread count. They are started once and reused. With
    more than one thread they are spawned, not forked: a child forked after the parent has used
    OpenMP's thread pool hangs in its first multi-threaded GEMM (libgomp is not fork-safe)."""
    threads = torch.get_num_threads()
    a, b = torch.randn(n, n), torch.randn(n, n)
    once = _median_seconds(lambda: torch.mm(a, b), torch.device("cpu"), min_seconds=0.05, repeats=3)
    loops = max(1, int(seconds / once))
    ctx = mp.get_context("fork" if threads == 1 else "spawn")
    pipes = [ctx.Pipe() for _ in range(max(counts))]
    procs = [ctx.Process(target=_gemm_worker, args=(n, threads, child), daemon=True) for _, child in pipes]
    for p, (_, child) in zip(procs, pipes):
        p.start()
        child.close()  # a worker that dies then reads as EOF here instead of a hang
    times: dict[int, list[float]] = {k: [] for k in counts}
    try:
        for _ in range(rounds):  # round-robin over the counts, so a burst of others' load hits them alike
            for k in counts:
                for parent, _ in pipes[:k]:
                    parent.send(loops)
                times[k].append(statistics.median(parent.recv() for parent, _ in pipes[:k]))
    finally:
        for (parent, _), p in zip(pipes, procs):
            with contextlib.suppress(OSError):
                parent.send(None)
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    # each round's ratio to that round's lone process, then the median over rounds: a burst of
    # others' load that spans a round moves one ratio, not the result
    ratios = {k: statistics.median(t / alone for t, alone in zip(times[k], times[counts[0]])) for k in counts}
    return {k: max(1.0, ratio) for k, ratio in ratios.items()}  # never faster than alone


def measure_copy_gbs(device: torch.device, nbytes: int = 4 << 20) -> float:
    """GB/s (read + written) of an out-of-place copy of `nbytes` (x.clone())."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    seconds = _median_seconds(lambda: x.clone(), device)
    return 2 * nbytes / seconds / 1e9


def measure_elementwise_gbs(device: torch.device, nbytes: int = 4 << 20) -> float:
    """GB/s of a tanh-GeLU forward + backward over `nbytes` of fp32 (reads x; writes y; reads x, dy;
    writes dx: 5 x nbytes), the kind of elementwise kernel a block runs between its GEMMs."""
    x = torch.randn(nbytes // 4, device=device, requires_grad=True)
    dy = torch.randn(nbytes // 4, device=device)

    def step():
        torch.nn.functional.gelu(x, approximate="tanh").backward(dy)
        x.grad = None

    return 5 * nbytes / _median_seconds(step, device) / 1e9


def measure_attention_efficiency(device: torch.device, precision: str, peak_tflops: float) -> float:
    """Fraction of `peak_tflops` that causal scaled_dot_product_attention forward + backward reaches,
    its FLOPs counted as 3.5 x 4 b h s (s/2) d (the planner's convention)."""
    b, h, s, d = (4, 16, 2048, 128) if device.type == "cuda" else (4, 4, 256, 32)
    q, k, v = (torch.randn(b, h, s, d, device=device).to(Precision(precision).torch_dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, s, d, device=device).to(Precision(precision).torch_dtype)

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
        q.grad = k.grad = v.grad = None

    flops = 3.5 * 4 * b * h * s * (s / 2) * d
    return flops / _median_seconds(step, device) / (peak_tflops * 1e12)


def _allreduce_world(sizes: tuple[int, ...], device_type: str, repeats: int) -> dict[int, float]:
    mesh = init_mesh()
    device = mesh.device if device_type == "cuda" else torch.device("cpu")
    group = mesh.dp_group
    out = {}
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        loops = max(2, min(50, (8 << 20) // nbytes))  # the same count on every rank: collectives must match
        samples = []
        for _ in range(repeats):
            comm.barrier(group)
            start = time.perf_counter()
            for _ in range(loops):
                comm.all_reduce(x, group)
            _sync(device)
            samples.append((time.perf_counter() - start) / loops)
        out[nbytes] = statistics.median(samples)
    comm.barrier(group)
    return out


def measure_allreduce(world_size: int, device: torch.device, sizes: tuple[int, ...], repeats: int = 5) -> dict[int, float]:
    """bytes -> seconds of one all-reduce over `world_size` forked ranks (the slowest rank's median)."""
    env = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    per_rank = run_distributed(_allreduce_world, world_size, sizes, device.type, repeats, timeout_s=600.0, env=env)
    return {n: max(r[n] for r in per_rank) for n in sizes}


def fit_latency_and_busbw(times: dict[int, float], world_size: int) -> tuple[float, float]:
    """Least squares of time = latency + bytes * 2(n-1)/n / busbw; returns (latency seconds, busbw bytes/s)."""
    factor = 2.0 * (world_size - 1) / world_size
    xs = [n * factor for n in times]
    ys = list(times.values())
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    latency = max(0.0, mean_y - slope * mean_x)
    return latency, 1.0 / slope


def _overhead_world(min_seconds: float, repeats: int) -> dict[str, float]:
    """Median seconds, on one rank, of megalite's pieces at negligible size (hidden 16, 8 tokens): one
    block's forward + backward, the whole model's (embedding, 1 block, head, loss), the optimizer
    step, and a whole training step."""
    mesh = init_mesh()
    cfg = RunConfig.build(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, micro_batch_size=1,
                          global_batch_size=1).resolved(1, 64)
    chunks = build_model_chunks(cfg.gpt_config(), cfg, mesh)
    model = build_data_parallel(chunks, cfg, mesh)
    optimizer = build_optimizer(model, cfg)
    ids = torch.randint(0, 64, (1, 8))
    block, rng = chunks[0].layers[0], TensorParallelRNG(seed=1)
    x = torch.randn(8, 1, 16, requires_grad=True)  # [s, b, h]

    def block_pass():
        block(x, None, rng).sum().backward()

    def model_pass():
        model(ids, ids, reduction="sum").backward()

    model_pass()
    seconds = {name: _median_seconds(fn, mesh.device, min_seconds, repeats)
               for name, fn in (("block", block_pass), ("model", model_pass),
                                ("optimizer", lambda: optimizer.step(lr=1e-4)))}
    seconds["train_step"] = _median_seconds(
        lambda: train_step(model, optimizer, [{"input_ids": ids, "labels": ids}], mesh, cfg, 1e-4), mesh.device,
        min_seconds, repeats)
    return seconds


def measure_host_overheads(min_seconds: float = 0.2, repeats: int = 9) -> dict[str, float]:
    """Seconds megalite's step costs on this host besides arithmetic: per block (forward + backward),
    per microbatch outside the blocks, per step outside the microbatches."""
    env = {"OMP_NUM_THREADS": str(torch.get_num_threads())}
    raw = run_distributed(_overhead_world, 1, min_seconds, repeats, env=env, timeout_s=600.0)[0]
    return {"block": raw["block"], "microbatch": max(0.0, raw["model"] - raw["block"]),
            "step": max(raw["optimizer"], raw["train_step"] - raw["model"]), **{f"raw_{k}": v for k, v in raw.items()}}


# seconds one GEMM size may take in calibrate(): 5 rounds of >= 3 products, so the sizes from the
# first whose product takes over 2/3 s are left out (a slow CPU, or bf16 without native support);
# the kept sizes cost at most 8/7 of this per precision (each size 8x the work of the one before)
SIZE_BUDGET_S = 10.0


def _precisions_to_measure(device: torch.device, bf16: bool | None, log) -> tuple[str, ...]:
    """fp32, and bf16 where native or asked for (bf16=True); bf16=False leaves it out."""
    native = native_bf16(device)
    if bf16 is None and not native:
        log("  bf16: not measured (no native bf16 on this device; --calibrate-bf16 measures it anyway, slowly)")
    return ("fp32", "bf16") if (native if bf16 is None else bf16) else ("fp32",)


def _measure_and_log_gemms(device: torch.device, precision: str, sizes: tuple[int, ...], log) -> dict[int, float]:
    """{n: TFLOP/s} of the sizes that fit SIZE_BUDGET_S each; the log names those left out."""
    gemms = measure_gemms(device, precision, sizes, size_budget_s=SIZE_BUDGET_S)
    left_out = [n for n in sizes if n not in gemms]
    log(f"  GEMM {precision}: " + ", ".join(f"{n}: {v * 1e3:.1f}" for n, v in gemms.items())
        + " GFLOP/s" + (f" (left out, over {SIZE_BUDGET_S:.0f} s each: {left_out})" if left_out else ""))
    return gemms


def calibrate(name: str | None = None, precisions: tuple[str, ...] | None = None, quick: bool = False,
              log=print, bf16: bool | None = None) -> HardwareProfile:
    """Measure this machine (its first GPU when CUDA is available, else its CPU) and return a profile.

    precisions: default fp32, and bf16 where the device multiplies it natively (`native_bf16`) or
    `bf16` is True (tools/plan.py --calibrate-bf16); bf16=False leaves it out. Each GEMM size is
    measured only while it fits SIZE_BUDGET_S, so the calibration ends in minutes on any CPU."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    sizes = (256, 512, 1024, 2048, 4096, 8192) if cuda else (16, 32, 64, 128, 256, 512, 1024, 2048)
    if quick:
        sizes = sizes[:-2]
    device_name = torch.cuda.get_device_name(0) if cuda else (platform.processor() or platform.machine())
    log(f"calibrating {device_name}: {torch.get_num_threads()} threads, {cores} cores")
    if precisions is None:
        precisions = _precisions_to_measure(device, bf16, log)
    gemms = {precision: _measure_and_log_gemms(device, precision, sizes, log) for precision in precisions}
    known = next((peaks for key, peaks in KNOWN_PEAKS.items() if cuda and key in device_name), None)
    peaks = {p: (known or {}).get(p) or max(gemms[p].values()) for p in precisions}
    main = precisions[0]
    curve = tuple((float(n), min(1.0, v / peaks[main])) for n, v in gemms[main].items())
    copy_gbs, elementwise_gbs = measure_copy_gbs(device), measure_elementwise_gbs(device)
    attention = measure_attention_efficiency(device, main, peaks[main])
    log(f"  copy: {copy_gbs:.2f} GB/s, elementwise (GeLU fwd+bwd): {elementwise_gbs:.2f} GB/s, causal attention "
        f"fwd+bwd: {attention:.1%} of peak")
    message_sizes = (4 << 10, 64 << 10, 1 << 20, 4 << 20) if quick else (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
    # a CPU: 2 ranks and 4 (where ranks outnumber the cores the fixed cost grows with the group);
    # a GPU: two devices when it has them (one rank per device)
    group_sizes = (2, 4) if not cuda else ((2,) if torch.cuda.device_count() > 1 else ())
    allreduce = {n: measure_allreduce(n, device, message_sizes) for n in group_sizes}
    fits = {n: fit_latency_and_busbw(times, n) for n, times in allreduce.items()}
    for n, (latency, busbw) in fits.items():
        log(f"  all-reduce over {n} ranks: bus bandwidth {busbw / 1e9:.2f} GB/s, latency {latency * 1e6:.0f} us")
    latency, busbw = fits.get(2, (10e-6, 100e9))
    slowdown = {} if cuda else measure_rank_slowdown((1, 2, 4) if quick else (1, 2, 4, 8))
    if slowdown:
        log("  ranks computing at once, slowdown of each: " + ", ".join(f"{k}: {x:.2f}" for k, x in slowdown.items()))
    host = measure_host_overheads()
    log(f"  host overhead: block {host['block'] * 1e3:.2f} ms, microbatch {host['microbatch'] * 1e3:.2f} ms, "
        f"step {host['step'] * 1e3:.2f} ms")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return HardwareProfile(
        name=name or f"calibrated {device_name}", peak_tflops=peaks, matmul_efficiency=curve,
        memory_bandwidth_gbs=copy_gbs, elementwise_gbs=elementwise_gbs, attention_efficiency=attention,
        intra_node_busbw_gbs=busbw / 1e9, inter_node_busbw_gbs=busbw / 1e9,
        devices_per_node=torch.cuda.device_count() if cuda else None, collective_latency_us=latency * 1e6,
        collective_ranks=() if cuda else tuple((n, lat * 1e6, bw / 1e9) for n, (lat, bw) in fits.items()),
        block_overhead_us=host["block"] * 1e6, microbatch_overhead_us=host["microbatch"] * 1e6,
        step_overhead_us=host["step"] * 1e6, host_synchronous=not cuda, cores=None if cuda else cores,
        threads_per_rank=1 if cuda else torch.get_num_threads(), rank_slowdown=tuple(slowdown.items()),
        source=f"tools/plan.py --calibrate on {device_name}, {stamp}, torch {torch.__version__}, "
               f"{torch.get_num_threads()} threads, load average {load:.2f}",
        measurements={"gemm_tflops": {p: {str(n): v for n, v in g.items()} for p, g in gemms.items()},
                      "copy_gbs": copy_gbs, "elementwise_gbs": elementwise_gbs, "attention_efficiency": attention,
                      "allreduce_seconds": {str(ranks): {str(n): t for n, t in times.items()}
                                            for ranks, times in allreduce.items()}, "host_seconds": host, "rank_slowdown": slowdown,
                      "load_average": load})
