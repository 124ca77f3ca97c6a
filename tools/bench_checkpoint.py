"""Checkpoint save/load time and the time training is blocked, sync vs async, on this machine.

    python tools/bench_checkpoint.py                          # ~67M-param GPT (270 MB fp32 weights), 1 rank
    python tools/bench_checkpoint.py --world 2 --zero 1       # 2 forked gloo ranks (dp=2, ZeRO-1)
    python tools/bench_checkpoint.py --hidden-size 1024 --num-layers 12 --trials 3 --dir /fast/disk
    python tools/bench_checkpoint.py --world 4 --zero 3 --dp-shard 2 --num-layers 2   # a hybrid layout

A checkpoint holds the weights (param dtype) and the fp32 master weights and both Adam
moments, so an fp32 model writes 16 bytes per parameter. Per trial (sync and async,
in alternating order, so drift on a shared machine hits both alike):
- sync save: training is blocked for the whole save (copy, write, fsync, hash, publish);
- async save: blocked = the copy to CPU memory (plus the index gather); total = until published;
- load: plan + sha256 verification + copy into the model and optimizer (from the page cache
  right after a save; a cold read adds the disk's read time).
Ceilings measured in the same run: a plain buffered write + fsync of the same bytes (disk)
and a memcpy of them into touched memory (the best an async snapshot can do). Medians over the trials.
The last line gives the seconds as tools/plan.py --goodput takes them (--checkpoint-save-s, -load-s).
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from megalite.errors import reports_usage_errors
from megalite.cli import OneLineParser
from megalite.distributed import mesh as mesh_mod
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.model import preset
from megalite.config import RunConfig
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer
from megalite.testing import run_distributed


def _ceilings(nbytes: int, directory: Path) -> dict:
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    copy = torch.ones_like(buffer)  # pages touched: the copy below measures bandwidth, not page faults
    started = time.perf_counter()
    copy.copy_(buffer)
    copy_s = time.perf_counter() - started
    path = directory / "ceiling.bin"
    started = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(copy.numpy()))
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - started
    path.unlink()
    return {"memcpy_s": copy_s, "write_fsync_s": write_s}


def _bench_rank(args, directory: str) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world))
    mesh = mesh_mod.init_mesh(tp=1, pp=1, dp=args.world, dp_shard=args.dp_shard)
    model = preset("tiny", num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=12,
                   vocab_size=args.vocab_size, seq_length=args.seq_length)
    cfg = RunConfig.build(dp=args.world, zero=args.zero, micro_batch_size=1, global_batch_size=args.world,
                          dp_shard=args.dp_shard)
    chunks = build_model_chunks(model, cfg, mesh)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, mesh), cfg)
    quiet = dict(log=lambda *_: None)
    root = Path(directory)
    results: dict[str, list[float]] = {k: [] for k in ("sync_blocked_s", "async_blocked_s", "async_total_s", "load_s")}
    for trial in range(args.trials):
        for mode in (("sync", "async") if trial % 2 == 0 else ("async", "sync")):  # neither always goes first
            target = root / f"{mode}{trial}"
            checkpointer = Checkpointer(target, mesh, async_save=mode == "async", **quiet)
            started = time.perf_counter()
            checkpointer.save(trial + 1, chunks, optimizer, consumed_samples=0, model_config=model, train_config=cfg)
            blocked = time.perf_counter() - started
            checkpointer.finish()
            total = time.perf_counter() - started
            results[f"{mode}_blocked_s"].append(blocked)
            written = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
            if mode == "async":
                results["async_total_s"].append(total)
        started = time.perf_counter()
        load_checkpoint(root / f"sync{trial}", chunks, optimizer, mesh, **quiet)
        results["load_s"].append(time.perf_counter() - started)
        for mode in ("sync", "async"):
            if mesh.rank == 0:
                shutil.rmtree(root / f"{mode}{trial}")
        mesh_mod.comm.barrier(mesh_mod.comm.world_group())
    sizes = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    medians = {k: statistics.median(v) for k, v in results.items()}
    return {"params": model.num_params(), "local_params": sizes, "bytes": written, **medians}


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--world", type=int, default=1, help="forked gloo ranks (dp)")
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    parser.add_argument("--dp-shard", type=int, default=None, help="hybrid sharding: ZeRO over groups of S ranks "
                        "(replica group 0 writes the shards)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)

    directory = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    try:
        if args.world == 1:
            rank_results = [_bench_rank(args, str(directory))]
        else:
            rank_results = run_distributed(_bench_rank, args.world, args, str(directory), timeout_s=3600)
        r = rank_results[0]
        nbytes = r["bytes"]  # on disk: weights fp32 + master + exp_avg + exp_avg_sq (+ index, RNG)
        ceilings = _ceilings(nbytes, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    gb = nbytes / 1e9
    print(f"bench_checkpoint: {r['params'] / 1e6:.1f}M params, checkpoint {gb:.2f} GB on disk, world {args.world}, "
          f"zero {args.zero}, {args.trials} trials (medians), torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"ceilings: write+fsync {ceilings['write_fsync_s']:.2f} s ({gb / ceilings['write_fsync_s']:.2f} GB/s), "
          f"memcpy {ceilings['memcpy_s']:.3f} s ({gb / ceilings['memcpy_s']:.1f} GB/s)")
    rows = [("sync save (blocked = total)", r["sync_blocked_s"], ceilings["write_fsync_s"], True),
            ("async save: training blocked", r["async_blocked_s"], ceilings["memcpy_s"], True),
            ("async save: until published", r["async_total_s"], ceilings["write_fsync_s"], False),
            ("load (verify + copy)", r["load_s"], None, False)]
    print(f"{'':34} {'seconds':>8} {'GB/s':>7} {'vs ceiling':>11} {'blocked vs sync':>16}")
    for name, seconds, ceiling, is_blocked in rows:
        vs = f"{ceiling / seconds:.0%}" if ceiling else "-"
        blocked = f"{seconds / r['sync_blocked_s']:.2f}x" if is_blocked else "-"
        print(f"{name:34} {seconds:8.2f} {gb / seconds:7.2f} {vs:>11} {blocked:>16}")
    print(f"for tools/plan.py --goodput: --checkpoint-save-s {r['async_blocked_s']:.3g} (async; sync "
          f"{r['sync_blocked_s']:.3g}) --checkpoint-load-s {r['load_s']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
