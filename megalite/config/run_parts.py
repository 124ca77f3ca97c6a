"""The parts of a RunConfig that say how the run goes: training, optimizer, precision, data,
checkpoint, logging and fault tolerance, each a frozen dataclass of settings declared with
`setting(...)` (config/setting.py); the model, layout and experts are in config/model_parts.py.
`PARTS` names every part in the order the parser and the config files show them.

Pure Python: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config.setting import FLOAT32_MAX, setting
from megalite.config.model_parts import ModelSettings, ParallelSettings, MoESettings
from megalite.config.choices import (
    Precision, LRDecay, LRWSDDecay, ElasticBatch, ElasticLRRule, OnNonFinite, Fp8Format, Fp8ScalingRecipe, Fp8Scales,
    SFTOverlong, OptimizerKind, MuonAdjustLR, MuonOwners)


@dataclass(frozen=True)
class TrainingSettings:
    """training"""

    train_iters: int = setting(600, "optimizer steps", minimum=1)
    micro_batch_size: int = setting(8, "sequences per microbatch and dp rank", minimum=1)
    global_batch_size: int | None = setting(None, "sequences per optimizer step (default: micro-batch-size * dp)",
                                                  minimum=1)
    rampup_batch_size: tuple[int, int, int] | None = setting(None, "Megatron's batch-size ramp-up: the global batch "
                                                                   "starts at START and grows by INCREMENT in equal "
                                                                   "shares of the first SAMPLES samples up to "
                                                                   "--global-batch-size (config/rampup.py)",
                                                             metavar=("START", "INCREMENT", "SAMPLES"), minimum=1)
    seed: int = setting(1234, "seed of the weights, the data order and dropout", minimum=0, maximum=2**32 - 1)
    eval_interval: int = setting(0, "evaluate every N steps (0: only at the end)", minimum=0)
    eval_iters: int = setting(4, "global batches per evaluation", minimum=0)
    compile: bool = setting(False, "torch.compile each transformer block in place (torchtitan's --compile; the "
                                   "parameters and checkpoints unchanged; the first steps pay the compilation; on a "
                                   "CPU it needs a C compiler): megalite/training/compile.py")
    cuda_graph: bool = setting(False, "capture each microbatch's forward and backward once as a CUDA graph and "
                                      "replay it (per pipeline chunk at pp > 1; static shapes; tp = cp = ep "
                                      "= 1, zero 0/1, no dropout, recompute, offload or MoE; "
                                      "training/cuda_graph.py, pipeline_graphs.py)")
    exit_interval: int | None = setting(None, "save (with --save) and stop after every step that is a multiple of N "
                                              "(Megatron's --exit-interval)", minimum=1)
    exit_duration_in_mins: float | None = setting(None, "save (with --save) and stop after the first step that ends "
                                                        "M minutes after the run started (every rank agrees on the "
                                                        "step)", above=0)


@dataclass(frozen=True)
class OptimizerSettings:
    """optimizer (AdamW) and learning-rate schedule"""

    lr: float = setting(2e-3, "peak learning rate", minimum=0)
    min_lr: float = setting(2e-4, "learning rate at the end of the decay", minimum=0, at_most="lr")
    lr_warmup_iters: int = setting(30, "linear warm-up steps (unless --lr-warmup-fraction)", minimum=0)
    lr_warmup_fraction: float | None = setting(None, "warm-up as a fraction of the decay steps (Megatron's rule; "
                                                     "overrides --lr-warmup-iters)", minimum=0, maximum=1)
    lr_decay_iters: int | None = setting(None, "steps over which the learning rate decays to --min-lr (default "
                                               "--train-iters); constant at --min-lr after", minimum=1)
    lr_decay_style: LRDecay = setting(LRDecay.COSINE, "decay after warm-up")
    lr_wsd_decay_style: LRWSDDecay = setting(LRWSDDecay.EXPONENTIAL, "--lr-decay-style WSD: how the last "
                                                                      "--lr-wsd-decay-iters steps anneal to --min-lr")
    lr_wsd_decay_iters: int | None = setting(None, "--lr-decay-style WSD: the final steps of the decay that anneal "
                                                   "(before them the peak --lr holds)", minimum=1)
    weight_decay: float = setting(0.1, "decoupled weight decay (not on biases and norms)", minimum=0)
    adam_beta1: float = setting(0.9, "AdamW beta1", minimum=0, below=1)
    adam_beta2: float = setting(0.95, "AdamW beta2", minimum=0, below=1)
    adam_eps: float = setting(1e-8, "AdamW epsilon", above=0)
    clip_grad: float = setting(1.0, "global grad-norm clip; 0 disables", minimum=0)
    # Muon (megalite/optim/muon.py, docs/muon.md): the hidden matrices; AdamW above on everything else
    optimizer: OptimizerKind = setting(OptimizerKind.ADAMW, "adamw everywhere, or muon on the transformer blocks' "
                                                            "2-D weights with AdamW on the rest")
    muon_lr: float | None = setting(None, "--optimizer muon: the Muon group's peak lr (default --lr; the schedule "
                                          "scales it in proportion)", minimum=0)
    muon_momentum: float = setting(0.95, "--optimizer muon: momentum (Nesterov)", minimum=0, below=1)
    muon_nesterov: bool = setting(True, "--optimizer muon: Nesterov momentum (--no-muon-nesterov: plain)")
    muon_ns_steps: int = setting(5, "--optimizer muon: Newton-Schulz iterations", minimum=1, maximum=99)
    muon_ns_coefficients: tuple[float, float, float] = setting((3.4445, -4.7750, 2.0315),
                                                               "--optimizer muon: the quintic's a b c", minimum=-100, maximum=100)
    muon_adjust_lr: MuonAdjustLR = setting(MuonAdjustLR.MATCH_RMS_ADAMW, "--optimizer muon: update scale of an "
                                                                          "[A, B] matrix: 0.2*sqrt(max(A, B)) "
                                                                          "(AdamW's lr carries over) or "
                                                                          "sqrt(max(1, A/B))")
    muon_ns_dtype: str = setting("bf16", "--optimizer muon: Newton-Schulz in bf16 (torch's, the recipes') or fp32 "
                                         "(slower; what the layout tests compare)", choices=("bf16", "fp32"))
    muon_owners: MuonOwners = setting(MuonOwners.BALANCED, "--optimizer muon: which rank orthogonalises which "
                                                           "matrix (balanced: the FLOPs spread)")


@dataclass(frozen=True)
class PrecisionSettings:
    """precision"""

    precision: Precision = setting(Precision.FP32, "parameter and activation dtype (bf16/fp16 keep fp32 master "
                                                   "weights and gradients)",
                                   aliases={"--bf16": Precision.BF16, "--fp16": Precision.FP16})
    grad_reduce_dtype: Precision = setting(Precision.FP32, "dtype of the data-parallel gradient reduction")
    initial_loss_scale: float = setting(2.0 ** 16, "fp16: first loss scale", above=0, maximum=FLOAT32_MAX,
                                        fix="the loss is scaled in float32: e.g. --initial-loss-scale 65536 (the "
                                            "default; Megatron's is 4294967296)")
    loss_scale_window: int = setting(1000, "fp16: steps without overflow to grow", minimum=1)
    hysteresis: int = setting(2, "fp16: overflows tolerated before the scale backs off", minimum=1)
    loss_scale_backoff: float = setting(0.5, "fp16: factor applied on backoff", above=0, below=1)
    fp8_format: Fp8Format | None = setting(None, "FP8 GEMMs in every transformer-block linear and expert (off by "
                                                 "default): e4m3, or hybrid (e5m2 gradients); docs/fp8.md")
    fp8_recipe: Fp8ScalingRecipe = setting(Fp8ScalingRecipe.TENSORWISE, "with --fp8-format: one scale per tensor "
                                                                         "(tensorwise), per row (rowwise), or per "
                                                                         "1x128 / 128x128 tile (blockwise)")
    fp8_scales: Fp8Scales = setting(Fp8Scales.POW2, "with --fp8-format: scales rounded down to a power of two "
                                                    "(pow2) or fp8 max / amax as it comes (exact); docs/fp8.md")
    fp8_param_gather: bool = setting(False, "with --fp8-format and --zero 3: all-gather the FP8 layers' weights in "
                                            "FP8 (1 byte per element on the wire); tensorwise only")


@dataclass(frozen=True)
class DataSettings:
    """data"""

    data_path: tuple[str, ...] | None = setting(None, "PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend (default: "
                                                      "the embedded corpus)")
    tokenizer: str | None = setting(None, "a tokenizer.json, a tokenizer directory or a SentencePiece .model (default: "
                                           "byte level; Megatron's --tokenizer-type flags: docs/megatron.md)")
    mock_data: bool = setting(False, "synthetic token ids over the model's vocabulary (deterministic per seed and "
                                     "sample), no corpus: for speed and memory runs of a real-vocabulary model")
    split: str = setting("969,30,1", "train,valid,test weights of the documents")
    sft: bool = setting(False, "--data-path holds SFT samples (tools/preprocess_data.py --sft: tokens and a loss "
                               "mask): sequences of whole samples, position ids restarting per sample, labels "
                               "-100 on prompt tokens and padding (megalite/data/sft_dataset.py)")
    sft_packing: bool = setting(True, "with --sft: pack several samples into each sequence (in a seeded order, "
                                      "none cut); --no-sft-packing: one sample per sequence, padded")
    sft_overlong: SFTOverlong = setting(SFTOverlong.REFUSE, "with --sft: a sample longer than --seq-length is "
                                                            "refused, naming it, or truncated to fit")
    # Megatron's document flags (data/documents.py, docs/documents.md): from the end-of-document token
    reset_position_ids: bool = setting(False, "positions restart at 0 after each end-of-document token (with "
                                              "--reset-attention-mask)")
    reset_attention_mask: bool = setting(False, "no token attends to another document of its sample (with "
                                                "--reset-position-ids: the documents are read from the positions)")
    eod_mask_loss: bool = setting(False, "no loss on the end-of-document tokens' targets")
    mean_document_length: float | None = setting(None, "with --reset-attention-mask: the planner's and "
                                                       "--simulate's mean tokens per document (attention FLOPs "
                                                       "and time; training counts its real documents)", above=0)


@dataclass(frozen=True)
class CheckpointSettings:
    """checkpoints (layout-free: save at one tp/pp/dp, load at any other)"""

    save: str | None = setting(None, "write checkpoints into DIR", metavar="DIR")
    load: str | None = setting(None, "resume from DIR's latest checkpoint (from scratch, with a notice, when it "
                                     "holds none); pass the same DIR as --save so one command line serves every "
                                     "restart", metavar="DIR")
    load_step: int | None = setting(None, "load this step instead of the latest", minimum=0)
    save_interval: int = setting(0, "save every N steps (0: only at the end/on signal)", minimum=0)
    keep_last: int = setting(0, "keep the newest N checkpoints (0: keep all)", minimum=0)
    keep_every: int = setting(0, "also keep every step that is a multiple of M", minimum=0)
    async_save: bool = setting(False, "copy to CPU memory, write in a background thread")
    no_load_optim: bool = setting(False, "load weights only (fresh optimizer, step 0)")
    finetune: bool = setting(False, "start a fine-tune from --load's checkpoint (or HF import): its weights and "
                                    "model only; a fresh optimizer, step 0, the data from its start, fresh RNG "
                                    "(a restart resumes from --save once that holds a checkpoint)")
    overwrite_checkpoints: bool = setting(False, "write into a --save directory although it holds checkpoints this "
                                                 "run does not resume (a fresh run, another --load, or an older "
                                                 "--load-step): they are replaced or pruned")
    elastic_batch: ElasticBatch = setting(ElasticBatch.KEEP, "resuming on another world (dp re-derived, tp/pp "
                                                             "kept): keep the checkpoint's global batch (more or "
                                                             "fewer accumulation steps; the loss curve continues), "
                                                             "or scale it with dp and rescale the learning rate")
    elastic_lr_rule: ElasticLRRule = setting(ElasticLRRule.LINEAR, "with --elastic-batch scale: the learning rate "
                                                                   "times the batch ratio r (linear) or sqrt(r)")
    override_data_order: bool = setting(False, "resume although --seed, --data-path, --split, --tokenizer or "
                                               "--seq-length differ from the checkpoint's run (the samples read "
                                               "from here on are not the ones it would have read)")
    override_opt_param_scheduler: bool = setting(False, "resume although --lr, --min-lr, --lr-warmup-iters, "
                                                        "--lr-decay-style or --train-iters differ from the "
                                                        "checkpoint's run (the learning-rate schedule changes)")


@dataclass(frozen=True)
class LoggingSettings:
    """logging, metrics and profiling"""

    log_interval: int = setting(50, "print and record every N steps", minimum=1)
    metrics_file: str | None = setting(None, "JSON lines, one object per logged step (the resolved configuration "
                                             "is written beside it)")
    tensorboard_dir: str | None = setting(None, "also write the metrics as TensorBoard scalars into DIR (pip install "
                                                "'megalite[tensorboard]')", metavar="DIR")
    wandb_project: str | None = setting(None, "also log the metrics to this Weights & Biases project (pip install "
                                              "'megalite[wandb]'; WANDB_MODE=offline logs locally)")
    wandb_exp_name: str | None = setting(None, "the W&B run's name (default: W&B's)")
    wandb_save_dir: str | None = setting(None, "where W&B keeps its files (default: ./wandb)", metavar="DIR")
    straggler_interval: int = setting(0, "every N steps name the slowest ranks (0: off)", minimum=0)
    peak_tflops: float | None = setting(None, "per-GPU peak for MFU (default: known GPUs)", above=0)
    profile_steps: tuple[int, int] | None = setting(None, "trace steps FIRST..LAST with torch.profiler on every rank "
                                                          "(Chrome trace per rank)", metavar=("FIRST", "LAST"),
                                                          minimum=1)
    profile_dir: str = setting("profile", "where --profile-steps writes its traces")
    memory_snapshot: str | None = setting(None, "on CUDA: record the allocator's history and write each rank's "
                                                "snapshot into DIR after --memory-snapshot-step, or when the run "
                                                "ends before it (an out-of-memory error); open it at "
                                                "pytorch.org/memory_viz", metavar="DIR")
    memory_snapshot_step: int = setting(2, "with --memory-snapshot: the step after which the snapshot is written",
                                        minimum=1)


@dataclass(frozen=True)
class FaultToleranceSettings:
    """hangs and numerical guards"""

    hang_timeout: float = setting(0.0, "seconds without a finished step before every rank reports where it waits "
                                       "and the job exits with code 86 (0: off; e.g. 300)", minimum=0,
                                       fix="0 turns the watchdog off; e.g. 300")
    hang_report_dir: str | None = setting(None, "where ranks leave hang reports (default: a temp dir per node; a "
                                                "shared file system gives one summary across nodes)")
    on_nonfinite: OnNonFinite = setting(OnNonFinite.SKIP, "a non-finite loss or gradient: skip the update and log "
                                                          "the step's samples, or stop (exit code 3)")
    max_skipped_steps: int = setting(50, "stop (exit code 3) after N steps in a row whose update was skipped (a "
                                         "non-finite loss or gradient, an fp16 overflow): a run that trains nothing "
                                         "must not end as if it had; 0: never", minimum=0)
    check_replicas_interval: int = setting(0, "every K steps compare parameter checksums across replicas and stop "
                                              "(exit code 4) naming the first that differs; 0: off", minimum=0)
    # recovery without a restart (docs/fault_tolerance.md): this job is one replica group of N
    ft_replica_groups: int = setting(0, "recovery without a restart: this job is one of N replica groups (each its "
                                        "own torchrun job and world) that agree a quorum every step through "
                                        "--ft-store, train on without a group that died and heal it from a live one "
                                        "when it restarts (0: off)", minimum=0)
    ft_group_id: int = setting(0, "this job's replica group, in [0, --ft-replica-groups)", minimum=0)
    ft_store: str | None = setting(None, "HOST:PORT of the run's key-value store (a TCPStore that outlives every "
                                         "group: tools/ft_store.py serves one)", metavar="HOST:PORT")
    ft_min_groups: int = setting(1, "fewer live replica groups than this (after --ft-join-timeout-s of waiting for "
                                    "restarted ones) ends the run in one line", minimum=1)
    ft_timeout_s: float = setting(30.0, "the longest wait for a live but slow replica group (quorum, link)", above=0)
    ft_dead_after_s: float = setting(1.0, "a replica group whose heartbeat is silent this long is dead", above=0)
    ft_join_timeout_s: float = setting(60.0, "a restarted replica group waiting to be admitted", above=0)


PARTS: dict[str, type] = {
    "model": ModelSettings, "parallel": ParallelSettings, "moe": MoESettings, "training": TrainingSettings,
    "optimizer": OptimizerSettings, "precision": PrecisionSettings, "data": DataSettings,
    "checkpoint": CheckpointSettings, "logging": LoggingSettings, "fault_tolerance": FaultToleranceSettings,
}
