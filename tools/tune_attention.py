"""Tune the flash-attention tiles on this GPU and measure where torch's SDPA is faster.

    python tools/tune_attention.py --quick                # d 64 and 128 at s 4096; dispatch at s 1k, 4k, 16k
    python tools/tune_attention.py                        # dispatch at s 1k, 2k, 4k, 8k, 16k
    python tools/tune_attention.py --json tuned.json      # also write both tables (bench_kernels --tables)

The candidates are compiled first in --jobs processes (8), then timed one at a time.

1. Tiles. For each head dim, every candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) of each
   kernel is timed with `triton.testing.do_bench` (median): the forward alone, the dK/dV and dQ
   kernels as forward + backward, tuned in that order with the kernels already tuned at their
   best (the rest at their current tiles). A candidate whose output or gradients differ from the
   current tiles' (relative error >= 2e-2, more than bf16 block-order noise) is WRONG, not fast.
   Every candidate listed below compiles for sm_90 without register spills (compile_check).
   Prints the `attention_tiles.MEASURED` entry for this GPU.
2. Dispatch. At each sequence length (16384 tokens per call, GQA 4:1, heads = 4096 / d, q, k, v
   as [b, h, s, d] views of [s, b, h, d] activations, as the model passes them) forward +
   backward of the tuned Triton kernels, SDPA with repeated kv heads and SDPA with enable_gqa
   (where torch has it); prints the `attention_dispatch.MEASURED_MS` rows and each ratio. Our
   kernels run twice, once per backward variant ("triton": split, "triton_fused": fused, at the
   tiles just tuned with the split one); the variant with the lower geometric mean becomes the
   `attention_tiles.MEASURED_BACKWARD` entry and its times the table's "triton".

Without a GPU, `--smoke` runs everything on CPU in Triton's interpreter with tiny shapes and a
wall clock: it tests this script, nothing else.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import subprocess

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import megalite.kernels as K  # noqa: E402
from megalite.kernels import attention_dispatch, attention_tiles, flash_attention  # noqa: E402

# Candidates per (head dim, kernel), 16-bit inputs; the forward needs BLOCK_M % BLOCK_N == 0.
CANDIDATES = {
    128: {"fwd": [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4),
                  (64, 32, 4, 3), (64, 64, 8, 3)],
          "dkdv": [(32, 64, 4, 3), (32, 64, 8, 2), (64, 64, 8, 2), (32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 4),
                   (16, 128, 8, 2), (16, 128, 8, 3), (16, 64, 4, 3), (16, 64, 4, 4)],
          "dq": [(64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 8, 2), (128, 32, 8, 3), (128, 32, 8, 4), (64, 64, 4, 3),
                 (128, 64, 8, 2), (64, 64, 8, 3), (64, 16, 4, 3), (64, 16, 4, 4)]},
    64: {"fwd": [(128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3),
                 (64, 64, 4, 4), (64, 32, 4, 3), (128, 32, 4, 4)],
         "dkdv": [(32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 8, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 8, 2),
                  (32, 128, 8, 2), (32, 128, 8, 3), (64, 128, 8, 2), (64, 128, 8, 3), (16, 128, 8, 2)],
         "dq": [(64, 32, 4, 3), (64, 32, 4, 4), (64, 32, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4),
                (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)]},
}
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402
SMOKE_CANDIDATES = {"fwd": [(32, 16, 1, 1)], "dkdv": [(16, 32, 1, 1)], "dq": [(32, 16, 1, 1)]}
TOKENS = 16384  # per call: batch = TOKENS // seq


def attention_inputs(seq: int, head_dim: int, dtype: torch.dtype, device: str, smoke: bool = False):
    """q [b, h, s, d], k, v [b, h/4, s, d] as permuted views of [s, b, heads, d] leaves (the model's layout)."""
    heads = 4 if smoke else 4096 // head_dim
    batch = 1 if smoke else max(1, TOKENS // seq)
    leaves = [torch.randn(seq, batch, n, head_dim, device=device, dtype=dtype).requires_grad_()
              for n in (heads, heads // 4, heads // 4)]
    views = [t.permute(1, 2, 0, 3) for t in leaves]
    flops = 4 * batch * heads * seq * seq * head_dim / 2  # causal: two matmuls over half the square
    return views, leaves, flops


def make_timer(smoke: bool):
    if smoke:
        def wall_clock(fn, grad_to_none=None):
            fn()
            start = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - start)
        return wall_clock
    import triton.testing  # optional (Linux only, setup.py): only the GPU timers need it

    return lambda fn, grad_to_none=None: triton.testing.do_bench(fn, warmup=10, rep=40, grad_to_none=grad_to_none,
                                                                 return_mode="median")


def _fwd_bwd(views, leaves, grad):
    def step():
        K.attention(*views).backward(grad)
    return step


def _outputs(views, leaves, grad):
    """What a tile computes: the output and every input gradient, in float32."""
    for t in leaves:
        t.grad = None
    out = K.attention(*views)
    out.backward(grad)
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def _worst_error(got, expected) -> float:
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() for a, b in zip(got, expected))


def tune_tiles(head_dim: int, seq: int, dtype: torch.dtype, device: str, timer, candidates: dict,
               smoke: bool) -> tuple[dict, list[dict]]:
    """Greedy per kernel (fwd, dkdv, dq): the fastest correct candidate, the others as tuned so far."""
    views, leaves, flops = attention_inputs(seq, head_dim, dtype, device, smoke)
    grad = torch.randn_like(views[0])
    current_config = flash_attention._config
    chosen = dict(current_config(head_dim, views[0].device, dtype, False, True))
    expected = _outputs(views, leaves, grad)  # the current tiles
    rows = []
    print(f"attention tiles d={head_dim}, s={seq}, {views[0].shape[0]}x{views[0].shape[1]}/{views[1].shape[1]} heads "
          f"(TFLOP/s; * = current)")
    for kernel in attention_tiles.KERNELS:
        results = []
        for tile in dict.fromkeys([chosen[kernel], *candidates[kernel]]):
            flash_attention._config = lambda *a, tile=tile, kernel=kernel, **kw: dict(chosen, **{kernel: tile})
            try:
                if kernel == "fwd":
                    ms, units = timer(lambda: K.attention(*views)), flops
                else:
                    ms, units = timer(_fwd_bwd(views, leaves, grad), grad_to_none=leaves), 3.5 * flops
                worst = _worst_error(_outputs(views, leaves, grad), expected)
                results.append((tile, ms, units / ms / 1e9, "" if worst < 2e-2 else f"WRONG (rel err {worst:.1e})"))
            except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory on this GPU
                results.append((tile, math.nan, math.nan, f"ERROR {type(exc).__name__}: {str(exc)[:80]}"))
            finally:
                flash_attention._config = current_config
        best = max((r for r in results if not r[3]), key=lambda r: r[2], default=None)
        for tile, ms, rate, error in results:
            mark = ("*" if tile == chosen[kernel] else " ") + (" <- best" if best and tile == best[0] else "")
            print(f"  {kernel:5s} {str(tile):20s} {'fwd' if kernel == 'fwd' else 'fwd+bwd':8s} {ms:9.3f} ms "
                  f"{rate:7.1f} TFLOP/s {error or mark}")
            rows.append(dict(kernel=kernel, head_dim=head_dim, tile=tile, ms=ms, tflops=rate, error=error))
        if best:
            chosen[kernel] = best[0]
    return {k: chosen[k] for k in attention_tiles.KERNELS}, rows


# our kernels, once per backward variant: "triton" is the split backward, "triton_fused" the fused one
BACKWARD_OF = {"triton": "split", "triton_fused": "fused"}


@contextlib.contextmanager
def backward_variant(variant: str | None):
    """Run our kernels' backward as `variant` (attention_tiles.BACKWARD_ENV) inside the block."""
    previous = os.environ.get(attention_tiles.BACKWARD_ENV)
    if variant:
        os.environ[attention_tiles.BACKWARD_ENV] = variant
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(attention_tiles.BACKWARD_ENV, None)
        else:
            os.environ[attention_tiles.BACKWARD_ENV] = previous


def _implementations():
    impls = {name: lambda v: K.attention(*v) for name in BACKWARD_OF}
    impls["sdpa"] = lambda v: attention_dispatch.sdpa(*v, True, v[0].shape[-1] ** -0.5, native_gqa=False)
    if attention_dispatch.SDPA_HAS_GQA:
        impls["sdpa_gqa"] = lambda v: attention_dispatch.sdpa(*v, True, v[0].shape[-1] ** -0.5, native_gqa=True)
    return impls


def measure_dispatch(head_dim: int, seqs: list[int], dtype: torch.dtype, device: str, timer,
                     smoke: bool) -> dict[int, dict[str, float]]:
    """{seq: {implementation: fwd+bwd ms}} with the Triton kernels at the tiles in effect."""
    table = {}
    print(f"dispatch d={head_dim} causal fwd+bwd (ms, TFLOP/s, time / fastest)")
    for seq in seqs:
        views, leaves, flops = attention_inputs(seq, head_dim, dtype, device, smoke)
        grad = torch.randn_like(views[0])
        times = {}
        for name, fn in _implementations().items():
            def step(fn=fn, variant=BACKWARD_OF.get(name)):
                with backward_variant(variant):
                    fn(views).backward(grad)
            try:
                times[name] = timer(step, grad_to_none=leaves)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory at 16k with repeated heads
                print(f"  s={seq:6d} {name:9s} ERROR {type(exc).__name__}: {str(exc)[:80]}")
        fastest = min(times.values())
        for name, ms in times.items():
            print(f"  s={seq:6d} {name:12s} {ms:9.3f} ms {3.5 * flops / ms / 1e9:7.1f} TFLOP/s {ms / fastest:5.2f}x"
                  f"{'  <- fastest' if ms == fastest else ''}")
        table[seq] = {name: round(ms, 4) for name, ms in times.items()}
        del views, leaves, grad
    return table


def faster_backward(table: dict[int, dict[str, float]]) -> tuple[str, dict[int, dict[str, float]]]:
    """(the backward variant with the lower geometric-mean time over the lengths, the dispatch rows
    with "triton" = that variant's time): what `auto` runs is what the dispatch table holds."""
    both = [times for times in table.values() if "triton" in times and "triton_fused" in times]
    log_ratio = sum(math.log(t["triton_fused"] / t["triton"]) for t in both)
    variant = "fused" if both and log_ratio < 0 else "split"
    name = "triton_fused" if variant == "fused" else "triton"
    rows = {seq: {**{k: ms for k, ms in times.items() if k not in BACKWARD_OF},
                  **({"triton": times[name]} if name in times else {})} for seq, times in table.items()}
    return variant, rows


def precompile(head_dims: list[int], dtype: torch.dtype, jobs: int) -> None:
    """Compile every candidate in `jobs` processes first (Triton's on-disk cache is shared; the
    same shapes give the same cache keys), so the sweep times instead of compiling serially."""
    start = time.perf_counter()
    workers = [subprocess.Popen([sys.executable, __file__, "--precompile-shard", str(shard), str(jobs), "--dtype",
                                 str(dtype).removeprefix("torch."), "--head-dims", *map(str, head_dims)])
               for shard in range(jobs)]
    failed = sum(worker.wait() != 0 for worker in workers)
    print(f"precompiled the candidates in {jobs} processes: {time.perf_counter() - start:.0f} s"
          + (f" ({failed} failed: their candidates compile while timed)" if failed else ""))


def precompile_shard(shard: int, shards: int, head_dims: list[int], dtype: torch.dtype) -> None:
    """One precompile process: launch its share of the candidates once at the sweep's shape."""
    base = flash_attention._config
    jobs = [(d, kernel, tile) for d in head_dims for kernel in attention_tiles.KERNELS for tile in CANDIDATES[d][kernel]]
    for d, kernel, tile in jobs[shard::shards]:
        views, leaves, _ = attention_inputs(4096, d, dtype, "cuda")
        flash_attention._config = lambda *a, kernel=kernel, tile=tile, **kw: dict(base(*a, **kw), **{kernel: tile})
        try:
            K.attention(*views).backward(torch.ones_like(views[0]))
        except Exception as exc:  # noqa: BLE001 - the sweep reports it when it times this tile
            print(f"  precompile d={d} {kernel} {tile}: {type(exc).__name__}: {str(exc)[:100]}")
        finally:
            flash_attention._config = base
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def load_tables(path: str) -> None:
    """Put the tables a --json run wrote in effect in this process (what pasting its lines gives)."""
    saved = json.load(open(path))
    for key, tiles in saved["tiles"].items():
        arch, head_dim, dtype, causal, dropout = json.loads(key)
        attention_tiles.MEASURED[(arch, head_dim, dtype, causal, dropout)] = {k: tuple(t) for k, t in tiles.items()}
    for key, rows in saved["dispatch_ms"].items():
        arch, head_dim, dtype, causal = json.loads(key)
        attention_dispatch.MEASURED_MS[(arch, head_dim, dtype, causal)] = {int(s): ms for s, ms in rows.items()}
    for key, variant in saved.get("backward", {}).items():
        attention_tiles.MEASURED_BACKWARD[tuple(json.loads(key))] = variant
    attention_dispatch._auto.cache_clear()


@reports_usage_errors
def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="dispatch at s 1k, 4k, 16k only")
    parser.add_argument("--head-dims", type=int, nargs="*", default=[128, 64])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json", help="write the tuned tiles and dispatch times here")
    parser.add_argument("--jobs", type=int, default=8, help="processes that compile the candidates first (GPU)")
    parser.add_argument("--precompile-shard", type=int, nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="CPU self-test: tiny shapes, interpreter, wall clock")
    args = parser.parse_args(argv)
    if args.precompile_shard:
        os.environ["MEGALITE_KERNEL_BACKEND"] = "triton"
        precompile_shard(*args.precompile_shard, args.head_dims, getattr(torch, args.dtype))
        return 0
    if not torch.cuda.is_available() and not args.smoke:
        print("tune_attention needs a GPU (or --smoke to test this script on CPU)")
        return 1
    os.environ["MEGALITE_KERNEL_BACKEND"] = "triton"
    device, dtype = ("cuda" if torch.cuda.is_available() else "cpu"), getattr(torch, args.dtype)
    if args.smoke:
        dtype = torch.float32  # the interpreter has no bfloat16 dot (numpy lacks the type)
    arch = attention_tiles.cuda_arch(torch.cuda.current_device()) if device == "cuda" else "interpreter"
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'} ({arch})")
    timer = make_timer(args.smoke)
    if device == "cuda" and args.jobs > 1:
        precompile(args.head_dims, dtype, args.jobs)
    seqs = [24] if args.smoke else ([1024, 4096, 16384] if args.quick else [1024, 2048, 4096, 8192, 16384])
    tuned, dispatch, backward, lines, wrong = {}, {}, {}, [], False
    for head_dim in ([16] if args.smoke else args.head_dims):
        candidates = SMOKE_CANDIDATES if args.smoke else CANDIDATES[head_dim]
        tiles, rows = tune_tiles(head_dim, 24 if args.smoke else 4096, dtype, device, timer, candidates, args.smoke)
        wrong |= any(r["error"].startswith("WRONG") for r in rows)
        key = (arch, head_dim, attention_tiles.dtype_name(dtype), True, False)
        tuned[json.dumps(key)] = tiles
        attention_tiles.MEASURED[key] = tiles  # the dispatch sweep times the tuned kernels
        lines.append(attention_tiles.table_line(arch, head_dim, dtype, True, False, tiles))
        variant, table = faster_backward(measure_dispatch(head_dim, seqs, dtype, device, timer, args.smoke))
        dispatch[json.dumps(key[:4])], backward[json.dumps(key)] = table, variant
        attention_tiles.MEASURED_BACKWARD[key] = variant
        lines += [f"    {key[:4]!r}: {table!r},", f"    {key!r}: {variant!r},  # MEASURED_BACKWARD"]
    print("lines for kernels/attention_tiles.py MEASURED and MEASURED_BACKWARD, kernels/attention_dispatch.py "
          f"MEASURED_MS ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}):")
    print("\n".join(lines))
    if args.json:
        json.dump({"tiles": tuned, "dispatch_ms": dispatch, "backward": backward}, open(args.json, "w"), indent=1)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
