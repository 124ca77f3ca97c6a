"""What training cannot run, beyond the world size the planner checks (plan/validity.py)
and each setting's declared bounds (config/bounds.py): combinations of settings, and the files
a run names (data, --load). Called by RunConfig.validate.
"""
from __future__ import annotations

import os
from typing import Protocol

from megalite.config.choices import (CPSplit, Fp8Scales, Fp8ScalingRecipe, GradCompression, LRDecay, OptimizerKind,
                                     Precision, Recompute, Schedule)
from megalite.config.model import GPTConfig
from megalite.config.model_parts import ModelSettings, ParallelSettings
from megalite.config.run_parts import (CheckpointSettings, DataSettings, FaultToleranceSettings, LoggingSettings,
                                       OptimizerSettings, PrecisionSettings, TrainingSettings)
from megalite.layout import Layout, LayoutError
from megalite.config.mla import layout_problems as mla_layout_problems
from megalite.config.diloco import fragment_problem
from megalite.data.indexed_dataset import DataError, resolve_prefix  # numpy, no torch
from megalite.data.tokenizer import tokenizer_spec_problem
from megalite.config.replica_groups import replica_group_problems


class RunConfig(Protocol):
    """What these checks read of a run's configuration: its parts and what it derives from them.
    `megalite.config.RunConfig` is one; naming only this keeps the checks below the package that calls them."""

    model: ModelSettings
    parallel: ParallelSettings
    training: TrainingSettings
    optimizer: OptimizerSettings
    precision: PrecisionSettings
    data: DataSettings
    checkpoint: CheckpointSettings
    logging: LoggingSettings
    fault_tolerance: FaultToleranceSettings

    @property
    def dp(self) -> int: ...

    @property
    def dp_shard(self) -> int: ...

    @property
    def lr_schedule_iters(self) -> tuple[int, int]: ...

    def layout(self) -> Layout: ...

    def gpt_config(self) -> GPTConfig: ...


def _wsd_problems(cfg: RunConfig) -> list[str]:
    """--lr-decay-style WSD anneals over its last --lr-wsd-decay-iters steps: they must be given and fit
    after the warm-up (Megatron's rule)."""
    o = cfg.optimizer
    if o.lr_decay_style != LRDecay.WSD:
        return (["--lr-wsd-decay-iters and --lr-wsd-decay-style go with --lr-decay-style WSD: add it, or drop them"]
                if o.lr_wsd_decay_iters is not None else [])
    warmup, decay = cfg.lr_schedule_iters
    if o.lr_wsd_decay_iters is None:
        return [f"--lr-decay-style WSD needs --lr-wsd-decay-iters N: the last N of its {decay} decay steps anneal "
                f"to --min-lr (e.g. {max(1, (decay - warmup) // 10)})"]
    if o.lr_wsd_decay_iters > decay - warmup:
        return [f"--lr-wsd-decay-iters {o.lr_wsd_decay_iters} is more than the {decay - warmup} steps after the "
                f"warm-up; give at most {decay - warmup}"]
    return []


def setting_problems(cfg: RunConfig) -> list[str]:
    """Combinations of settings that training cannot run."""
    p, t, log, ck = cfg.parallel, cfg.training, cfg.logging, cfg.checkpoint
    problems = []
    if p.pp == 1 and (p.decoder_first_stage_layers is not None or p.decoder_last_stage_layers is not None
                      or p.pipeline_layout is not None):
        problems.append("--decoder-first/last-stage-layers and --pipeline-layout need --pp > 1")
    if p.zero == 3 and p.overlap_param_gather:
        problems.append("--overlap-param-gather is for --zero 1/2 (their all-gather after the step); ZeRO-3 gathers "
                        "each unit right before it runs, overlapped by --zero3-prefetch: drop --overlap-param-gather")
    if cfg.precision.grad_reduce_dtype == Precision.FP16:
        problems.append("--grad-reduce-dtype fp16 is modelled by tools/plan.py only; training reduces in fp32 or "
                        "bf16")
    if p.recompute_num_layers is not None and p.recompute != Recompute.FULL:
        problems.append(f"--recompute-num-layers {p.recompute_num_layers} needs --recompute full "
                        f"(it says how many blocks of each model chunk full recompute covers)")
    if p.overlap_param_gather and p.zero != 3 and (p.zero == 0 or p.offload_optimizer):
        problems.append("--overlap-param-gather needs --zero 1 or 2 and no --offload-optimizer (at zero 0 nothing is "
                        "gathered; offloaded updates finish inside the step)")
    problems += _compression_problems(cfg) + layout_problems(cfg) + dp_shard_problems(cfg)
    problems += replica_group_problems(cfg)  # --ft-replica-groups
    problems += cuda_graph_problems(cfg) + fp8_problems(cfg) + _wsd_problems(cfg) + document_problems(cfg)
    problems += _latent_attention_problems(cfg) + _dualpipev_problems(cfg)
    problems += cp_split_problems(cfg)
    if t.compile and (p.tp > 1 or p.cp > 1 or p.ep > 1):  # a 2-rank tp run under compile did not finish in 900 s
        problems.append(f"--compile runs at --tp 1 --cp 1 --ep 1 (the layouts whose blocks hold no collective: "
                        f"pp and dp); a compiled block with tp/cp/ep collectives inside is not proven equal yet: "
                        f"drop --compile or use tp = cp = ep = 1")
    if log.profile_steps is not None and not 1 <= log.profile_steps[0] <= log.profile_steps[1] <= t.train_iters:
        first, last = log.profile_steps
        problems.append(f"--profile-steps {first} {last} must satisfy 1 <= FIRST <= LAST <= --train-iters "
                        f"({t.train_iters}); e.g. --profile-steps 5 7 (after the first steps' warm-up)")
    if ck.save_interval and ck.save is None:
        problems.append("--save-interval needs --save DIR (where to write the checkpoints)")
    if ck.load_step is not None and ck.load is None:
        problems.append("--load-step needs --load DIR")
    if ck.finetune and ck.load is None:
        problems.append("--finetune needs --load DIR (the checkpoint, or an HF import, whose weights it starts from)")
    if ck.load is not None and os.path.exists(ck.load) and not os.path.isdir(ck.load):
        problems.append(f"--load {ck.load} is a file; --load takes the checkpoint directory (the --save DIR of the "
                        f"run to resume)")
    return problems


def fp8_problems(cfg: RunConfig) -> list[str]:
    """--fp8-*: what FP8 training does not combine with (the machine's own limits: launch_checks)."""
    prec, p = cfg.precision, cfg.parallel
    if prec.fp8_format is None:
        given = [flag for flag, on in ((f"--fp8-recipe {prec.fp8_recipe}", prec.fp8_recipe != Fp8ScalingRecipe.TENSORWISE),
                                       ("--fp8-scales exact", prec.fp8_scales == Fp8Scales.EXACT),
                                       ("--fp8-param-gather", prec.fp8_param_gather)) if on]
        return [f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --fp8-format e4m3|hybrid"] if given else []
    problems = []
    if prec.precision == Precision.FP16:
        problems.append("--fp8-format with --fp16: FP8 training keeps bf16 (or fp32) outside its GEMMs; use --bf16")
    if prec.fp8_recipe == Fp8ScalingRecipe.BLOCKWISE and (p.tp > 1 or p.cp > 1):
        problems.append(f"--fp8-recipe blockwise with --tp {p.tp} --cp {p.cp}: built for --tp 1 --cp 1 so far (a tile "
                        f"is local to a shard only at multiples of 128); use tensorwise or rowwise there")
    if prec.fp8_param_gather and (p.zero != 3 or prec.fp8_recipe != Fp8ScalingRecipe.TENSORWISE):
        problems.append("--fp8-param-gather needs --zero 3 (it is ZeRO-3's parameter all-gather) and --fp8-recipe "
                        "tensorwise (one scale per weight)")
    return problems


def cuda_graph_problems(cfg: RunConfig) -> list[str]:
    """--cuda-graph: what a captured forward+backward cannot hold (training/cuda_graph.py and, at pp > 1,
    pipeline_graphs.py say why);
    a machine without CUDA is refused where the device is known (training/loop.py)."""
    p, m = cfg.parallel, cfg.model
    if not cfg.training.cuda_graph:
        return []
    reasons = []
    if p.tp > 1 or p.cp > 1 or p.ep > 1:
        reasons.append(f"tp={p.tp}, cp={p.cp}, ep={p.ep}: their collectives run inside forward and backward (need "
                       f"all 1; pp > 1 is fine: its transfers run between the graphs)")
    if _has_experts(cfg):
        reasons.append("MoE layers record their routing statistics in Python per forward and take the balancing "
                       "losses' scale as a constant (a replay would record nothing and keep the captured scale)")
    if p.zero >= 2:
        reasons.append(f"--zero {p.zero} allocates and frees gradient or parameter storage inside the step (use 0 or 1)")
    if m.hidden_dropout > 0 or m.attention_dropout > 0:
        reasons.append("dropout draws its seeds on the host per call: a replay would repeat the captured masks")
    if p.recompute != Recompute.NONE:
        reasons.append(f"--recompute {p.recompute} re-runs forward inside backward with host-held RNG state")
    if p.offload_optimizer:
        reasons.append("--offload-optimizer moves state between host and GPU inside the step")
    if p.overlap_param_gather:
        reasons.append("--overlap-param-gather waits for its gathers in forward hooks that a replay does not run")
    if p.grad_compression != GradCompression.NONE:
        reasons.append("--grad-compression reduces in host-driven phases")
    return [f"--cuda-graph cannot capture this run: {r}; drop --cuda-graph or change that" for r in reasons]


def _has_experts(cfg: RunConfig) -> bool:
    try:
        return cfg.gpt_config().moe is not None
    except ValueError:
        return False  # reported by validate() itself


def _compression_problems(cfg: RunConfig) -> list[str]:
    """--grad-compression powersgd: what it does not combine with."""
    p = cfg.parallel
    if p.grad_compression != GradCompression.POWERSGD:
        return []
    problems = []
    if p.zero == 3:
        problems.append("--grad-compression powersgd composes with --zero 0, 1 or 2 only: ZeRO-3 reduce-scatters "
                        "each unit's gradient every microbatch, so no rank ever holds a whole accumulated gradient "
                        "to factor; use --zero 2 (or --grad-compression none)")
    if cfg.precision.grad_reduce_dtype != Precision.FP32:
        problems.append(f"--grad-compression powersgd sends its factors in fp32; drop --grad-reduce-dtype "
                        f"{cfg.precision.grad_reduce_dtype} (the factors are already {p.powersgd_rank}*(n+m) "
                        f"elements per n x m matrix)")
    return problems


def layout_problems(cfg: RunConfig) -> list[str]:
    """The parallel sizes against each other (megalite.layout: one rule, one message, wherever a layout is
    met). Whole experts under tp (etp 1) take any sequence length: without SP the tp ranks route
    split_sizes(s, tp) rows each (megalite/distributed/uneven.py); SP's own rule is plan/validity.py's."""
    try:
        cfg.layout()
    except LayoutError as exc:
        return [str(exc)]
    except ValueError:
        return []  # the model cannot be built: reported by validate() itself
    return []


def dp_shard_problems(cfg: RunConfig) -> list[str]:
    """--dp-shard S or --num-distributed-optimizer-instances (dp/S), given once, and what hybrid sharding does
    not compose with (DiLoCo's limits). S's sizes: megalite.layout."""
    p = cfg.parallel
    if p.dp_shard is None and p.num_distributed_optimizer_instances is None:
        return [_diloco_problem(cfg)] if _diloco_problem(cfg) else []
    if p.dp_shard is not None and p.num_distributed_optimizer_instances is not None:
        return [f"--dp-shard {p.dp_shard} and --num-distributed-optimizer-instances "
                f"{p.num_distributed_optimizer_instances} say the same thing twice (instances = dp/S); give one"]
    dp, instances = cfg.dp, p.num_distributed_optimizer_instances
    if p.dp is None:
        return []  # dp comes from the world size: launch_checks asks again on the resolved config
    choices = [s for s in range(1, dp + 1) if dp % s == 0]
    if instances is not None and dp % instances:
        return [f"--num-distributed-optimizer-instances {instances} does not divide dp = {dp}; choose it in {choices}"]
    problem = _diloco_problem(cfg)
    return [problem] if problem else []


def _diloco_problem(cfg: RunConfig) -> str | None:
    """--diloco-inner-steps: what the outer step over the replica groups does not cover yet."""
    p = cfg.parallel
    if not p.diloco_inner_steps:
        given = [f for f, on in (("--diloco-fragments", p.diloco_fragments > 1),
                                 ("--diloco-reduce-dtype", p.diloco_reduce_dtype != Precision.FP32)) if on]
        return f"{given[0]} sets up DiLoCo's outer steps: give --diloco-inner-steps H too" if given else None
    if cfg.fault_tolerance.check_replicas_interval:  # the groups' weights differ between outer steps, by design
        return ("--check-replicas-interval compares the replica groups, which DiLoCo lets differ between outer "
                "steps: drop one of them")
    if p.grad_compression != GradCompression.NONE or p.ep > 1 or p.pp > 1 or p.offload_optimizer or _has_experts(cfg):
        return ("--diloco-inner-steps runs dense models with tp, cp and --dp-shard replica groups at ZeRO 0-3 so "
                "far: drop --grad-compression, experts, --pp and --offload-optimizer")
    if p.diloco_reduce_dtype == Precision.FP16:
        return "--diloco-reduce-dtype fp16 would overflow on large pseudo-gradients: choose fp32 or bf16"
    try:
        num_layers = cfg.gpt_config().num_layers
    except ValueError:
        return None  # the model cannot be built: reported by validate() itself
    return fragment_problem(inner_steps=p.diloco_inner_steps, fragments=p.diloco_fragments, num_layers=num_layers)


def document_problems(cfg: RunConfig) -> list[str]:
    """--reset-position-ids / --reset-attention-mask: the documents travel as restarting position ids, so
    the two go together; the layouts that do not carry them yet are refused."""
    data = cfg.data
    if data.eod_mask_loss and data.mock_data:
        return ["--eod-mask-loss needs documents: --mock-data has no end-of-document token; drop one of them"]
    if data.reset_position_ids != data.reset_attention_mask:
        return ["pass --reset-position-ids and --reset-attention-mask together: megalite reads each sample's "
                "documents from its restarting position ids"]
    if not data.reset_attention_mask:
        return []
    unsupported = [name for name, on in (("--cuda-graph", cfg.training.cuda_graph),
                                         ("--mock-data (no end-of-document token)", data.mock_data)) if on]
    if unsupported:
        return [f"--reset-attention-mask does not run with {', '.join(unsupported)} yet; drop one or the other"]
    return []


def data_problems(data: DataSettings) -> list[str]:
    if data.sft and (data.data_path is None or data.mock_data):
        return ["--sft trains on SFT samples: give --data-path PREFIX written by tools/preprocess_data.py --sft "
                "(and no --mock-data)"]
    if data.mock_data and (data.data_path is not None or data.tokenizer is not None):
        return ["--mock-data trains on synthetic token ids: drop --data-path/--tokenizer, or drop --mock-data"]
    if data.data_path is None:
        return []
    if len(data.data_path) > 1 and len(data.data_path) % 2:
        return ["--data-path takes one PREFIX, or weight/prefix pairs: W1 PREFIX1 W2 PREFIX2 ..."]
    prefixes = data.data_path if len(data.data_path) == 1 else data.data_path[1::2]
    try:  # PREFIX, or the Megatron-named PREFIX_text_document beside it
        prefixes = [resolve_prefix(p) for p in prefixes]
    except DataError as exc:
        return [str(exc)]
    missing = [f"{p}.{ext}" for p in prefixes for ext in ("bin", "idx") if not os.path.exists(f"{p}.{ext}")]
    if missing:
        return [f"data files not found: {', '.join(missing[:4])}; build them with tools/preprocess_data.py "
                f"--input ... --output-prefix PREFIX, or omit --data-path to use the embedded corpus"]
    problem = tokenizer_spec_problem(data.tokenizer)
    return [problem] if problem else []


def _latent_attention_problems(cfg: RunConfig) -> list[str]:
    """DeepSeek's latent attention and multi-token prediction: what they do not run yet (docs/deepseek.md)."""
    try:
        model = cfg.gpt_config()
    except ValueError:
        return []  # RunConfig.validate reports the model's own problem
    problems = mla_layout_problems(model.mla, model.attention_dropout)
    p = cfg.parallel
    if model.mtp_num_layers and p.pp > 1 and model.flavour == "gpt2":
        problems.append(f"--mtp-num-layers under --pp {p.pp} copies the word embedding to the last stage, not the "
                        f"learned position table of the gpt2 flavour: use a RoPE (llama-flavour) model or --pp 1")
    if model.mtp_num_layers and cfg.training.cuda_graph:
        problems.append("--mtp-num-layers runs without --cuda-graph (not built yet); drop one of them")
    return problems


def _dualpipev_problems(cfg: RunConfig) -> list[str]:
    """--pipeline-schedule dualpipev: its V puts the first and the last model chunk on pp rank 0 as two
    chunks (pipeline/partition.py); what that does not run yet (docs/architecture/pipeline.md). Its microbatch and
    virtual-stage rules are the schedule's own (pipeline.schedules.check_schedule_args)."""
    if cfg.schedule != Schedule.DUALPIPEV or cfg.parallel.pp == 1:
        return []
    try:
        model = cfg.gpt_config()
    except ValueError:
        return []  # RunConfig.validate reports the model's own problem
    problems = []
    if model.tie_embeddings:
        problems.append("--pipeline-schedule dualpipev holds the embedding and the output layer on pp rank 0 as two "
                        "chunks, which do not share a tied weight yet: add --untie-embeddings-and-output-weights or "
                        "choose another --pipeline-schedule")
    if model.mtp_num_layers:
        problems.append("--mtp-num-layers under dualpipev would keep the word embedding and MTP's copy of it on pp "
                        "rank 0 as two chunks, which is not built yet: choose another --pipeline-schedule or drop "
                        "--mtp-num-layers")
    if cfg.training.cuda_graph:
        problems.append("--cuda-graph does not capture dualpipev's in-memory hop between a rank's two chunks yet: "
                        "drop --cuda-graph or choose another --pipeline-schedule")
    return problems


def cp_split_problems(cfg: RunConfig) -> list[str]:
    """--cp-split documents (context_parallel/document_split.py): what the per-document split cannot
    express yet, or where it is not the better split."""
    if cfg.parallel.cp_split != CPSplit.DOCUMENTS:
        return []
    if not (cfg.data.reset_attention_mask or cfg.data.sft):
        return ["--cp-split documents splits packed documents: add --reset-attention-mask (or --sft), or use "
                "--cp-split zigzag"]
    try:
        model = cfg.gpt_config()
    except ValueError:
        return []  # RunConfig.validate reports the model's own problem
    if model.window_size is not None:
        return ["--cp-split documents with --window-size balances the work worse than the zigzag split (measured: "
                "docs/documents.md): use --cp-split zigzag"]
    if cfg.parallel.cp == 1:
        return []
    if model.hidden_dropout > 0 or model.attention_dropout > 0:
        return ["--cp-split documents does not run with --hidden-dropout/--attention-dropout yet (dropout's random "
                "stream follows the zigzag split's token order): use --cp-split zigzag or drop them"]
    return []
