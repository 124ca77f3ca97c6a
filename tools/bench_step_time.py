#!/usr/bin/env python3
"""The planner's predicted step time against measured ones.

    python tools/bench_step_time.py --narayanan [--hardware A100-80GB]
        Narayanan et al. 2021, Table 1: each row's iteration time from the paper (Eq. 3's FLOPs over
        GPUs x the achieved TFLOP/s it prints) against the planner's prediction on the profile, with
        the layouts of Megatron-LM's examples/sc21/run_table_1.sh and the kernels of that Megatron
        (timing.MEGATRON_2021: attention that writes its scores, scatter/gather p2p, the QKV bias and
        context layout passes, fp32 cross entropy; the gradient all-reduce after the backward with
        "local" DDP, during the last microbatch's backward with torch DDP, as the script chose per row).

    python tools/bench_step_time.py --h200
        The planner on the built-in H200 profile against the steps measured on one H200
        (../shared/gpu/2026-11-26-h200/, examples/pretrain_gpt.py with its embedded data, vocab 257
        padded 384, bf16, 1 GPU; bench_train's GPT-2 with vocab 50257), with the attention megalite's
        auto dispatch runs today and with the Triton kernels those runs used.

    python tools/bench_step_time.py --h200 --measure [--iters 20]
        On a GPU: each of those examples/pretrain_gpt.py runs again (the vocab-257 rows and the real
        vocabularies on --mock-data, --iters steps, median step time after the 5th) against the planner
        on this GPU's built-in profile.

    python tools/bench_step_time.py --cycles 3 --iters 40
        On this machine, for the default run, (tp, pp, dp) = (2, 2, 1) and (1, 1, 4) in turn, back to
        back: a quick calibration (megalite/calibration.py, fp32, GEMMs up to 512), then
        examples/pretrain_gpt.py with OMP_NUM_THREADS=1; each run's median step time (steps after the
        5th) against the prediction from the profile measured just before it. Prints the load
        average around every run and the median ratio over the cycles. Profiles and metrics go to --out.
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from megalite.calibration import calibrate
from megalite.config import RunConfig
from megalite.config.model import GPTConfig
from megalite.plan.hardware import builtin_for_device, load_profile
from megalite.plan.timing import MEGALITE, MEGATRON_2021, predict_step_time
from megalite.training.metrics_file import read_records

ROOT = Path(__file__).resolve().parents[1]
SEQ, VOCAB = 2048, 51200
# Table 1 (billions, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU) with run_table_1.sh's
# micro batch and virtual stages (layers per virtual stage: 76B 5, 145B 5, 310B 3, 530B 1)
NARAYANAN = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
             (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
             (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
             (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
             (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
             (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1)]
# run_table_1.sh's DDP=torch rows (1.7B-18.4B): torch DDP reduces buckets during the last microbatch's
# backward (Megatron runs the others under no_sync); the larger rows use Megatron's "local" DDP
TORCH_DDP = {1.7, 3.6, 7.5, 18.4}
LAYOUTS = {"default": [], "tp2_pp2_dp1": ["--tp", "2", "--pp", "2", "--dp", "1", "--global-batch-size", "32"],
           "tp1_pp1_dp4": ["--dp", "4"]}
from megalite.errors import reports_usage_errors
from megalite.cli import OneLineParser


def narayanan(hardware: str) -> list[dict]:
    """Every Table 1 row: the paper's iteration time and the prediction (Megatron-LM 2021's kernels)."""
    rows = []
    for billions, heads, h, layers, tp, pp, gpus, batch, tflops, micro, v in NARAYANAN:
        model = GPTConfig("gpt2", num_layers=layers, hidden_size=h, num_attention_heads=heads, vocab_size=VOCAB,
                          seq_length=SEQ, hidden_dropout=0.1, attention_dropout=0.1)
        cfg = RunConfig.build(tp=tp, pp=pp, dp=gpus // (tp * pp), virtual_stages=v, global_batch_size=batch,
                              micro_batch_size=micro, precision="fp16", grad_reduce_dtype="fp16",
                              recompute="full").resolved(gpus, VOCAB)
        flops = 96 * batch * SEQ * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))  # Eq. 3
        paper = flops / (gpus * tflops * 1e12)
        kernels = dataclasses.replace(MEGATRON_2021, grad_reduce_overlap=billions in TORCH_DDP)
        parts = predict_step_time(model, cfg, hardware, kernels=kernels)
        rows.append({"params_billions": billions, "paper_s": paper, "predicted_s": parts.total,
                     "ratio": parts.total / paper, "breakdown": parts.breakdown()})
    return rows


def print_narayanan(rows: list[dict], hardware: str) -> None:
    print(f"Narayanan et al. 2021 Table 1 on {hardware}: iteration seconds, predicted / paper")
    print(f"{'model':>8s} {'paper':>8s} {'predicted':>10s} {'ratio':>6s}   compute   tp      pp      dp      bubble")
    for r in rows:
        b = r["breakdown"]
        print(f"{r['params_billions']:7.1f}B {r['paper_s']:8.2f} {r['predicted_s']:10.2f} {r['ratio']:6.3f}   "
              f"{b['compute']:7.2f} {b['tp']:7.2f} {b['pp']:7.2f} {b['dp']:7.2f} {b['bubble']:7.2f}")
    ratios = [r["ratio"] for r in rows]
    within = sum(abs(x - 1) <= 0.10 for x in ratios)
    print(f"ratio range {min(ratios):.3f} - {max(ratios):.3f}; {within} of {len(rows)} rows within 10%")


# (name, settings, measured seconds per step on the H200, where it was measured)
H200_RUNS = [("llama-1b 4x2048", dict(model="llama-1b", micro_batch_size=4, seq_length=2048), 257, 0.133, "m1.txt"),
             ("llama-1b 8x2048 selective", dict(model="llama-1b", micro_batch_size=8, seq_length=2048,
                                                recompute="selective"), 257, 0.252, "m2.txt"),
             ("gpt2-124m 8x1024", dict(model="gpt2-124m", micro_batch_size=8, seq_length=1024), 257, 0.0505,
              "gpt2prof.txt / README: 46-55 ms"),
             ("gpt2-124m 8x1024 V50257", dict(model="gpt2-124m", micro_batch_size=8, seq_length=1024), 50257,
              8192 / 140.6e3, "bench_train: 140.6k tok/s"),
             # real vocabularies on --mock-data; measured by code not on main (docs/benchmarks.md, "unlanded branch")
             ("llama3-1b 4x2048 mock", dict(model="llama3-1b", micro_batch_size=4, seq_length=2048, mock_data=True),
              128256, 0.1444, "unlanded branch 2026-11-26"),
             ("llama-1b 4x2048 V32000 mock", dict(model="llama-1b", micro_batch_size=4, seq_length=2048,
                                                  mock_data=True), 32000, 0.1314, "unlanded branch 2026-11-26")]


def h200(hardware: str = "H200") -> None:
    """Predicted against measured step time of the H200 runs (module docstring)."""
    print(f"H200 runs on the {hardware} profile: seconds per step, predicted / measured")
    for name, settings, vocab, measured, where in H200_RUNS:
        cfg = RunConfig.build(precision="bf16", vocab_size=vocab, global_batch_size=settings["micro_batch_size"],
                              **settings).resolved(1, vocab)
        auto, triton = (predict_step_time(cfg.gpt_config(), cfg, hardware, kernels=dataclasses.replace(
            MEGALITE, attention_backend=backend)) for backend in ("auto", "triton"))
        print(f"  {name:26s} measured {measured * 1e3:6.1f} ms | predicted {auto.total * 1e3:6.1f} ms "
              f"({auto.total / measured:.3f}), with Triton attention {triton.total * 1e3:6.1f} ms "
              f"({triton.total / measured:.3f}) | compute {auto.compute * 1e3:.1f} optimizer "
              f"{auto.optimizer * 1e3:.1f} ms  [{where}]")


def measure_gpu(iters: int, out: Path) -> None:
    """The H200_RUNS rows of examples/pretrain_gpt.py measured on this GPU against the planner on its profile."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_time --measure needs a CUDA GPU")
    device = torch.cuda.get_device_name(0)
    profile = builtin_for_device(device) or "H100-SXM"
    out.mkdir(parents=True, exist_ok=True)
    print(f"{device}: measured (median step after the 5th of {iters}) against the {profile} profile")
    for name, settings, vocab, _, _ in H200_RUNS:
        if vocab != 257 and not settings.get("mock_data"):  # the embedded data or mock ids; the other row is
            continue                                           # tools/bench_train.py's
        flags = [f"--{key.replace('_', '-')}" + ("" if value is True else f"={value}") for key, value in settings.items()]
        tag = name.replace(" ", "_")
        seconds = measure_run(tag, flags + ["--bf16", f"--global-batch-size={settings['micro_batch_size']}"],
                              iters, out, world=1)
        cfg = RunConfig.build(precision="bf16", global_batch_size=settings["micro_batch_size"], **settings)
        cfg = cfg.resolved(1, vocab)
        guess = predict_step_time(cfg.gpt_config(), cfg, profile).total
        print(f"  {name:26s} measured {seconds * 1e3:7.1f} ms  predicted {guess * 1e3:7.1f} ms  "
              f"ratio {guess / seconds:.3f}  (goal: within 15%)")


def _loadavg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def measure_run(name: str, extra: list[str], iters: int, out: Path, world: int | None = None) -> float:
    """Median step seconds of one examples/pretrain_gpt.py run (steps after the 5th); world: ranks
    (default: 4 for a LAYOUTS run with flags, 1 for the default run)."""
    metrics = out / f"{name}.jsonl"
    world = world or (4 if extra else 1)
    launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={world}"]
    cmd = launcher + [str(ROOT / "examples" / "pretrain_gpt.py"), *extra, "--train-iters", str(iters),
                      "--log-interval", "1", "--eval-iters", "1", "--metrics-file", str(metrics)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out / f"{name}.log", "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    steps = read_records(metrics)
    return statistics.median(s["step_time_s"] for s in steps if "step_time_s" in s and s["step"] > 5)


def predicted(name: str, extra: list[str], profile) -> float:
    settings = {"default": {}, "tp2_pp2_dp1": dict(tp=2, pp=2, dp=1, global_batch_size=32),
                "tp1_pp1_dp4": dict(dp=4)}[name]
    cfg = RunConfig.build(**settings)
    cfg = cfg.resolved(cfg.parallel.tp * cfg.parallel.pp * (cfg.parallel.dp or 1), 257)
    return predict_step_time(cfg.gpt_config(), cfg, profile).total


def cycles(count: int, iters: int, out: Path) -> None:
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    results = {name: [] for name in LAYOUTS}
    for cycle in range(count):
        print(f"cycle {cycle}")
        for name, extra in LAYOUTS.items():  # calibrate right before each run: the load drifts in minutes
            before = _loadavg()
            profile = calibrate(name=f"this machine, {name}, cycle {cycle}", precisions=("fp32",), quick=True,
                                log=lambda line: None)
            profile.save(out / f"profile_{name}_{cycle}.json")
            seconds = measure_run(f"{name}_{cycle}", extra, iters, out)
            guess = predicted(name, extra, profile)
            results[name].append(guess / seconds)
            print(f"  {name:12s} measured {seconds * 1e3:7.1f} ms  predicted {guess * 1e3:7.1f} ms  "
                  f"ratio {guess / seconds:5.2f}  (load {before} -> {_loadavg()}; profile: GEMM best "
                  f"{profile.peak_tflops['fp32'] * 1e3:.0f} GFLOP/s, GeLU {profile.elementwise_gbs:.1f} GB/s, "
                  f"attention {profile.attention_efficiency:.0%}, all-reduce {profile.intra_node_busbw_gbs:.2f} GB/s + "
                  f"{profile.collective_latency_us:.0f} us (4 ranks {profile.collective_latency_s(4) * 1e6:.0f} us), "
                  f"4 ranks x{profile.compute_slowdown(4):.2f}, block "
                  f"{profile.block_overhead_us / 1e3:.1f} ms)")
            time.sleep(1)
    for name, ratios in results.items():
        print(f"{name:12s} predicted / measured: median {statistics.median(ratios):.2f} over {count} cycles "
              f"({', '.join(f'{r:.2f}' for r in ratios)})")


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--narayanan", action="store_true", help="Table 1 of Narayanan et al. on --hardware")
    parser.add_argument("--h200", action="store_true", help="the H200 runs against the planner on the H200 profile")
    parser.add_argument("--measure", action="store_true", help="with --h200: run them again on this GPU")
    parser.add_argument("--hardware", default="A100-80GB")
    parser.add_argument("--cycles", type=int, default=0, help="calibrate-and-measure cycles on this machine")
    parser.add_argument("--iters", type=int, default=40, help="training steps per measured run")
    parser.add_argument("--out", default="bench_step_time", help="where profiles, logs and metrics go")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not args.narayanan and not args.cycles and not args.h200:
        parser.error("choose --narayanan, --h200 and/or --cycles N")
    if args.h200:
        h200()
        if args.measure:
            measure_gpu(args.iters, Path(args.out))
    if args.narayanan:
        rows = narayanan(args.hardware)
        print(json.dumps(rows, indent=1)) if args.json else print_narayanan(rows, load_profile(args.hardware).name)
    if args.cycles:
        cycles(args.cycles, args.iters, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
