#!/usr/bin/env python3
"""Plan a run before launching it: per-rank memory, communication, bubble, FLOPs, fit.

    python tools/plan.py --model llama-7b --tp 2 --pp 2 --dp 2 --bf16 --global-batch-size 64 --gpu-memory 80
    python tools/plan.py --num-params 7.5e9 --dp 64 --fp16 --grad-reduce-dtype fp16 --zero 1   # ZeRO paper
    python tools/plan.py --model llama-70b --suggest --gpus 64 --nodes 8 --gpu-memory 80 --bf16
    python tools/plan.py --config run.toml --gpu-memory 80        # the same file the run reads
    python tools/plan.py --model llama-7b --tp 8 --bf16 --hardware A100-80GB   # step time on a built-in profile
    python tools/plan.py --goodput --gpus 16384 --mtbf-hours 50700 --checkpoint-save-s 30 --restart-s 300 --dp 16384
    python tools/plan.py --calibrate this-machine.json            # measure this machine (imports torch)
    python tools/plan.py --calibrate cpu.json --calibrate-bf16    # bf16 too, on a CPU without native bf16
    python tools/plan.py --hardware this-machine.json --tp 2 --pp 2 --global-batch-size 32
    ... --json   # one JSON object (a list with --suggest); sizes in bytes, times in seconds
    ... --plot memory.png        # the answer drawn (tools/plot_plan.py); --print-schedule: the pipeline's timeline

Takes every setting of examples/pretrain_gpt.py (the parser is generated from megalite.config's
declarations, so the two cannot drift) and models one thing training does not run:
--grad-reduce-dtype fp16. `--num-params N --zero 3` gives the ZeRO paper's model states (its
Figure 1 and Table 1); with a model, --zero 3 adds megalite's gathered units (plan/zero3.py).
Pure arithmetic: it never imports torch (--calibrate aside). --hardware is the planner's own
flag, not a run setting: it describes the machine, not the run, and a RunConfig travels in
checkpoints and config files to other machines (training measures its step time; it does not
predict it).
GB means 1e9 bytes throughout (the ZeRO paper's convention); --gpu-memory accepts 80, 80GB, 80GiB.
Exit status: 0 when the layout is valid (and fits, when --gpu-memory is given), 2 otherwise.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

from megalite.cli import build_parser, parse_args
from megalite.config import RunConfig
from megalite.plan import GB, estimate, estimate_model_states, predict_step_time, preflight, suggest
from megalite.errors import ConfigError, UsageError, one_line, reports_usage_errors
from megalite.plan.hardware import BUILTIN, DEFAULT, load_profile
from megalite.pipeline.instructions import format_schedule
from megalite.pipeline.schedules import chunk_placement, verified_schedule
from megalite.pipeline.timeline import schedule_timeline, text_timeline

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, however this file is loaded
from plan_goodput import add_goodput_arguments, goodput_problems, run_goodput  # noqa: E402


def parse_bytes(text: str) -> float:
    """'80' or '80GB' -> 80e9 bytes; '80GiB' -> 80 * 2**30; '8e10' -> 8e10 (a bare number >= 1e6 is bytes)."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*(GB|GIB|G|MB|MIB|TB|B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"cannot read a memory size from {text!r}; write e.g. 80, 80GB or 80GiB")
    value, unit = float(match.group(1)), match.group(2)
    scale = {"GB": 1e9, "G": 1e9, "GIB": 2 ** 30, "MB": 1e6, "MIB": 2 ** 20, "TB": 1e12, "B": 1}.get(unit)
    if scale is None:
        scale = 1 if value >= 1e6 else 1e9
    return value * scale


def parse_count(text: str) -> int:
    """'7.5e9', '7.5B', '350M' -> a parameter count."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMBT]?)\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"cannot read a parameter count from {text!r}; write e.g. 7.5e9 or 7.5B")
    return int(round(float(match.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}[match.group(2)]))


def planner_parser() -> argparse.ArgumentParser:
    parser = build_parser(description=__doc__.split("\n\n")[0])
    group = parser.add_argument_group("planner")
    group.add_argument("--num-params", type=parse_count, help="model-state-only estimate from a parameter count")
    group.add_argument("--gpu-memory", type=parse_bytes, help="memory of one GPU (80 = 80 GB = 80e9 bytes)")
    group.add_argument("--suggest", action="store_true", help="rank layouts of --gpus GPUs that fit")
    group.add_argument("--gpus", type=int, help="GPUs in the job (for --suggest; default tp*pp*dp)")
    group.add_argument("--nodes", type=int, default=1)
    group.add_argument("--gpus-per-node", type=int, default=None)
    group.add_argument("--top-k", type=int, default=10)
    group.add_argument("--json", action="store_true", help="print JSON (sizes in bytes, times in seconds)")
    group.add_argument("--hardware", metavar="NAME|FILE", default=None,
                       help=f"hardware profile for the step time: {', '.join(BUILTIN)} (default {DEFAULT}) or a "
                            f"profile.json written by --calibrate")
    group.add_argument("--plot", metavar="FILE", default=None,
                       help="also draw the answer into FILE (PNG or SVG): per-stage memory of one rank, or with "
                            "--suggest the candidates' step time and memory side by side (tools/plot_plan.py)")
    group.add_argument("--print-schedule", action="store_true",
                       help="also print the layout's verified pipeline schedule and its timeline (pp > 1)")
    group.add_argument("--calibrate", metavar="OUT.json", default=None,
                       help="measure this machine (GEMMs, copy, all-reduce, megalite's host overhead; imports "
                            "torch), write a hardware profile to OUT.json and exit")
    group.add_argument("--calibrate-bf16", action="store_true",
                       help="with --calibrate: measure bf16 GEMMs even where the device has no native bf16 "
                            "(measured by default only where it has; each size within the calibration's time cap)")
    add_goodput_arguments(parser)
    return parser


def planner_problems(cfg: RunConfig, args: dict) -> list[str]:
    """The planner's own flags: counts >= 1, sizes > 0, nodes that divide the GPUs."""
    problems = [f"--{name.replace('_', '-')} must be >= 1, got {args[name]}"
                for name in ("gpus", "nodes", "gpus_per_node", "top_k") if args[name] is not None and args[name] < 1]
    problems += [f"--{name.replace('_', '-')} must be > 0, got {args[name]}"
                 for name in ("gpu_memory", "num_params") if args[name] is not None and not args[name] > 0]
    gpus = args["gpus"] or cfg.world_size
    if not problems and gpus % args["nodes"]:
        problems.append(f"--nodes {args['nodes']} does not divide --gpus {gpus}; give GPUs per node x nodes, e.g. "
                        f"--gpus {args['nodes'] * max(1, gpus // args['nodes'])} --nodes {args['nodes']}")
    if args["calibrate_bf16"] and not args["calibrate"]:
        problems.append("--calibrate-bf16 only applies to --calibrate OUT.json (it measures bf16 there)")
    if args["suggest"] and not args["gpu_memory"]:
        problems.append("--suggest needs --gpu-memory G (the memory of one GPU, e.g. 80 for 80 GB) or a --hardware "
                        f"profile that names it ({', '.join(BUILTIN)}) to know what fits")
    return problems + goodput_problems(args)


def run_suggest(cfg: RunConfig, args: dict) -> int:
    """Layouts of --gpus GPUs (default: the flags' world, tp*cp*pp*dp) that fit --gpu-memory, ranked."""
    args = dict(args, gpus=args["gpus"] or cfg.world_size)
    found = suggest(cfg.gpt_config(), args["gpus"], args["gpu_memory"], nodes=args["nodes"],
                    gpus_per_node=args["gpus_per_node"], global_batch_size=cfg.training.global_batch_size,
                    precision=cfg.precision.precision, top_k=args["top_k"], hardware=args["hardware"], base=cfg)
    if args["json"]:
        print(json.dumps([{"config": s.cfg.to_dict(), "step_time_s": s.step_time_s, "reason": s.reason,
                           **s.estimate.to_dict()} for s in found], indent=1))
        return 0 if found else 2
    if found and args["plot"]:
        _plot_tool().plot_candidates(found, args["plot"], args["gpu_memory"])
        print(f"wrote {args['plot']}: step time and memory of the {len(found)} candidates")
    if not found:
        print(f"no layout of {args['gpus']} GPUs fits {args['gpu_memory'] / GB:.1f} GB per GPU; add GPUs or shrink "
              f"the model / sequence")
    for i, s in enumerate(found):
        p = s.cfg.parallel
        context = f" --cp {p.cp} --cp-comm-type {p.cp_comm_type}" if p.cp > 1 else ""
        context += f" --ep {p.ep}" if p.ep > 1 else ""
        context += f" --etp {p.etp}" if p.tp > 1 and s.cfg.gpt_config().moe is not None else ""
        context += f" --dp-shard {s.cfg.dp_shard}" if s.cfg.dp_shard < s.cfg.dp else ""  # hybrid sharding
        print(f"{i + 1:>2}. --tp {p.tp} --pp {p.pp} --dp {s.cfg.dp}{context} --virtual-stages {p.virtual_stages} "
              f"--zero {p.zero} --recompute {p.recompute} --micro-batch-size {s.cfg.training.micro_batch_size}"
              f"{' --sequence-parallel' if p.sequence_parallel else ''}"
              f"{' --offload-optimizer' if p.offload_optimizer else ''}"
              f"{' --overlap-param-gather' if p.overlap_param_gather else ''}\n    {s.reason}")
    return 0 if found else 2


def run_calibrate(path: str, bf16: bool) -> int:
    from megalite.calibration import calibrate  # torch: only here

    start = time.perf_counter()
    profile = calibrate(log=lambda line: print(line, file=sys.stderr), bf16=True if bf16 else None)
    profile.save(path)
    print(f"wrote {path} in {time.perf_counter() - start:.0f} s: use it with --hardware {path}")
    return 0


def step_time_fields(model, cfg: RunConfig, args: dict) -> dict:
    """--json's step-time fields: the predicted seconds per step and its parts (timing.py)."""
    parts = predict_step_time(model, cfg, args["hardware"], ranks_per_node=args["gpus_per_node"])
    return {"step_time_s": parts.total, "step_time_breakdown": parts.breakdown(), "hardware": load_profile(
        args["hardware"]).name}


def _plot_tool():
    """tools/plot_plan.py, found beside this file (a script here, megalite.tools.plan when installed)."""
    spec = importlib.util.spec_from_file_location("plot_plan", Path(__file__).with_name("plot_plan.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def print_schedule(cfg: RunConfig) -> None:
    """The layout's verified pipeline schedule (the executor's), then its timeline (forward = 1, backward = 2)."""
    p = cfg.parallel
    ops = [list(s) for s in verified_schedule(str(cfg.schedule), p.pp, cfg.num_microbatches, p.virtual_stages)]
    print(f"schedule {cfg.schedule}: pp {p.pp}, {cfg.num_microbatches} microbatches, v {p.virtual_stages}")
    print(format_schedule(ops, compute_only=False))
    blocks = schedule_timeline(ops, p.pp, p.virtual_stages, placement=chunk_placement(cfg.schedule))
    print(text_timeline(blocks, p.pp))


def _model_problems(cfg: RunConfig) -> list[str]:
    """The settings' own problems that stop the planner from describing the model at all."""
    try:
        cfg.gpt_config()
    except ValueError as exc:
        return [str(exc)]
    return []


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    try:
        cfg, args = parse_args(argv, planner_parser())
        if args["hardware"] is not None:
            profile = load_profile(args["hardware"])  # a bad name or file fails here, before any output
            if args["gpu_memory"] is None and profile.device_memory_gb:  # the hardware names its memory
                args["gpu_memory"] = profile.device_memory_gb * GB
        problems = planner_problems(cfg, args) + ([] if args["num_params"] is not None else _model_problems(cfg))
        if problems:
            raise ConfigError.listing(problems)
        if args["plot"]:
            _plot_tool().pyplot("tools/plan.py --plot")  # matplotlib missing: one line now, not after the work
    except UsageError as exc:  # a bad flag value, config file or hardware profile
        print(f"plan: {one_line(exc).removeprefix('- ')}", file=sys.stderr)
        return 2
    if args["calibrate"]:
        return run_calibrate(args["calibrate"], args["calibrate_bf16"])
    if args["suggest"]:
        return run_suggest(cfg, args)
    if args["goodput"]:
        return run_goodput(cfg.resolved(args["gpus"] or cfg.world_size, cfg.model.vocab_size), args)
    cfg = cfg.resolved(args["gpus"] or cfg.world_size, cfg.model.vocab_size)
    model, timing = None, {}
    if args["num_params"] is not None:
        est, errors = estimate_model_states(args["num_params"], cfg), []
        if args["gpu_memory"] and not est.fits(args["gpu_memory"]):
            errors.append(f"model states alone need {est.total_bytes / GB:.2f} GB per rank")
    else:
        model = cfg.gpt_config()
        errors = preflight(model, cfg, cfg.world_size, args["gpu_memory"])
        est = estimate(model, cfg) if not errors or all("does not fit" in e for e in errors) else None
        timing = step_time_fields(model, cfg, args) if est is not None else {}
    if args["json"]:
        out = {"config": cfg.to_dict(), "errors": errors,
               "total_params": model.num_params() if model is not None else args["num_params"]}
        if est is not None:
            out.update(est.to_dict())
            out.update(timing)  # a model-states-only estimate (--num-params) has no step time
            if args["gpu_memory"]:
                out["fits"] = est.fits(args["gpu_memory"])
        print(json.dumps(out, indent=1))
    else:
        p = cfg.parallel
        context = f" cp={p.cp} cp_comm_type={p.cp_comm_type}" if p.cp > 1 else ""
        print(f"layout: tp={p.tp} pp={p.pp} dp={cfg.dp}{context} virtual_stages={p.virtual_stages} zero={p.zero} "
              f"recompute={p.recompute} sp={p.sequence_parallel} micro_batch={cfg.training.micro_batch_size} "
              f"precision={cfg.precision.precision}")
        if est is not None:
            print(est.describe(args["gpu_memory"]))
        if timing:
            parts = ", ".join(f"{k} {v:.3g}" for k, v in timing["step_time_breakdown"].items() if k != "total" and v)
            print(f"step time on {timing['hardware']}: {timing['step_time_s']:.3g} s ({parts})")
        for error in errors:
            print(f"error: {error}")
    if args["print_schedule"] and not args["json"] and cfg.parallel.pp > 1 and not errors:
        print_schedule(cfg)
    if args["plot"] and model is not None and est is not None:
        _plot_tool().plot_layout(model, cfg, args["plot"], args["gpu_memory"])
        print(f"wrote {args['plot']}: memory per rank of each pipeline stage", file=sys.stderr if args["json"] else None)
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
