"""The MoE layer at ep 1/2/4 against a dense MLP of the same active parameters, with its token traffic.

For each ep (and dispatcher: alltoall, allgather) a forked world of ep ranks (dp = ep, so each
rank holds E/ep experts) runs forward + backward of one `megalite.moe.layer.MoELayer` on its own
[s, b, h] tokens; the baseline is a dense SwiGLU MLP whose inner width is topk * the expert width
(the FLOPs a token pays in the MoE layer), run in the same world. Printed per row:

- step time (forward + backward), the slowest rank's median over --steps, and its ratio to the
  dense MLP measured in the same world (on CPU the ranks share a few cores: the ratio shows
  overhead, not the speed-up of ep GPUs);
- bytes on the ep group per step from `comm.ledger` (all-to-all: the ranks' mean; each rank
  receives what the others route to it), beside the planner's `megalite.plan.moe.dispatch_bytes`;
- expert load: the most loaded expert's routes over the mean (1.00 = perfectly balanced).

    python tools/bench_moe.py                          # h 256, 8 experts top-2, ep 1 2 4
    python tools/bench_moe.py --hidden 512 --tokens 2048 --ep 1 2 --steps 5
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.distributed import comm  # noqa: E402
from megalite.config import RunConfig  # noqa: E402
from megalite.distributed.layer_groups import LayerGroups  # noqa: E402
from megalite.distributed.mesh import init_mesh  # noqa: E402
from megalite.tensor_parallel.mlp import MLP  # noqa: E402
from megalite.moe.layer import MoELayer  # noqa: E402
from megalite.plan.moe import dispatch_bytes  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402


def run_config(args, ep: int, dispatcher: str) -> RunConfig:
    return RunConfig.build(model="moe-tiny", num_layers=1, hidden_size=args.hidden, num_attention_heads=4,
                           num_query_groups=4, ffn_hidden_size=args.topk * args.expert_ffn, seq_length=args.tokens,
                           num_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.expert_ffn,
                           moe_aux_loss_coeff=0.0, dp=ep, ep=ep, micro_batch_size=1, global_batch_size=ep,
                           moe_token_dispatcher_type=dispatcher)


def _time(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _rank(args, ep: int, dispatcher: str) -> dict:
    cfg = run_config(args, ep, dispatcher)
    model = cfg.gpt_config()
    mesh = init_mesh(dp=ep, ep=ep, num_experts=model.moe.num_experts)
    torch.manual_seed(0)
    moe = MoELayer(model, LayerGroups(ep=mesh.ep_group), sequence_parallel=False, moe_dispatcher=dispatcher)
    dense = MLP(model.replace(moe=None), None, sequence_parallel=False)
    gen = torch.Generator().manual_seed(100 + mesh.rank)
    x = torch.randn(args.tokens, 1, args.hidden, generator=gen, requires_grad=True)

    def step(layer):
        return lambda: layer(x).square().mean().backward()

    dense_s = _time(step(dense), args.steps)
    moe.reset_stats()
    comm.ledger.reset()
    moe_s = _time(step(moe), args.steps)
    calls = args.steps + 1  # the warm-up moved tokens too
    ep_bytes = {f"ep/{op}": n // calls for (group, op), n in comm.ledger.bytes.items() if group == "ep"}
    loads = moe.stats["tokens_per_expert"].double()
    comm.all_reduce(loads, mesh.ep_group)
    planned = dispatch_bytes(model, cfg, 0)
    return {"moe_s": moe_s, "dense_s": dense_s, "ep_bytes": ep_bytes, "planned": planned,
            "imbalance": float(loads.max() / loads.mean())}


def measure(args) -> list[dict]:
    rows = []
    for ep in args.ep:
        for dispatcher in (("alltoall", "allgather") if ep > 1 else ("alltoall",)):
            ranks = run_distributed(_rank, ep, args, ep, dispatcher, timeout_s=600)
            keys = sorted({k for r in ranks for k in r["ep_bytes"]} | set(ranks[0]["planned"]))
            rows.append({"ep": ep, "dispatcher": dispatcher, "moe_s": max(r["moe_s"] for r in ranks),
                         "dense_s": max(r["dense_s"] for r in ranks), "imbalance": ranks[0]["imbalance"],
                         "bytes": {k: (sum(r["ep_bytes"].get(k, 0) for r in ranks) / ep, ranks[0]["planned"].get(k, 0))
                                   for k in keys}})
    return rows


def print_rows(args, rows: list[dict]) -> None:
    print(f"# MoE layer: h={args.hidden}, {args.experts} experts of width {args.expert_ffn}, top-{args.topk}, "
          f"{args.tokens} tokens per rank; dense MLP of width {args.topk * args.expert_ffn}; fp32, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"{'ep':>3} {'dispatcher':<10} {'moe ms':>8} {'dense ms':>9} {'ratio':>6} {'load':>6}  ep bytes/step "
          f"measured (planned)")
    for r in rows:
        traffic = ", ".join(f"{k} {m / 1e6:.2f} MB ({p / 1e6:.2f})" for k, (m, p) in r["bytes"].items()) or "-"
        print(f"{r['ep']:>3} {r['dispatcher']:<10} {1e3 * r['moe_s']:8.2f} {1e3 * r['dense_s']:9.2f} "
              f"{r['moe_s'] / r['dense_s']:6.2f} {r['imbalance']:5.2f}x  {traffic}")


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--expert-ffn", type=int, default=512)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    print_rows(args, measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
