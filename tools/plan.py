#!/usr/bin/env python3
"""Plan a run before launching it: per-rank memory, communication, bubble, FLOPs, fit.

    python tools/plan.py --model llama-7b --tp 2 --pp 2 --dp 2 --bf16 --global-batch-size 64 --gpu-memory 80
    python tools/plan.py --num-params 7.5e9 --dp 64 --fp16 --grad-reduce-dtype fp16 --zero 1   # ZeRO paper
    python tools/plan.py --model llama-70b --suggest --gpus 64 --nodes 8 --gpu-memory 80 --bf16
    ... --json   # one JSON object (a list with --suggest); sizes in bytes

Takes the same model and layout flags as examples/pretrain_gpt.py (megalite.training.arguments),
and models two things training does not run: --zero 3 and --grad-reduce-dtype fp16.
GB means 1e9 bytes throughout (the ZeRO paper's convention); --gpu-memory accepts 80, 80GB, 80GiB.
Exit status: 0 when the layout is valid (and fits, when --gpu-memory is given), 2 otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

from megalite.model.config import GPTConfig, preset
from megalite.training.arguments import add_layout_args, add_model_args
from megalite.training.estimate import estimate, estimate_model_states
from megalite.training.run_layout import GB, Layout
from megalite.training.planner import preflight, suggest


def _widen_choices(parser: argparse.ArgumentParser, dest: str, choices: list) -> None:
    """The planner also models what training does not run (ZeRO-3, fp16 gradient buffers)."""
    for action in parser._actions:  # argparse has no public way to edit an option's choices
        if action.dest == dest:
            action.choices = choices


def model_from_args(args: argparse.Namespace) -> GPTConfig:
    return preset(args.model, num_layers=args.num_layers, hidden_size=args.hidden_size,
                  num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                  ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length, vocab_size=args.vocab_size,
                  hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout)


def layout_from_args(args: argparse.Namespace, world_size: int | None = None) -> Layout:
    dp = args.dp if args.dp is not None else max(1, (world_size or args.tp * args.pp) // (args.tp * args.pp))
    return Layout(tp=args.tp, pp=args.pp, dp=dp, virtual_stages=args.virtual_stages, zero_stage=args.zero,
                  offload_optimizer=args.offload_optimizer, recompute=args.recompute,
                  recompute_num_layers=args.recompute_num_layers,
                  sequence_parallel=args.sequence_parallel, micro_batch_size=args.micro_batch_size,
                  fused_linear_cross_entropy=args.fused_linear_cross_entropy,
                  seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                  precision="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
                  grad_reduce_dtype=args.grad_reduce_dtype, schedule=args.pipeline_schedule,
                  first_stage_layers=args.decoder_first_stage_layers,
                  last_stage_layers=args.decoder_last_stage_layers)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_layout_args(parser)
    _widen_choices(parser, "zero", [0, 1, 2, 3])
    _widen_choices(parser, "grad_reduce_dtype", ["fp32", "bf16", "fp16"])
    group = parser.add_argument_group("planner")
    group.add_argument("--num-params", type=parse_count, help="model-state-only estimate from a parameter count")
    group.add_argument("--gpu-memory", type=parse_bytes, help="memory of one GPU (80 = 80 GB = 80e9 bytes)")
    group.add_argument("--suggest", action="store_true", help="rank layouts of --gpus GPUs that fit")
    group.add_argument("--gpus", type=int, help="GPUs in the job (for --suggest; default tp*pp*dp)")
    group.add_argument("--nodes", type=int, default=1)
    group.add_argument("--gpus-per-node", type=int, default=None)
    group.add_argument("--top-k", type=int, default=10)
    group.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU peak for --suggest's step time")
    group.add_argument("--json", action="store_true", help="print JSON (sizes in bytes)")
    return parser


def run_suggest(args, model: GPTConfig) -> int:
    if not args.gpus or not args.gpu_memory:
        raise SystemExit("--suggest needs --gpus N and --gpu-memory G")
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    found = suggest(model, args.gpus, args.gpu_memory, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                    global_batch_size=args.global_batch_size, seq_length=args.seq_length, precision=precision,
                    top_k=args.top_k, peak_flops=args.peak_tflops * 1e12)
    if args.json:
        print(json.dumps([{"layout": dataclasses.asdict(s.layout), "step_time_s": s.step_time_s,
                           "reason": s.reason, **s.estimate.to_dict()} for s in found], indent=1))
    elif not found:
        print(f"no layout of {args.gpus} GPUs fits {args.gpu_memory / GB:.1f} GB per GPU; add GPUs or shrink "
              f"the model / sequence")
    for i, s in enumerate(found if not args.json else []):
        lay = s.layout
        print(f"{i + 1:>2}. --tp {lay.tp} --pp {lay.pp} --dp {lay.dp} --virtual-stages {lay.virtual_stages} "
              f"--zero {lay.zero_stage} --recompute {lay.recompute} --micro-batch-size {lay.micro_batch_size}"
              f"{' --sequence-parallel' if lay.sequence_parallel else ''}"
              f"{' --offload-optimizer' if lay.offload_optimizer else ''}\n    {s.reason}")
    return 0 if found else 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_params is not None:
        layout = layout_from_args(args, args.gpus)
        est, errors = estimate_model_states(args.num_params, layout), []
        if args.gpu_memory and not est.fits(args.gpu_memory):
            errors.append(f"model states alone need {est.total_bytes / GB:.2f} GB per rank")
    else:
        model = model_from_args(args)
        if args.suggest:
            return run_suggest(args, model)
        layout = layout_from_args(args, args.gpus)
        errors = preflight(model, layout, args.gpus or layout.world_size, args.gpu_memory)
        est = estimate(model, layout) if not errors or all("does not fit" in e for e in errors) else None
    if args.json:
        out = {"layout": dataclasses.asdict(layout), "errors": errors}
        if est is not None:
            out.update(est.to_dict())
            if args.gpu_memory:
                out["fits"] = est.fits(args.gpu_memory)
        print(json.dumps(out, indent=1))
    else:
        lay = layout
        print(f"layout: tp={lay.tp} pp={lay.pp} dp={lay.dp} virtual_stages={lay.virtual_stages} zero={lay.zero_stage} "
              f"recompute={lay.recompute} sp={lay.sequence_parallel} micro_batch={lay.micro_batch_size} "
              f"precision={lay.precision}")
        if est is not None:
            print(est.describe(args.gpu_memory))
        for error in errors:
            print(f"error: {error}")
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
