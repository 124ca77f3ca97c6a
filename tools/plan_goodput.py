"""tools/plan.py --goodput: the checkpoint interval and the expected goodput of a job, restart-only
recovery against in-place recovery of its replica groups (megalite/plan/goodput.py has the model).

    python tools/plan.py --goodput --gpus 16384 --mtbf-hours 50700 --checkpoint-save-s 30 \\
        --checkpoint-load-s 60 --restart-s 300 --heal-s 30 --step-s 15 --dp 128 --dp-shard 8

The save and load seconds of a model and layout are what tools/bench_checkpoint.py measures; the
replica groups are the layout's dp / --dp-shard (or --replica-groups K). The answer is checked
against a Monte Carlo failure trace (2,000 job MTBFs, seeded) printed beside it.
"""
from __future__ import annotations

import json

from megalite.plan.goodput import Failures, monte_carlo, plan_goodput

TIMES = ("checkpoint_save_s", "checkpoint_load_s", "restart_s", "heal_s", "step_s")


def add_goodput_arguments(parser) -> None:
    group = parser.add_argument_group("goodput (--goodput)")
    group.add_argument("--goodput", action="store_true", help="the optimal checkpoint interval and the expected "
                       "goodput, restart-only against in-place recovery (tools/plan_goodput.py)")
    group.add_argument("--mtbf-hours", type=float, default=None, help="mean time between failures of one GPU "
                       "(or one node, with --mtbf-per node), hours")
    group.add_argument("--mtbf-per", choices=("gpu", "node"), default="gpu")
    group.add_argument("--checkpoint-save-s", type=float, default=None, help="seconds a checkpoint save blocks "
                       "training (tools/bench_checkpoint.py measures it)")
    group.add_argument("--checkpoint-load-s", type=float, default=0.0, help="seconds to load a checkpoint")
    group.add_argument("--restart-s", type=float, default=0.0, help="seconds to restart the job's processes (in "
                       "place: one replica group's) and rebuild")
    group.add_argument("--heal-s", type=float, default=0.0, help="in place: seconds a restarted replica group "
                       "takes to receive the live state from a peer")
    group.add_argument("--step-s", type=float, default=0.0, help="seconds of one training step")
    group.add_argument("--replica-groups", type=int, default=None, help="replica groups that fail alone (default "
                       "dp / --dp-shard)")


def goodput_problems(args: dict) -> list[str]:
    if not args["goodput"]:
        return []
    problems = []
    if args["mtbf_hours"] is None or args["checkpoint_save_s"] is None:
        problems.append("--goodput needs --mtbf-hours H (per GPU, or per node with --mtbf-per node) and "
                        "--checkpoint-save-s S (tools/bench_checkpoint.py measures it)")
    if args["mtbf_hours"] is not None and not args["mtbf_hours"] > 0:
        problems.append(f"--mtbf-hours must be > 0, got {args['mtbf_hours']}")
    problems += [f"--{name.replace('_', '-')} must be >= 0, got {args[name]}" for name in TIMES
                 if args[name] is not None and args[name] < 0]
    if args["replica_groups"] is not None and args["replica_groups"] < 1:
        problems.append(f"--replica-groups must be >= 1, got {args['replica_groups']}")
    return problems


def run_goodput(cfg, args: dict) -> int:
    gpus = args["gpus"] or cfg.world_size
    groups = args["replica_groups"] or max(1, cfg.dp // cfg.dp_shard)
    failures = Failures.from_hardware(gpus, mtbf_hours=args["mtbf_hours"], per=args["mtbf_per"],
                                      gpus_per_node=args["gpus_per_node"] or max(1, gpus // args["nodes"]),
                                      save_s=args["checkpoint_save_s"], load_s=args["checkpoint_load_s"],
                                      restart_s=args["restart_s"], heal_s=args["heal_s"], step_s=args["step_s"],
                                      replica_groups=groups)
    plan = plan_goodput(failures)
    restart, inplace = monte_carlo(failures, plan.optimal_interval_s, horizon_s=2000 * failures.job_mtbf_s, seed=0)
    if args["json"]:
        print(json.dumps({**plan.as_dict(), "gpus": gpus, "monte_carlo": {"restart_goodput": restart,
                                                                           "inplace_goodput": inplace}}, indent=1))
        return 0
    print(f"{gpus} GPUs, " + plan.describe())
    print(f"Monte Carlo failure trace (2000 job MTBFs, seed 0): restart-only {100 * restart:.2f}%, "
          f"in-place {100 * inplace:.2f}%")
    return 0
