"""Command-line flags (Megatron's names where they exist), the run configuration, and pre-flight.

`resolve(args, world_size)` turns flags into (GPTConfig, TrainConfig) and raises ConfigError
listing *every* problem it can see — layout divisibility, batch arithmetic, pipeline shape,
missing data files — each with the fix, before any process group exists. Every rank runs it
on the same flags, so every rank stops with the same message and nothing hangs.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from megalite.model.config import PRESETS, GPTConfig, preset


class ConfigError(ValueError):
    """A configuration that cannot run; the message names each problem and its fix."""


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model (explicit flags override the --model preset)")
    g.add_argument("--model", default="tiny", choices=sorted(PRESETS), help="preset (default: tiny)")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--hidden-size", type=int)
    g.add_argument("--num-attention-heads", type=int)
    g.add_argument("--num-query-groups", type=int, help="key/value heads (grouped-query attention)")
    g.add_argument("--ffn-hidden-size", type=int)
    g.add_argument("--seq-length", type=int)
    g.add_argument("--vocab-size", type=int, help="default: the tokenizer's")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)


def add_layout_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallel layout")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    g.add_argument("--dp", type=int, default=None, help="data-parallel size (default: world / (tp*pp))")
    g.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    g.add_argument("--pipeline-schedule", default=None, choices=["1f1b", "interleaved", "gpipe", "zb-h1"],
                   help="default: 1f1b, or interleaved when --virtual-stages > 1")
    g.add_argument("--decoder-first-stage-layers", type=int, default=None)
    g.add_argument("--decoder-last-stage-layers", type=int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--fused-linear-cross-entropy", action="store_true",
                   help="output layer + cross entropy in token chunks: the logits [tokens, vocab/tp] are never "
                        "held (saves 2 x tokens x vocab/tp x dtype bytes on the last stage; one more output-layer "
                        "GEMM in backward)")
    g.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    g.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                   help="with --recompute full: recompute only the first N blocks of each model chunk (Megatron's "
                        "block method); the others keep their activations. Default: all")
    g.add_argument("--micro-batch-size", type=int, default=8)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro-batch-size * dp")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2], help="ZeRO stage of the optimizer")
    g.add_argument("--offload-optimizer", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="zero >= 1: leave the parameter all-gathers running after the optimizer step; each "
                        "module's forward waits only for its own parameters' buckets")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000, help="elements per gradient bucket")
    g.add_argument("--grad-reduce-dtype", default="fp32", choices=["fp32", "bf16"])
    p = g.add_mutually_exclusive_group()
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")


def add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=600)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--min-lr", type=float, default=2e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=30)
    g.add_argument("--lr-decay-style", default="cosine", choices=["cosine", "linear", "constant"])
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip; 0 disables")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16)
    g.add_argument("--loss-scale-window", type=int, default=1000, help="fp16: steps without overflow to grow")
    g.add_argument("--hysteresis", type=int, default=2, help="fp16: overflows tolerated before the scale backs off")
    g.add_argument("--loss-scale-backoff", type=float, default=0.5, help="fp16: factor applied on backoff")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--data-path", nargs="+", default=None, help="PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend")
    g.add_argument("--tokenizer", default=None, help="path to a tokenizer.json (default: byte level)")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--eval-interval", type=int, default=0, help="0: evaluate only at the end")
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--log-interval", type=int, default=50)
    g.add_argument("--metrics-file", default=None, help="JSON lines, one object per logged step")
    g.add_argument("--tensorboard-dir", default=None, help="also write scalars for TensorBoard (when installed)")
    g.add_argument("--straggler-interval", type=int, default=0)
    g.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak for MFU (default: known GPUs)")
    g.add_argument("--dry-run", action="store_true", help="validate, print the plan, and exit")
    g.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "LAST"), default=None,
                   help="trace steps FIRST..LAST with torch.profiler on every rank (Chrome trace per rank)")
    g.add_argument("--profile-dir", default="profile", help="where --profile-steps writes its traces")


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoints (layout-free: save at one tp/pp/dp, load at any other)")
    g.add_argument("--save", default=None, metavar="DIR", help="write checkpoints into DIR")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from DIR's latest checkpoint (from scratch, with a notice, when it holds none); "
                        "pass the same DIR as --save so one command line serves every restart")
    g.add_argument("--load-step", type=int, default=None, help="load this step instead of the latest")
    g.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: only at the end/on signal)")
    g.add_argument("--keep-last", type=int, default=0, help="keep the newest N checkpoints (0: keep all)")
    g.add_argument("--keep-every", type=int, default=0, help="also keep every step that is a multiple of M")
    g.add_argument("--async-save", action="store_true", help="copy to CPU memory, write in a background thread")
    g.add_argument("--no-load-optim", action="store_true", help="load weights only (fresh optimizer, step 0)")


def add_guard_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("hangs and numerical guards")
    g.add_argument("--hang-timeout", type=float, default=0.0,
                   help="seconds without a finished step before every rank reports where it waits and the job "
                        "exits with code 86 (0: off; e.g. 300, far below NCCL's 30-minute default)")
    g.add_argument("--hang-report-dir", default=None,
                   help="where ranks leave hang reports (default: a temp dir per node; a shared file system "
                        "gives one summary across nodes)")
    g.add_argument("--on-nonfinite", default="skip", choices=["skip", "stop"],
                   help="a non-finite loss or gradient: skip the update and log the step's samples, or stop "
                        "(exit code 3)")
    g.add_argument("--check-replicas-interval", type=int, default=0,
                   help="every K steps compare parameter checksums across data-parallel replicas (and the tp ranks' "
                        "copies of tp-replicated parameters) and stop "
                        "(exit code 4) naming the first parameter that differs; 0: off")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Train a GPT with tensor x pipeline x data parallelism.")
    add_model_args(parser)
    add_layout_args(parser)
    add_training_args(parser)
    add_guard_args(parser)
    add_checkpoint_args(parser)
    return parser


@dataclass
class TrainConfig:
    """Everything about a run except the model's shape (see GPTConfig)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    virtual_stages: int = 1
    pipeline_schedule: str = "1f1b"
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    sequence_parallel: bool = False
    fused_linear_cross_entropy: bool = False
    overlap_param_gather: bool = False
    recompute: str = "none"
    recompute_num_layers: int | None = None
    micro_batch_size: int = 8
    global_batch_size: int = 8
    zero: int = 0
    offload_optimizer: bool = False
    ddp_bucket_size: int = 40_000_000
    grad_reduce_dtype: str = "fp32"
    precision: str = "fp32"
    train_iters: int = 600
    lr: float = 2e-3
    min_lr: float = 2e-4
    lr_warmup_iters: int = 30
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    loss_scale_backoff: float = 0.5
    seed: int = 1234
    data_path: list[str] | None = None
    tokenizer: str | None = None
    split: str = "969,30,1"
    eval_interval: int = 0
    eval_iters: int = 4
    log_interval: int = 50
    metrics_file: str | None = None
    tensorboard_dir: str | None = None
    straggler_interval: int = 0
    peak_tflops: float | None = None
    dry_run: bool = False
    profile_steps: tuple[int, int] | None = None
    profile_dir: str = "profile"
    hang_timeout: float = 0.0
    hang_report_dir: str | None = None
    on_nonfinite: str = "skip"
    check_replicas_interval: int = 0
    save: str | None = None
    load: str | None = None
    load_step: int | None = None
    save_interval: int = 0
    keep_last: int = 0
    keep_every: int = 0
    async_save: bool = False
    no_load_optim: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on each dp rank (gradient accumulation steps)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)


def _data_files_missing(data_path: list[str]) -> list[str]:
    prefixes = data_path if len(data_path) == 1 else data_path[1::2]
    return [f"{p}.{ext}" for p in prefixes for ext in ("bin", "idx") if not os.path.exists(f"{p}.{ext}")]


def resolve(args: argparse.Namespace, world_size: int, vocab_size: int) -> tuple[GPTConfig, TrainConfig]:
    """Flags -> (model config, run config), or ConfigError naming every problem and its fix."""
    from megalite.pipeline.schedules import check_pipeline_config
    from megalite.training.planner import preflight

    problems: list[str] = []
    try:
        model = preset(args.model, num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                       ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
                       vocab_size=args.vocab_size or vocab_size, hidden_dropout=args.hidden_dropout,
                       attention_dropout=args.attention_dropout)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if model.vocab_size < vocab_size:
        problems.append(f"--vocab-size {model.vocab_size} is smaller than the tokenizer's {vocab_size}; "
                        f"drop --vocab-size or set it >= {vocab_size}")

    if args.dp is None and world_size % (args.tp * args.pp) == 0:
        dp = world_size // (args.tp * args.pp)
    else:
        dp = args.dp if args.dp is not None else 1
    schedule = args.pipeline_schedule or ("interleaved" if args.virtual_stages > 1 else "1f1b")
    global_batch = args.global_batch_size or args.micro_batch_size * dp
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    cfg = TrainConfig(
        tp=args.tp, pp=args.pp, dp=dp, virtual_stages=args.virtual_stages, pipeline_schedule=schedule,
        first_stage_layers=args.decoder_first_stage_layers, last_stage_layers=args.decoder_last_stage_layers,
        sequence_parallel=args.sequence_parallel, fused_linear_cross_entropy=args.fused_linear_cross_entropy,
        recompute=args.recompute, recompute_num_layers=args.recompute_num_layers,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=global_batch, zero=args.zero, offload_optimizer=args.offload_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        ddp_bucket_size=args.ddp_bucket_size, grad_reduce_dtype=args.grad_reduce_dtype, precision=precision,
        train_iters=args.train_iters, lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters,
        lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay,
        adam_betas=(args.adam_beta1, args.adam_beta2), adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        initial_loss_scale=args.initial_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, loss_scale_backoff=args.loss_scale_backoff, seed=args.seed,
        data_path=args.data_path, tokenizer=args.tokenizer, split=args.split, eval_interval=args.eval_interval,
        eval_iters=args.eval_iters, log_interval=args.log_interval, metrics_file=args.metrics_file,
        tensorboard_dir=args.tensorboard_dir,
        straggler_interval=args.straggler_interval, peak_tflops=args.peak_tflops, dry_run=args.dry_run,
        profile_steps=tuple(args.profile_steps) if args.profile_steps else None, profile_dir=args.profile_dir,
        hang_timeout=args.hang_timeout, hang_report_dir=args.hang_report_dir, on_nonfinite=args.on_nonfinite,
        check_replicas_interval=args.check_replicas_interval,
        save=args.save, load=args.load, load_step=args.load_step, save_interval=args.save_interval,
        keep_last=args.keep_last, keep_every=args.keep_every, async_save=args.async_save,
        no_load_optim=args.no_load_optim)

    layout = planner_layout(model, cfg)
    problems += preflight(model, layout, world_size)
    if cfg.pp > 1 and not problems:
        # The pipeline's own check: layer split, schedule rules, and the schedule built and verified.
        try:
            check_pipeline_config(schedule, model.num_layers, cfg.pp, cfg.num_microbatches, cfg.virtual_stages,
                                  cfg.first_stage_layers, cfg.last_stage_layers)
        except ValueError as exc:
            problems.append(str(exc))
    if cfg.pp == 1 and (cfg.first_stage_layers is not None or cfg.last_stage_layers is not None):
        problems.append("--decoder-first/last-stage-layers need --pp > 1")
    if cfg.hang_timeout < 0:
        problems.append(f"--hang-timeout must be >= 0 seconds (0: off), got {cfg.hang_timeout}")
    if cfg.profile_steps is not None:
        first, last = cfg.profile_steps
        if not 1 <= first <= last <= cfg.train_iters:
            problems.append(f"--profile-steps {first} {last} must satisfy 1 <= FIRST <= LAST <= --train-iters "
                            f"({cfg.train_iters}); e.g. --profile-steps 5 7 (after the first steps' warm-up)")
    if cfg.recompute_num_layers is not None and (cfg.recompute != "full" or cfg.recompute_num_layers < 1):
        problems.append(f"--recompute-num-layers {cfg.recompute_num_layers} needs --recompute full and N >= 1 "
                        f"(it says how many blocks of each model chunk full recompute covers)")
    if cfg.overlap_param_gather and (cfg.zero == 0 or cfg.offload_optimizer):
        problems.append("--overlap-param-gather needs --zero 1 or 2 and no --offload-optimizer (at zero 0 nothing is "
                        "gathered; offloaded updates finish inside the step)")
    if cfg.check_replicas_interval < 0:
        problems.append(f"--check-replicas-interval must be >= 0 steps (0: off), got {cfg.check_replicas_interval}")
    for name, value in (("--train-iters", cfg.train_iters), ("--micro-batch-size", cfg.micro_batch_size),
                        ("--log-interval", cfg.log_interval)):
        if value < 1:
            problems.append(f"{name} must be >= 1, got {value}")
    for name, value in (("--save-interval", cfg.save_interval), ("--keep-last", cfg.keep_last),
                        ("--keep-every", cfg.keep_every)):
        if value < 0:
            problems.append(f"{name} must be >= 0, got {value}")
    if cfg.save is not None:  # found now, not at the first checkpoint hours in
        from megalite.checkpoint.storage import check_save_dir
        from megalite.training.run_layout import DTYPE_BYTES

        per_param = DTYPE_BYTES[cfg.precision] + 12  # weights + fp32 master, exp_avg, exp_avg_sq
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        node_share = min(1.0, local_ranks / max(1, world_size))  # node-local disk: this node's ranks' part
        problems += check_save_dir(cfg.save, int(model.num_params() * per_param * node_share))
    if cfg.save_interval and cfg.save is None:
        problems.append("--save-interval needs --save DIR (where to write the checkpoints)")
    if cfg.load_step is not None and cfg.load is None:
        problems.append("--load-step needs --load DIR")
    if cfg.data_path is not None:
        if len(cfg.data_path) > 1 and len(cfg.data_path) % 2:
            problems.append("--data-path takes one PREFIX, or weight/prefix pairs: W1 PREFIX1 W2 PREFIX2 ...")
        else:
            missing = _data_files_missing(cfg.data_path)
            if missing:
                problems.append(f"data files not found: {', '.join(missing[:4])}; build them with "
                                f"tools/preprocess_data.py --input ... --output-prefix PREFIX, or omit "
                                f"--data-path to use the embedded corpus")
    if problems:
        raise ConfigError("\n".join(f"  - {p}" for p in dict.fromkeys(problems)))
    return model, cfg



def planner_layout(model: GPTConfig, cfg: TrainConfig):
    """The planner's view of this run (megalite.training.estimate.Layout)."""
    from megalite.training.run_layout import Layout

    return Layout(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp, virtual_stages=cfg.virtual_stages, zero_stage=cfg.zero,
                  offload_optimizer=cfg.offload_optimizer, recompute=cfg.recompute,
                  recompute_num_layers=cfg.recompute_num_layers,
                  sequence_parallel=cfg.sequence_parallel, micro_batch_size=cfg.micro_batch_size,
                  fused_linear_cross_entropy=cfg.fused_linear_cross_entropy,
                  seq_length=model.seq_length, global_batch_size=cfg.global_batch_size, precision=cfg.precision,
                  grad_reduce_dtype=cfg.grad_reduce_dtype, schedule=cfg.pipeline_schedule,
                  first_stage_layers=cfg.first_stage_layers, last_stage_layers=cfg.last_stage_layers)
