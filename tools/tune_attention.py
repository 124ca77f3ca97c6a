"""Time candidate tiles of each flash-attention kernel on a GPU and name the fastest.

    python tools/tune_attention.py --quick          # one shape: b4 x h32/8 x s4096 x d128, bf16
    python tools/tune_attention.py                  # d 64 and 128, s 1k..8k

For each kernel (forward, dK/dV, dQ) every candidate (BLOCK_M, BLOCK_N, num_warps,
num_stages) is timed with `triton.testing.do_bench` (median; the forward alone, the backward
kernels as forward + backward), the other two kernels kept at their defaults from
`flash_attention._config`. A candidate whose output or gradients differ from the default
tiles' (relative error >= 2e-2, more than bf16 block-order noise) is marked WRONG, not fast.
Every candidate compiles for sm_90 without register spills (checked with compile_check's
machinery). Put the fastest into `flash_attention._config`, then rerun bench_kernels.py.
Without a GPU it runs on CPU in Triton's interpreter with a wall-clock timer (`--smoke`),
which only tests this script.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import megalite.kernels as K  # noqa: E402
from bench_kernels import Case, build_cases, make_timer  # noqa: E402  (tools/ is the script's directory)

# Candidate tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) per attention kernel, 16-bit inputs.
# The forward needs BLOCK_M % BLOCK_N == 0.
ATTENTION_CANDIDATES = {
    "fwd": [(64, 64, 4, 3), (64, 64, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4)],
    "dkdv": [(32, 64, 4, 3), (32, 64, 8, 2), (64, 64, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3), (16, 64, 4, 4)],
    "dq": [(64, 32, 4, 3), (64, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 16, 4, 4)],
}


def sweep_attention_configs(cases: list[Case], timer) -> list[dict]:
    """Time every candidate tile of each attention kernel (the other two at their defaults)."""
    from megalite.kernels import flash_attention

    default_config = flash_attention._config
    rows = []
    for case in (c for c in cases if c.op == "attention"):
        inputs = case.make_inputs()
        leaves = [t for t in inputs if t.requires_grad]
        grad = torch.randn_like(inputs[0])
        head_dim = inputs[0].shape[-1]

        def outputs():  # what a tile computes: the output and every input gradient, in float32
            for t in leaves:
                t.grad = None
            out = K.attention(*inputs)
            out.backward(grad)
            return [out.detach().float()] + [t.grad.float() for t in leaves]
        expected = outputs()  # the default tiles
        print(f"attention tiles, {case.shape} (TFLOP/s; * = current default)")
        for kernel, candidates in ATTENTION_CANDIDATES.items():
            default = default_config(head_dim, inputs[0].device, inputs[0].dtype)
            results = []
            for tile in dict.fromkeys([default[kernel], *candidates]):
                flash_attention._config = lambda *a, tile=tile, kernel=kernel: dict(default_config(*a),
                                                                                    **{kernel: tile})
                try:
                    if kernel == "fwd":
                        ms = timer(lambda: K.attention(*inputs))
                        units = case.fwd_units
                    else:
                        ms = timer(lambda: K.attention(*inputs).backward(grad), grad_to_none=leaves)
                        units = case.fwd_bwd_units
                    # a fast tile that computes something else is no candidate (bf16: block order moves bits)
                    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
                                for a, b in zip(outputs(), expected))
                    results.append((tile, ms, units / ms / 1e9, "" if worst < 2e-2 else f"WRONG (rel err {worst:.1e})"))
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory on this GPU
                    results.append((tile, math.nan, math.nan, f"ERROR {type(exc).__name__}"))
                finally:
                    flash_attention._config = default_config
            mode = "fwd" if kernel == "fwd" else "fwd+bwd"
            best = max((r for r in results if not r[3]), key=lambda r: r[2], default=None)
            for tile, ms, rate, error in results:
                mark = ("*" if tile == default[kernel] else " ") + ("<- best" if best and tile == best[0] else "")
                print(f"  {kernel:5s} {str(tile):20s} {mode:8s} " +
                      f"{ms:9.3f} ms {rate:7.1f} TFLOP/s {error or mark}")
                rows.append(dict(op=f"attention {kernel} tile {tile}", shape=case.shape, provider="megalite",
                                 mode=mode, median_ms=ms, rate=rate, error=error))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one training shape, shorter timing")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--smoke", action="store_true", help="CPU self-test: tiny shape, interpreter, wall clock")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("tune_attention needs a GPU (or --smoke to test this script on CPU)")
        return 1
    os.environ["MEGALITE_KERNEL_BACKEND"] = "triton"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = build_cases({"attention"}, args.quick, device, getattr(torch, args.dtype), False, args.smoke)
    rows = sweep_attention_configs(cases, make_timer(args.smoke, args.quick))
    return 0 if not any(r["error"].startswith("WRONG") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
