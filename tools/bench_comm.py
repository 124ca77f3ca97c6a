#!/usr/bin/env python3
"""Communication benchmark over megalite.distributed.comm: algorithm and bus bandwidth per op and size.

    python tools/bench_comm.py --world-size 4 --tp 2 --group tp            # forks gloo ranks on CPU
    torchrun --nproc_per_node 8 tools/bench_comm.py --tp 8 --group tp      # NCCL on GPUs
    torchrun --nnodes 2 --nproc_per_node 8 ... tools/bench_comm.py --tp 8 --group dp --max-bytes 1G

Conventions are nccl-tests' (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md), and also
megalite.distributed.comm.ledger's: `size` is the whole buffer of one rank (all_gather: the gathered output;
reduce_scatter and all_to_all: the full input; send_recv: the bytes sent). algbw = size / time;
busbw = algbw * factor, factor = 2(n-1)/n for all_reduce, (n-1)/n for all_gather,
reduce_scatter and all_to_all, 1 for send_recv (each rank sends to the next in the group and
receives from the previous). busbw is comparable across ops and group sizes: it is the
bandwidth the busiest link sustained. GB/s = 1e9 bytes/s. Time is the slowest rank's.

Every figure is also printed as % of a ceiling measured in the same run: a local device copy of
the largest buffer (memory bandwidth; an NVLink or network link is slower).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings

import torch

from megalite.distributed import comm, mesh as mesh_lib
from megalite.plan import bus_factor
from megalite.errors import UsageError, reports_usage_errors
from megalite.cli import OneLineParser
from megalite.testing import run_distributed

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_size(text: str) -> int:
    """'64', '4K', '64M', '1G' -> bytes (binary multiples, as nccl-tests' -b/-e)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"cannot read a size from {text!r}; write e.g. 4K, 64M or 1G")
    return int(match.group(1)) * {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}[match.group(2)]


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= --min-bytes <= --max-bytes and --factor >= 2, got {min_bytes}, {max_bytes}, "
                         f"{factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def bandwidths(op: str, size_bytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s with nccl-tests' conventions."""
    algbw = size_bytes / seconds
    return algbw, algbw * (bus_factor(op, n) if op != "send_recv" else 1.0)


def _group_of(group_name: str, mesh) -> tuple[object, list[int]]:
    """The process group and its global ranks for --group."""
    tp, pp, dp = mesh.tp_size, mesh.pp_size, mesh.dp_size
    if group_name == "world":
        return comm.world_group(), list(range(mesh.world_size))
    table = {"tp": (mesh.tp_group, mesh_lib.tp_group_ranks), "dp": (mesh.dp_group, mesh_lib.dp_group_ranks),
             "pp": (mesh.pp_group, mesh_lib.pp_group_ranks)}[group_name]
    ranks = next(r for r in table[1](tp, pp, dp) if mesh.rank in r)
    return table[0], ranks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _op_runner(op: str, size: int, dtype: torch.dtype, device: torch.device, group, ranks: list[int], me: int):
    """A zero-argument function doing one `op` of `size` bytes (rounded to whole elements per rank)."""
    n = len(ranks)
    elements = size // torch.tensor([], dtype=dtype).element_size()
    per_rank = max(1, elements // n)
    full = per_rank * n
    if op == "all_reduce":
        buf = torch.ones(full, dtype=dtype, device=device)
        return lambda: comm.all_reduce(buf, group)
    if op == "all_gather":
        inp, out = torch.ones(per_rank, dtype=dtype, device=device), torch.empty(full, dtype=dtype, device=device)
        return lambda: comm.all_gather_into(out, inp, group)
    if op == "reduce_scatter":
        inp, out = torch.ones(full, dtype=dtype, device=device), torch.empty(per_rank, dtype=dtype, device=device)
        return lambda: comm.reduce_scatter_into(out, inp, group)
    if op == "all_to_all":
        inp, out = torch.ones(full, dtype=dtype, device=device), torch.empty(full, dtype=dtype, device=device)
        return lambda: comm.all_to_all(out, inp, group)
    position = ranks.index(me)
    send, recv = torch.ones(full, dtype=dtype, device=device), torch.empty(full, dtype=dtype, device=device)
    nxt, prev = ranks[(position + 1) % n], ranks[(position - 1) % n]
    return lambda: comm.wait_all(comm.batch_isend_irecv(
        [comm.P2P("send", send, nxt), comm.P2P("recv", recv, prev)], group))


def _copy_bandwidth(size: int, device: torch.device, iters: int) -> float:
    src = torch.ones(max(1, size // 4), device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * 4 * iters / (time.perf_counter() - start)  # read + write


def benchmark(ops: list[str], sizes: list[int], group_name: str = "world", tp: int = 1, pp: int = 1,
              dtype: str = "fp32", iters: int = 20, warmup: int = 5) -> dict:
    """Run in every rank (after torchrun or run_distributed set the environment); returns rows."""
    mesh = mesh_lib.init_mesh(tp=tp, pp=pp)
    group, ranks = _group_of(group_name, mesh)
    n, device = len(ranks), mesh.device
    if n < 2:
        raise ValueError(f"group {group_name!r} has one rank: nothing to measure; choose a group of 2 or more "
                         f"ranks (e.g. --group world, or a larger --tp)")
    rows = []
    for op in ops:
        for size in sizes:
            run = _op_runner(op, size, DTYPES[dtype], device, group, ranks, mesh.rank)
            for _ in range(warmup):
                run()
            _sync(device)
            comm.barrier(group)
            start = time.perf_counter()
            for _ in range(iters):
                run()
            _sync(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
            comm.all_reduce(elapsed, group, op="max")
            seconds = float(elapsed)
            element = torch.tensor([], dtype=DTYPES[dtype]).element_size()
            actual = max(1, size // element // n) * n * element  # the bytes really moved per rank
            algbw, busbw = bandwidths(op, actual, seconds, n)
            rows.append(dict(op=op, size_bytes=actual, time_us=1e6 * seconds, algbw_gbps=algbw / 1e9,
                             busbw_gbps=busbw / 1e9))
    ceiling = _copy_bandwidth(max(sizes), device, max(3, iters // 4))
    return dict(backend=mesh.backend, world_size=mesh.world_size, group=group_name, group_ranks=ranks,
                dtype=dtype, device=str(device), copy_gbps=ceiling / 1e9, rows=rows, rank=mesh.rank)


def format_report(result: dict) -> str:
    lines = [f"# bench_comm: backend {result['backend']}, world {result['world_size']}, group {result['group']} "
             f"(n={len(result['group_ranks'])}, ranks {result['group_ranks']}), {result['dtype']} on {result['device']}",
             f"# ceiling: local copy {result['copy_gbps']:.2f} GB/s (read+write of the largest buffer)",
             f"# {'op':>14} {'size(B)':>12} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'%copy':>6}"]
    for r in result["rows"]:
        lines.append(f"  {r['op']:>14} {r['size_bytes']:>12} {r['time_us']:>10.1f} {r['algbw_gbps']:>12.3f} "
                     f"{r['busbw_gbps']:>12.3f} {100 * r['busbw_gbps'] / result['copy_gbps']:>6.1f}")
    return "\n".join(lines)


def _check(args) -> None:
    """UsageError naming the first argument the benchmark cannot run with (before any rank starts)."""
    for name in ("tp", "pp", "iters"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} {getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        raise UsageError(f"--warmup {args.warmup}: must be >= 0")
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes or args.factor < 2:
        raise UsageError(f"need 1 <= --min-bytes <= --max-bytes and --factor >= 2, got {args.min_bytes}, "
                         f"{args.max_bytes}, {args.factor}")
    world = int(os.environ.get("WORLD_SIZE", 0)) or args.world_size or args.tp * args.pp * 2
    if world < 1 or world % (args.tp * args.pp):
        raise UsageError(f"--world-size {world} is not a multiple of tp*pp = {args.tp * args.pp}; give a multiple "
                         f"(default tp*pp*2)")


def _forked_rank(kwargs: dict) -> dict:
    return benchmark(**kwargs)


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--group", default="world", choices=["world", "tp", "dp", "pp"])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to fork on CPU/gloo when not launched by torchrun (default tp*pp*2)")
    parser.add_argument("--min-bytes", type=parse_size, default=parse_size("4K"))
    parser.add_argument("--max-bytes", type=parse_size, default=parse_size("16M"))
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    # torch 2.13 deprecates the *_tensor collective names megalite.distributed.comm calls (still correct)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {list(OPS)}")
    _check(args)
    kwargs = dict(ops=ops, sizes=size_sweep(args.min_bytes, args.max_bytes, args.factor), group_name=args.group,
                  tp=args.tp, pp=args.pp, dtype=args.dtype, iters=args.iters, warmup=args.warmup)
    if "RANK" in os.environ:  # launched by torchrun: this process is one rank
        result = benchmark(**kwargs)
        mesh_lib.destroy_mesh()
        if result["rank"] != 0:
            return 0
    else:
        world = args.world_size or args.tp * args.pp * 2
        result = run_distributed(_forked_rank, world, kwargs, timeout_s=600)[0]
    print(json.dumps(result, indent=1) if args.json else format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
