"""What training cannot run, beyond the layout arithmetic the planner checks (plan/validity.py)
and each setting's declared bounds (config/bounds.py): combinations of settings, and the files
a run names (data, --load). Called by RunConfig.validate.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from megalite.data.indexed_dataset import DataError, resolve_prefix  # numpy, no torch
from megalite.data.tokenizer import tokenizer_spec_problem

if TYPE_CHECKING:
    from megalite.config import DataSettings, RunConfig


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
    if cfg.precision.grad_reduce_dtype == "fp16":
        problems.append("--grad-reduce-dtype fp16 is modelled by tools/plan.py only; training reduces in fp32 or "
                        "bf16")
    if p.recompute_num_layers is not None and p.recompute != "full":
        problems.append(f"--recompute-num-layers {p.recompute_num_layers} needs --recompute full "
                        f"(it says how many blocks of each model chunk full recompute covers)")
    if p.overlap_param_gather and p.zero != 3 and (p.zero == 0 or p.offload_optimizer):
        problems.append("--overlap-param-gather needs --zero 1 or 2 and no --offload-optimizer (at zero 0 nothing is "
                        "gathered; offloaded updates finish inside the step)")
    problems += _compression_problems(cfg) + _expert_parallel_problems(cfg)
    problems += cuda_graph_problems(cfg) + fp8_problems(cfg)
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
        given = [flag for flag, on in ((f"--fp8-recipe {prec.fp8_recipe}", prec.fp8_recipe != "tensorwise"),
                                       ("--fp8-scales exact", prec.fp8_scales == "exact"),
                                       ("--fp8-param-gather", prec.fp8_param_gather)) if on]
        return [f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --fp8-format e4m3|hybrid"] if given else []
    problems = []
    if prec.precision == "fp16":
        problems.append("--fp8-format with --fp16: FP8 training keeps bf16 (or fp32) outside its GEMMs; use --bf16")
    if prec.fp8_recipe == "blockwise" and (p.tp > 1 or p.cp > 1):
        problems.append(f"--fp8-recipe blockwise with --tp {p.tp} --cp {p.cp}: built for --tp 1 --cp 1 so far (a tile "
                        f"is local to a shard only at multiples of 128); use tensorwise or rowwise there")
    if prec.fp8_param_gather and (p.zero != 3 or prec.fp8_recipe != "tensorwise"):
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
    if p.recompute != "none":
        reasons.append(f"--recompute {p.recompute} re-runs forward inside backward with host-held RNG state")
    if p.offload_optimizer:
        reasons.append("--offload-optimizer moves state between host and GPU inside the step")
    if p.overlap_param_gather:
        reasons.append("--overlap-param-gather waits for its gathers in forward hooks that a replay does not run")
    if p.grad_compression != "none":
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
    if p.grad_compression != "powersgd":
        return []
    problems = []
    if p.zero == 3:
        problems.append("--grad-compression powersgd composes with --zero 0, 1 or 2 only: ZeRO-3 reduce-scatters "
                        "each unit's gradient every microbatch, so no rank ever holds a whole accumulated gradient "
                        "to factor; use --zero 2 (or --grad-compression none)")
    if cfg.precision.grad_reduce_dtype != "fp32":
        problems.append(f"--grad-compression powersgd sends its factors in fp32; drop --grad-reduce-dtype "
                        f"{cfg.precision.grad_reduce_dtype} (the factors are already {p.powersgd_rank}*(n+m) "
                        f"elements per n x m matrix)")
    return problems


def _expert_parallel_problems(cfg: RunConfig) -> list[str]:
    """--ep and the experts: what the layout needs (the MoE settings' own ranges: MoEConfig)."""
    p, problems = cfg.parallel, []
    try:
        model = cfg.gpt_config()
    except ValueError:
        return []  # reported by validate() itself
    moe = model.moe
    replicas = cfg.dp * p.cp
    if p.ep < 1:
        return [f"--ep must be >= 1, got {p.ep}"]
    if p.ep > 1 and moe is None:
        problems.append(f"--ep {p.ep} shards experts but the model has none: add --num-experts N (a multiple of "
                        f"{p.ep}) or drop --ep")
    if moe is not None and moe.num_experts % p.ep:
        problems.append(f"--num-experts {moe.num_experts} is not divisible by --ep {p.ep}; choose --ep in "
                        f"{[d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0 and replicas % d == 0]}")
    if replicas % p.ep:
        problems.append(f"--ep {p.ep} does not divide dp*cp = {cp_dp(cfg)} (experts are sharded over the data x "
                        f"context ranks); choose --ep in {[d for d in range(1, replicas + 1) if replicas % d == 0]}")
    if p.etp not in (1, p.tp):
        problems.append(f"--etp {p.etp} must be 1 (whole experts on every tp rank) or --tp {p.tp} (experts split "
                        f"over tp); choose --etp 1 or --etp {p.tp}")
    elif moe is not None and p.etp < p.tp and model.seq_length % (p.tp * p.cp):
        problems.append(f"--etp 1 under --tp {p.tp} splits each rank's s/cp tokens of a sequence over tp: "
                        f"--seq-length {model.seq_length} must be divisible by tp*cp = {p.tp * p.cp}; change "
                        f"--seq-length or use --etp {p.tp}")
    return problems


def cp_dp(cfg: RunConfig) -> str:
    return f"{cfg.dp}*{cfg.parallel.cp} = {cfg.dp * cfg.parallel.cp}"


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
