"""Context parallelism on CPU/gloo: activation memory per rank and step time as sequences grow.

For each cp (1, 2, 4) and method (ring attention `p2p`, Ulysses `a2a`) a forked gloo world of
cp ranks trains a small Llama-flavoured GPT (RoPE, 8 query heads over 4 kv heads) through the
real step, `megalite.training.step.train_step` (zigzag split, cp attention, gradients over
dp x cp), one sequence per step, at each sequence length (4k -> 32k tokens by default).
Printed per row:

- saved activation bytes per rank: the distinct storages autograd keeps from one training
  forward for backward (parameters excluded; the quantity the planner's activation estimate
  is tested against), the largest over the ranks, and its ratio to cp = 1 (ideal: 1/cp);
- the planner's estimate of the same for megalite's Triton kernels (`megalite.plan`, the kept
  part, without the transient ring/all-to-all buffers);
- step time: the slowest rank's, best of --steps (--long-steps above 8k tokens), and its ratio
  to cp = 1. On this machine the ranks share the same few cores, so the ratio shows overhead,
  not the speed-up of cp GPUs; and on CPU cp = 1 and Ulysses run torch's fused SDPA while ring
  attention runs megalite's PyTorch reference of the per-block kernel (unfused fp32 scores);
- the step's loss (the same at every cp: a check that the rows train the same model).

torch's own context parallelism (torch.distributed.tensor.experimental.context_parallel) is
probed on 2 gloo ranks first; on CPU it does not run (the reason is printed), so it has no rows.

    python tools/bench_cp.py                                   # 4k..32k, cp 1/2/4, p2p and a2a
    python tools/bench_cp.py --seq 4096 8192 --cp 1 2 --steps 3
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.distributed import comm  # noqa: E402
from megalite.config import RunConfig  # noqa: E402
from megalite.distributed.mesh import init_mesh  # noqa: E402
from megalite.plan import activations  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step  # noqa: E402
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402

MB = 2 ** 20


def _run_config(args, seq: int, cp: int, comm_type: str) -> RunConfig:
    return RunConfig.build(model="tiny-llama", num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                           num_query_groups=4, ffn_hidden_size=4 * args.hidden, seq_length=seq, cp=cp,
                           cp_comm_type=comm_type, micro_batch_size=1, global_batch_size=1, lr=1e-4, seed=5)


class SavedBytes:
    """Distinct storages autograd saves while active (parameters and buffers excluded)."""

    def __init__(self, modules):
        self.skip = {t.untyped_storage().data_ptr() for m in modules for t in list(m.parameters()) + list(m.buffers())}
        self.storages: dict[int, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _largest(value: float) -> float:
    """The largest value over all ranks (one scalar all-reduce)."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    comm.all_reduce(t, comm.world_group(), op="max")
    return float(t.item())


def _bench_rank(args, cp: int, comm_type: str) -> list[dict]:
    mesh = init_mesh(cp=cp)
    rows = []
    for seq in args.seq:
        cfg = _run_config(args, seq, cp, comm_type)
        model_cfg = cfg.gpt_config()
        chunks = build_model_chunks(model_cfg, cfg, mesh)
        optimizer = build_optimizer(build_data_parallel(chunks, cfg, mesh), cfg)
        ids = torch.randint(0, model_cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(seq))
        batch = [{"input_ids": ids[:, :-1], "labels": ids[:, 1:]}]  # whole sequences: the step splits them
        saved, times, losses = SavedBytes(chunks), [], []
        for step in range(args.steps if seq <= 8192 else args.long_steps):
            start = time.perf_counter()
            if step == 0:
                with saved.hooks:
                    result = train_step(optimizer.model, optimizer, batch, mesh, cfg, lr=1e-4)
            else:
                result = train_step(optimizer.model, optimizer, batch, mesh, cfg, lr=1e-4)
            times.append(_largest(time.perf_counter() - start))
            losses.append(result.loss)
        planned = activations.activation_bytes(model_cfg, cfg, 0, attention="triton") \
            - activations.context_parallel_buffer_bytes(model_cfg, cfg)
        rows.append(dict(seq=seq, cp=cp, comm=comm_type if cp > 1 else "-", saved=_largest(saved.total),
                         planned=planned, step_s=min(times), loss=losses[0]))
        del chunks, optimizer
    return rows


def _torch_cp_probe() -> str:
    """Run torch's context_parallel on one causal SDPA call; '' when it works, else why not."""
    init_mesh(cp=2)  # the process group; torch's DeviceMesh is built on it
    device_mesh = init_device_mesh("cpu", (2,))
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    try:
        with context_parallel(device_mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return ""


def _table(rows: list[dict]) -> str:
    base = {r["seq"]: r for r in rows if r["cp"] == 1}
    lines = ["| seq | cp | comm | saved MiB/rank | vs cp=1 | planner MiB (GPU kernels) | step s | vs cp=1 | loss |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["seq"], r["cp"], r["comm"])):
        ref = base.get(r["seq"])
        ratio = f"{r['saved'] / ref['saved']:.3f}" if ref else "-"
        time_ratio = f"{r['step_s'] / ref['step_s']:.2f}" if ref else "-"
        lines.append(f"| {r['seq']} | {r['cp']} | {r['comm']} | {r['saved'] / MB:.1f} | {ratio} | "
                     f"{r['planned'] / MB:.1f} | {r['step_s']:.2f} | {time_ratio} | {r['loss']:.4f} |")
    return "\n".join(lines)


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm", nargs="+", default=["p2p", "a2a"], choices=["p2p", "a2a"])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=64, help="model width (8 query heads, 4 kv heads)")
    parser.add_argument("--steps", type=int, default=2, help="steps per row up to 8k tokens; the best is reported")
    parser.add_argument("--long-steps", type=int, default=1, help="steps per row above 8k tokens")
    args = parser.parse_args(argv)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, gloo; load average "
          f"{os.getloadavg()[0]:.1f}")
    reason = run_distributed(_torch_cp_probe, 2, timeout_s=120)[0]
    print("torch context_parallel on CPU/gloo: " + ("runs" if not reason else f"does not run ({reason})"))
    rows = []
    for cp in args.cp:
        for comm_type in (args.comm if cp > 1 else ["p2p"]):
            start = time.perf_counter()
            rows += run_distributed(_bench_rank, cp, args, cp, comm_type, timeout_s=3600)[0]
            print(f"  cp={cp} {comm_type if cp > 1 else ''}: {time.perf_counter() - start:.0f} s", flush=True)
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
