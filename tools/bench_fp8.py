"""FP8 against bf16 on one device: a GEMM, and a stack of llama blocks' forward + backward.

    python tools/bench_fp8.py                      # on a GPU: 8192^3 GEMM, llama-8B- and 1B-shaped stacks
    python tools/bench_fp8.py --gemm 512 --stack tiny-llama --layers 2 --seq 128   # anywhere (CPU: numbers only)

Prints ms and the ratio bf16 / fp8 measured in the same run (the issue's goals on an H100/H200:
GEMM >= 1.6x, llama-8B-shaped 4 layers >= 1.2x, llama-1b-shaped >= 1.1x), the FP8 GEMM's TFLOP/s
against the planner's 1979 peak, and how many FP8 GEMMs fell back to the dequantised path
(megalite.fp8.gemm.fallbacks: any is a bug report on a GPU). The stacks are megalite's own blocks
(tp 1), so the FP8 casts, amax reductions and transposed copies are all in the time. On a CPU
torch._scaled_mm is a reference implementation: the ratios say nothing about a GPU.
"""
from __future__ import annotations

import argparse
import time

import torch

from megalite.fp8 import Fp8Recipe, gemm
from megalite.model.fp8_convert import convert_to_fp8
from megalite.fp8.scaling import quantize
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.model.gpt import GPTModel


def _time(fn, device, repeats: int) -> float:
    fn()  # warm-up (and Triton/cuBLASLt autotune)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def bench_gemm(n: int, device, repeats: int) -> None:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a_hp, b_hp = a.to(dtype), b.to(dtype)
    a_q, inv_a = quantize(a, torch.float8_e4m3fn)
    b_q, inv_b = quantize(b, torch.float8_e4m3fn)
    hp = _time(lambda: a_hp @ b_hp.t(), device, repeats)
    fp8 = _time(lambda: gemm.scaled_mm(a_q, b_q.t(), inv_a, inv_b, dtype), device, repeats)
    tflops = 2 * n ** 3 / (fp8 * 1e-3) / 1e12
    print(f"gemm {n}^3: {dtype} {hp:.3f} ms, fp8 {fp8:.3f} ms, ratio {hp / fp8:.2f}x; fp8 {tflops:.0f} TFLOP/s "
          f"= {100 * tflops / 1979:.0f}% of the H100/H200 dense peak")
    _goal(f"fp8 GEMM {n}^3 vs {str(dtype).replace('torch.', '')}", hp / fp8, GOALS["gemm"], device)


# Llama-3-8B's block: llama-7b's width with GQA (8 kv heads) and a 14336 MLP
SHAPES = {"llama-8b-shaped": ("llama-7b", {"num_query_groups": 8, "ffn_hidden_size": 14336})}


def bench_stack(name: str, layers: int, seq: int, micro: int, device, repeats: int, recipe: Fp8Recipe) -> None:
    base, overrides = SHAPES.get(name, (name, {}))
    model_cfg = preset(base, num_layers=layers, seq_length=seq, **overrides)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mesh = single_process_mesh(device.type)
    ids = torch.randint(0, model_cfg.vocab_size, (micro, seq), device=device)
    times = {}
    for label in ("hp", "fp8"):
        torch.manual_seed(0)
        model = GPTModel(model_cfg, mesh, dtype=dtype, device=device)
        if label == "fp8":
            convert_to_fp8(model, recipe)

        def step():
            model(ids, ids).backward()
        times[label] = _time(step, device, repeats)
        del model
    print(f"{name} x {layers} layers, seq {seq}, micro {micro}: {dtype} {times['hp']:.1f} ms, {recipe.describe()} "
          f"{times['fp8']:.1f} ms per forward+backward, ratio {times['hp'] / times['fp8']:.2f}x")
    if name in GOALS:
        _goal(f"{name} {layers} blocks fwd+bwd, fp8 vs bf16", times["hp"] / times["fp8"], GOALS[name], device)


GOALS = {"gemm": 1.6, "llama-8b-shaped": 1.2, "llama-1b": 1.1}  # issue 35's speed goals (ratios over bf16)


def _goal(what: str, ratio: float, goal: float, device) -> None:
    """A GOAL line for tools/gpu_goals.py; a CPU's figures have no pass mark."""
    verdict = ("met" if ratio >= goal else "NOT met") if device.type == "cuda" else "-"
    print(f"GOAL bench_fp8 {what}: >= {goal}x | measured {ratio:.2f}x | {verdict}")


def main() -> None:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--gemm", type=int, default=8192 if cuda else 512)
    parser.add_argument("--stack", nargs="*", default=["llama-8b-shaped", "llama-1b"] if cuda else ["tiny-llama"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096 if cuda else 128)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--recipe", default="tensorwise", choices=("tensorwise", "rowwise"))
    parser.add_argument("--repeats", type=int, default=10 if cuda else 2)
    args = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    print(f"device: {torch.cuda.get_device_name() if cuda else 'CPU (reference _scaled_mm: not a speed figure)'}; "
          f"torch {torch.__version__}")
    bench_gemm(args.gemm, device, args.repeats)
    for name in args.stack:
        bench_stack(name, args.layers, args.seq, args.micro_batch_size, device, args.repeats,
                    Fp8Recipe("e4m3", args.recipe))
    print(f"FP8 GEMMs that fell back to the dequantised path: {gemm.fallbacks}")
    if cuda:
        print(f"GOAL bench_fp8 every FP8 GEMM on torch._scaled_mm: 0 fallbacks | measured {gemm.fallbacks} | "
              f"{'met' if gemm.fallbacks == 0 else 'NOT met'}")


if __name__ == "__main__":
    main()
