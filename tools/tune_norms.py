"""Time candidate launch configs of the norm kernels and RoPE on a GPU and name the fastest.

    python tools/tune_norms.py                 # bf16: rms_norm, layer_norm at 8192 x {4096, 8192, 768},
                                               # rope s4096 x b2 x n32 x d128 (about a minute on an H100)
    python tools/tune_norms.py --smoke         # CPU self-test: interpreter, tiny shapes, wall clock

Each kernel direction is swept on its own, the other direction kept at its default: forward
candidates (rows per tile, warps) are timed forward only; backward candidates (rows per tile,
warps, persistent programs per SM) are timed forward + backward. The candidate replaces the
module's config function (`_forward_config` / `_backward_config`, rope's `_num_warps`), as
tools/tune_attention.py replaces flash_attention._config. Timing replays a CUDA graph
(`triton.testing.do_bench_cudagraph`, median), so host overhead (Python, autograd, launches) is
not in the numbers; where capture fails the row says so and `triton.testing.do_bench` times it.
Rates are GB/s of the minimum traffic, the byte counts of tools/bench_kernel_cases.py (norms:
forward x, y; forward + backward adds x, dy, dx; rope: forward x, y; backward dy, dx), and their
percentage of a 1 GiB device-to-device copy timed the same way in the same run. A candidate whose
output or gradients differ from the default config's by more than bf16 rounding (relative error
>= 1e-2 of the largest value) is marked WRONG, never best. The last lines are the measured
tables to paste into kernels/rms_norm.py, kernels/layer_norm.py and kernels/rope.py.
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import dataclasses
import importlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import megalite.kernels as K  # noqa: E402
from megalite.kernels.dispatch import next_power_of_2  # noqa: E402
from megalite.kernels.norm_config import NormConfig  # noqa: E402

KERNELS = ["rms_norm", "layer_norm", "rope"]
NORM_SHAPES = [(8192, 4096), (8192, 8192), (8192, 768)]  # (tokens, hidden)
ROPE_SHAPE = (4096, 2, 32, 128)  # (s, b, n_heads, d)
SMOKE_NORM_SHAPES, SMOKE_ROPE_SHAPE = [(40, 96)], (6, 2, 3, 16)
WRONG_TOLERANCE = 1e-2  # bf16 keeps 8 bits: a different reduction order moves results by ~4e-3 at most

# Candidates as (rows, num_warps) forward and (rows, num_warps, programs_per_sm) backward, for wide
# rows (BLOCK >= 4096: one or two rows per tile) and narrow ones (several rows per tile); those
# giving a thread more than 32 or fewer than 4 elements of a tile are skipped (spills, idle lanes).
FORWARD_CANDIDATES = {"wide": [(1, 8), (1, 16), (2, 16), (1, 32), (2, 8)],
                      "narrow": [(1, 4), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16)]}
BACKWARD_CANDIDATES = {"wide": [(1, 16, 1), (1, 16, 2), (1, 8, 2), (2, 16, 1), (1, 32, 1), (1, 8, 3)],
                       "narrow": [(1, 4, 4), (2, 4, 4), (2, 8, 2), (2, 8, 4), (4, 8, 2), (4, 16, 1), (8, 16, 1)]}
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402
ROPE_WARPS = [1, 2, 4, 8]
ELEMENTS_PER_THREAD = (4, 32)


@dataclass
class Sweep:
    """One kernel direction at one shape: what to patch, what to time, what it computes."""
    kernel: str  # "rms_norm", "layer_norm", "rope"
    shape: str
    direction: str  # "fwd" (timed alone) or "bwd" (timed as fwd+bwd)
    module: object
    attribute: str  # the config function a candidate replaces
    block: object  # the key of the module's config table
    default: object
    candidates: list
    timed: Callable[[], object]
    leaves: list  # gradients reset between timed calls
    outputs: Callable[[], list]  # output and every input gradient, float32
    bytes: int


def norm_sweeps(name: str, tokens: int, hidden: int, device: str, dtype: torch.dtype, smoke: bool) -> list[Sweep]:
    module = importlib.import_module(f"megalite.kernels.{name}")
    op = K.rms_norm if name == "rms_norm" else K.layer_norm
    leaves = [torch.randn(tokens, hidden, device=device, dtype=dtype)]
    leaves += [torch.randn(hidden, device=device, dtype=dtype) for _ in range(1 if name == "rms_norm" else 2)]
    leaves = [t.requires_grad_() for t in leaves]
    grad = torch.randn(tokens, hidden, device=device, dtype=dtype)
    activation = tokens * hidden * leaves[0].element_size()
    block = next_power_of_2(hidden)
    width = "wide" if block >= 4096 else "narrow"
    count = 3 if smoke else None
    low, high = ELEMENTS_PER_THREAD if not smoke else (0, math.inf)
    forward = [NormConfig(*c) for c in FORWARD_CANDIDATES[width] if low <= c[0] * block / (32 * c[1]) <= high]
    backward = [NormConfig(*c) for c in BACKWARD_CANDIDATES[width] if low <= c[0] * block / (32 * c[1]) <= high]
    forward, backward = forward[:count], backward[:count]
    dev = torch.device(device)
    shape = f"{tokens}x{hidden}"
    common = dict(module=module, block=block, leaves=leaves,
                  outputs=lambda: _outputs(lambda: op(*leaves), grad, leaves))
    return [Sweep(name, shape, "fwd", attribute="_forward_config", default=module._forward_config(hidden, dev),
                  candidates=forward, timed=lambda: op(*leaves), bytes=2 * activation, **common),
            Sweep(name, shape, "bwd", attribute="_backward_config", default=module._backward_config(hidden, dev),
                  candidates=backward, timed=lambda: op(*leaves).backward(grad), bytes=5 * activation, **common)]


def rope_sweeps(seq: int, batch: int, heads: int, dim: int, device: str, dtype: torch.dtype,
                smoke: bool) -> list[Sweep]:
    """Warps of the rotation kernel (forward and backward alike), timed forward and forward + backward."""
    module = importlib.import_module("megalite.kernels.rope")
    angles = torch.rand(seq, dim // 2, device=device) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    x = torch.randn(seq, batch, heads, dim, device=device, dtype=dtype).requires_grad_()
    grad = torch.randn_like(x)
    size = x.numel() * x.element_size()
    common = dict(kernel="rope", shape=f"s{seq}xb{batch}xn{heads}xd{dim}", module=module, attribute="_num_warps",
                  block=(next_power_of_2(heads), next_power_of_2(dim // 2)),
                  candidates=ROPE_WARPS[:3 if smoke else None],
                  default=module._num_warps(heads, dim, torch.device(device)), leaves=[x],
                  outputs=lambda: _outputs(lambda: K.rope(x, cos, sin), grad, [x]))
    return [Sweep(direction="fwd", timed=lambda: K.rope(x, cos, sin), bytes=2 * size, **common),
            Sweep(direction="bwd", timed=lambda: K.rope(x, cos, sin).backward(grad), bytes=4 * size, **common)]


def _outputs(forward: Callable, grad: torch.Tensor, leaves: list) -> list:
    for t in leaves:
        t.grad = None
    out = forward()
    out.backward(grad)
    return [out.detach().float()] + [t.grad.float() for t in leaves]


def make_timer(smoke: bool) -> Callable:
    """timer(fn, grad_to_none) -> (ms, how): CUDA-graph replay on a GPU, wall clock in --smoke."""
    if smoke:
        def wall_clock(fn, grad_to_none=None):
            fn()
            times = []
            for _ in range(3):
                for t in grad_to_none or []:
                    t.grad = None
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return 1e3 * sorted(times)[1], "wall clock"
        return wall_clock
    import triton.testing  # optional (Linux only, setup.py): only the GPU timers need it

    def graph_replay(fn, grad_to_none=None):
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=10, grad_to_none=grad_to_none, return_mode="median"), \
                "graph"
        except Exception as exc:  # noqa: BLE001 - capture can fail (e.g. a host sync): time with launches
            torch.cuda.synchronize()
            ms = triton.testing.do_bench(fn, warmup=10, rep=25, grad_to_none=grad_to_none, return_mode="median")
            return ms, f"NO GRAPH ({type(exc).__name__}): host overhead included"
    return graph_replay


def copy_ceiling(timer, device: str, smoke: bool) -> float:
    """GB/s of a 1 GiB device-to-device copy (4 MiB in --smoke), timed like the candidates."""
    n_bytes = 2**30 if not smoke else 2**22
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms, how = timer(lambda: dst.copy_(src))
    if not smoke:
        # a copy_ captured in a graph ran at 2.77 TB/s on an H200 against 4.25 eagerly, while an SM
        # elementwise copy reached 4.29 in the graph: the ceiling is the faster of the two clocks
        import triton.testing  # optional (Linux only, setup.py): only the GPU timers need it

        eager_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
        ms, how = min((ms, how), (eager_ms, "events"))
    print(f"ceiling: copy {2 * n_bytes / ms / 1e6:.0f} GB/s (1 GiB device-to-device, {how})")
    return 2 * n_bytes / ms / 1e6


def run_sweep(sweep: Sweep, timer, copy_gbps: float) -> dict:
    """Time every candidate of one sweep; return {config: (ms, verdict, note)} and print a line each
    (verdict: WRONG or ERROR, such a candidate is never best; note: how it was timed if not a graph)."""
    original = getattr(sweep.module, sweep.attribute)
    expected = sweep.outputs()  # the default config's results
    results = {}
    for config in dict.fromkeys([sweep.default, *sweep.candidates]):
        setattr(sweep.module, sweep.attribute, lambda *args, config=config: config)
        try:
            worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
                        for a, b in zip(sweep.outputs(), expected))
            if not worst < WRONG_TOLERANCE:  # NaN (an unwritten element) is wrong too
                results[config] = (math.nan, f"WRONG (rel err {worst:.1e})", "")
                continue
            ms, how = timer(sweep.timed, grad_to_none=sweep.leaves)
            results[config] = (ms, "", "" if how in ("graph", "wall clock") else how)
        except Exception as exc:  # noqa: BLE001 - e.g. out of resources for this tile on this GPU
            results[config] = (math.nan, f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:80]}", "")
        finally:
            setattr(sweep.module, sweep.attribute, original)
    best = _best(results)
    mode = "fwd" if sweep.direction == "fwd" else "fwd+bwd"
    print(f"{sweep.kernel} {sweep.shape} {sweep.direction} candidates, timed {mode} (* = current default)")
    for config, (ms, verdict, note) in results.items():
        rate = sweep.bytes / ms / 1e6 if ms == ms else math.nan
        mark = ("*" if config == sweep.default else " ") + (" <- best" if config == best else "")
        print(f"  {_name(config):52s} {ms:8.3f} ms {rate:8.1f} GB/s {100 * rate / copy_gbps:6.1f}% of copy"
              f"  {verdict or mark} {note}".rstrip())
    return results


def _best(results: dict):
    timed = [(ms, config) for config, (ms, verdict, _) in results.items() if ms == ms and not verdict]
    return min(timed, key=lambda pair: pair[0])[1] if timed else None


def _name(config) -> str:
    return repr(config) if isinstance(config, NormConfig) else f"num_warps={config}"


def measured_tables(sweeps: list[Sweep], results: list[dict]) -> dict[tuple[str, str], dict]:
    """{(module, table name): {key: fastest config}} from the sweeps' results."""
    tables: dict[tuple[str, str], dict] = {}
    for sweep, result in zip(sweeps, results):
        best = _best(result)
        if best is None or (sweep.attribute == "_num_warps" and sweep.direction == "fwd"):
            continue  # rope's one setting serves both directions: chosen by forward + backward
        table = {"_forward_config": "FORWARD_CONFIGS", "_backward_config": "BACKWARD_CONFIGS",
                 "_num_warps": "NUM_WARPS"}[sweep.attribute]
        tables.setdefault((sweep.kernel, table), {})[sweep.block] = best
    return tables


def save_tables(tables: dict, path: str) -> None:
    """JSON of the measured tables, for `load_tables` (tools/bench_kernels.py --tables)."""
    rows = [dict(module=module, table=table, entries=[[key, list(dataclasses.astuple(value))
                                                       if isinstance(value, NormConfig) else value]
                                                      for key, value in entries.items()])
            for (module, table), entries in tables.items()]
    json.dump({"norm_tables": rows}, open(path, "w"), indent=1)


def load_tables(path: str) -> None:
    """Put the tables a --json run wrote in effect in this process (what pasting its lines gives)."""
    for row in json.load(open(path))["norm_tables"]:
        table = getattr(importlib.import_module(f"megalite.kernels.{row['module']}"), row["table"])
        for key, value in row["entries"]:
            table[tuple(key) if isinstance(key, list) else key] = NormConfig(*value) if isinstance(value, list) \
                else value


def paste_lines(sweeps: list[Sweep], results: list[dict]) -> list[str]:
    """The measured tables, one line per module and table, ready to replace the empty ones."""
    tables = measured_tables(sweeps, results)
    lines = []
    for (kernel, table), entries in tables.items():
        kind = "dict[tuple[int, int], int]" if table == "NUM_WARPS" else "dict[int, NormConfig]"
        body = ", ".join(f"{key!r}: {value!r}" for key, value in sorted(entries.items()))
        lines.append(f"kernels/{kernel}.py: {table}: {kind} = {{{body}}}")
    return lines


def build_sweeps(kernels: list[str], device: str, dtype: torch.dtype, smoke: bool) -> list[Sweep]:
    sweeps = []
    for name in (k for k in ("rms_norm", "layer_norm") if k in kernels):
        for tokens, hidden in (SMOKE_NORM_SHAPES if smoke else NORM_SHAPES):
            sweeps += norm_sweeps(name, tokens, hidden, device, dtype, smoke)
    if "rope" in kernels:
        sweeps += rope_sweeps(*(SMOKE_ROPE_SHAPE if smoke else ROPE_SHAPE), device, dtype, smoke)
    return sweeps


@reports_usage_errors
def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--kernels", nargs="*", default=KERNELS, choices=KERNELS, help="which kernels to sweep")
    parser.add_argument("--smoke", action="store_true", help="CPU self-test: tiny shapes, interpreter, wall clock")
    parser.add_argument("--json", help="also write the measured tables here (tools/bench_kernels.py --tables)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print("tune_norms needs a GPU (or --smoke to test this script on CPU)")
        return 1
    started = time.perf_counter()
    os.environ["MEGALITE_KERNEL_BACKEND"] = "triton"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if not args.smoke else torch.float32  # the interpreter has no bf16 dot
    if device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {__import__('triton').__version__}")
    timer = make_timer(args.smoke)
    copy_gbps = copy_ceiling(timer, device, args.smoke)
    sweeps = build_sweeps(args.kernels, device, dtype, args.smoke)
    results = [run_sweep(sweep, timer, copy_gbps) for sweep in sweeps]
    print("fastest configs, to paste over the tables of the same name:")
    for line in paste_lines(sweeps, results):
        print(f"  {line}")
    if args.json:
        save_tables(measured_tables(sweeps, results), args.json)
    print(f"tune_norms finished in {time.perf_counter() - started:.0f} s")
    return 0 if not any(v.startswith("WRONG") for result in results for _, v, _ in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
