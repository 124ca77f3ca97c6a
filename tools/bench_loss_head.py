"""The loss head (output layer + vocab-parallel cross entropy), fused vs unfused: time and peak memory.

    python tools/bench_loss_head.py                                  # 2048 tokens, h 512, vocab 50257
    python tools/bench_loss_head.py --tokens 8192 --hidden 4096 --vocab 128256 --bf16   # on a GPU

Each variant runs forward + backward of `final hidden [s, b, h] -> per-token losses -> sum` in
its own fresh process (so one's allocations cannot hide the other's), one device, tp=1. Peak
memory: torch.cuda.max_memory_allocated on a GPU; on CPU the growth of the process's peak RSS
(ru_maxrss) over what it held once the inputs existed, which includes allocator slack. Prints
each variant's median step time and peak, and the ratios fused / unfused.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.fused_cross_entropy import vocab_parallel_linear_cross_entropy
from megalite.tensor_parallel.layers import linear
from megalite.errors import reports_usage_errors
from megalite.cli import OneLineParser


def run_variant(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    padded = -(-args.vocab // 128) * 128
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, 1, args.hidden, generator=gen).to(device, dtype).requires_grad_(True)
    weight = (torch.randn(padded, args.hidden, generator=gen) * 0.02).to(device, dtype).requires_grad_(True)
    targets = torch.randint(0, args.vocab, (args.tokens, 1), generator=gen).to(device)

    def step():
        if args.variant == "fused":
            losses = vocab_parallel_linear_cross_entropy(hidden, weight, targets, None, vocab_size=args.vocab,
                                                         chunk_tokens=args.chunk_tokens)
        else:
            losses = vocab_parallel_cross_entropy(linear(hidden, weight), targets, None, vocab_size=args.vocab)
        losses.sum().backward()
        hidden.grad = weight.grad = None
        return losses

    # the peak is measured from here (inputs allocated), over the warm-up and the timed steps:
    # ru_maxrss only ever grows, so the baseline must precede the first step
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()  # warm-up (kernels compiled)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step().sum().item()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"variant": args.variant, "median_s": statistics.median(times), "peak_bytes": peak, "loss_sum": loss,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}


@reports_usage_errors
def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="fused: tokens per chunk (default ~256 MB "
                                                                         "of logits)")
    parser.add_argument("--variant", choices=["fused", "unfused"], help=argparse.SUPPRESS)  # child process
    args = parser.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0
    results = {}
    for variant in ("unfused", "fused"):
        child = [sys.executable, __file__, "--variant", variant] + (argv if argv is not None else sys.argv[1:])
        out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    u, f = results["unfused"], results["fused"]
    logits_mb = args.tokens * (-(-args.vocab // 128) * 128) * (2 if args.bf16 else 4) / 2**20
    print(f"loss head: {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab}, "
          f"{'bf16' if args.bf16 else 'fp32'}, {u['device']}, torch {u['torch']}; logits would be {logits_mb:.0f} MiB")
    for r in (u, f):
        print(f"  {r['variant']:8s} {1e3 * r['median_s']:9.1f} ms/step   peak +{r['peak_bytes'] / 2**20:8.0f} MiB   "
              f"loss sum {r['loss_sum']:.6f}")
    print(f"  fused / unfused: time {f['median_s'] / u['median_s']:.2f}x, "
          f"peak memory {f['peak_bytes'] / max(u['peak_bytes'], 1):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
