"""RunConfig: every setting of a training run, declared once.

A setting is a field of one part (model, parallel, training, optimizer, precision, data,
checkpoint, logging, fault_tolerance) declared with `setting(default, help, ...)`: its name
(the flag is `--` + the name with dashes, Megatron-LM's spelling), its type (the annotation),
its default, its choices (an enum declared once in config_choices.py), its help and, for a
number, the values it accepts (`minimum=1`, `below=1`, `at_most="lr"`: config_bounds.py). Everything
else is generated from these declarations: the argparse parser and the TOML/JSON config files
(`megalite/cli.py`), the planner's view of the run (the planner reads a RunConfig), the
configuration saved in checkpoints and beside the metrics.

Derived quantities are computed here and only here: `resolved()` fills what depends on the
world (dp, global batch, schedule, vocabulary) and the properties give the number of
microbatches, the model architecture (GPTConfig), the padded vocabulary and the layers of each
pipeline stage. `validate()` returns every problem of the settings at once, each naming its fix;
the checks that need the planner or the world run where a run starts
(megalite.training.launch_checks), so the planner depends on this module and not the reverse.

Pure Python: no torch, so the planner and `tools/plan.py` start instantly.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from dataclasses import dataclass, field
from typing import Any

from megalite.model.config import PRESETS, GPTConfig, preset
from megalite.moe.config import MoEConfig
from megalite.pipeline.partition import chunk_layer_counts
from megalite.config_bounds import NO_BOUNDS, Bounds, bound_problems
from megalite.config_checks import data_problems, setting_problems
from megalite.config_choices import (  # noqa: F401  (re-exported: the choices belong to the settings)
    Precision, Recompute, Schedule, LRDecay, ElasticBatch, ElasticLRRule, OnNonFinite, CPCommType, GradCompression,
    MoEScoreFunction, MoELoadBalancing, MoEDropPolicy, MoEDispatcher)


def setting(default: Any, help: str, *, choices: tuple | None = None, metavar: str | None = None,
            aliases: dict[str, Any] | None = None, **bounds: Any) -> Any:
    """Declare one setting. `choices` for plain types (enums carry their own); `aliases` are
    extra flags that set a value (e.g. Megatron's --bf16 for precision = bf16); `bounds`, for
    numbers, the values it accepts (config_bounds.Bounds: minimum, maximum, above, below, finite,
    at_most=another setting, fix=advice), checked by `bound_problems` before anything uses them."""
    return field(default=default, metadata={"help": help, "choices": choices, "metavar": metavar,
                                            "aliases": aliases or {}, "bounds": Bounds(**bounds)})


@dataclass(frozen=True)
class ModelSettings:
    """model (explicit settings override the --model preset)"""

    model: str = setting("tiny", "preset", choices=tuple(sorted(PRESETS)))
    num_layers: int | None = setting(None, "transformer blocks", minimum=1)
    hidden_size: int | None = setting(None, "model width h", minimum=1)
    num_attention_heads: int | None = setting(None, "query heads", minimum=1)
    num_query_groups: int | None = setting(None, "key/value heads (grouped-query attention)", minimum=1)
    ffn_hidden_size: int | None = setting(None, "MLP inner width", minimum=1)
    seq_length: int | None = setting(None, "sequence length (tokens per sample)", minimum=1)
    vocab_size: int | None = setting(None, "vocabulary (default: the tokenizer's)", minimum=1)
    hidden_dropout: float = setting(0.0, "dropout on the residual branches and the embedding", minimum=0, below=1)
    attention_dropout: float = setting(0.0, "dropout on the attention probabilities", minimum=0, below=1)


@dataclass(frozen=True)
class ParallelSettings:
    """parallel layout and memory techniques"""

    tp: int = setting(1, "tensor-parallel size", minimum=1)
    pp: int = setting(1, "pipeline-parallel size", minimum=1)
    dp: int | None = setting(None, "data-parallel size (default: world / (tp*cp*pp))", minimum=1)
    cp: int = setting(1, "context-parallel size: each rank holds seq_length/cp tokens of every sequence (2*cp "
                         "load-balanced chunks); only attention crosses ranks", minimum=1)
    cp_comm_type: CPCommType = setting(CPCommType.P2P, "context-parallel attention: p2p (ring attention, K/V "
                                                       "round the cp ring) or a2a (Ulysses all-to-all; heads/tp "
                                                       "must divide by cp)")
    ep: int = setting(1, "expert-parallel size (Megatron's --expert-model-parallel-size): the experts of each MoE "
                         "layer are sharded over ep ranks of the dp x cp group (ep divides dp*cp); expert "
                         "gradients reduce over the dp*cp/ep ranks holding the same experts", minimum=1)
    moe_token_dispatcher_type: MoEDispatcher = setting(MoEDispatcher.ALLTOALL, "how tokens reach their experts' ep "
                                                                               "ranks: alltoall (per-rank counts) "
                                                                               "or allgather")
    virtual_stages: int = setting(1, "model chunks per pipeline rank (interleaved)", minimum=1)
    pipeline_schedule: Schedule | None = setting(None, "default: 1f1b, or interleaved when --virtual-stages > 1")
    decoder_first_stage_layers: int | None = setting(None, "blocks of the first model chunk (default: an even split)",
                                                     minimum=0)
    decoder_last_stage_layers: int | None = setting(None, "blocks of the last model chunk (default: an even split)",
                                                    minimum=0)
    pipeline_layout: str | None = setting(None, "explicit blocks per model chunk, e.g. 3,5,5,3 (pp*v numbers)")
    sequence_parallel: bool = setting(False, "shard norms, dropouts and residuals along the sequence over tp")
    zero: int = setting(0, "ZeRO stage: 1 shards the optimizer state over dp, 2 also the gradients, 3 also the "
                           "parameters (gathered unit by unit: embedding, each block, head)", choices=(0, 1, 2, 3))
    zero3_prefetch: int = setting(1, "zero 3: units whose all-gather is started ahead of the running one",
                                  metavar="N", minimum=0)
    zero3_reshard_after_forward: bool = setting(True, "zero 3: free a unit's parameters after its forward and gather "
                                                      "them again for its backward (off: keep them, one gather less "
                                                      "per microbatch, more memory)")
    zero3_keep_gathered_in_step: bool = setting(False, "zero 3: gather each unit once per step and keep it until the "
                                                       "optimizer (pipelines: no re-gather per microbatch)")
    offload_optimizer: bool = setting(False, "keep the optimizer state in host memory and update there")
    overlap_param_gather: bool = setting(False, "zero >= 1: the parameter all-gathers finish behind the next "
                                                "forward; every read waits for its own bucket")
    ddp_bucket_size: int = setting(40_000_000, "elements per gradient bucket", minimum=1)
    recompute: Recompute = setting(Recompute.NONE, "activation recompute")
    recompute_num_layers: int | None = setting(None, "with --recompute full: only the first N blocks of each model "
                                                     "chunk (Megatron's block method); default all", metavar="N",
                                                     minimum=1)
    fused_linear_cross_entropy: bool = setting(False, "output layer + cross entropy in token chunks: the logits "
                                                      "[tokens, vocab/tp] are never held (one more output GEMM)")
    grad_compression: GradCompression = setting(GradCompression.NONE, "compress the dp gradient reduction: powersgd "
                                                                      "sends rank-R factors of each matrix (error "
                                                                      "feedback keeps what they miss for the next "
                                                                      "step); zero 0-2")
    powersgd_rank: int = setting(4, "PowerSGD: rank R of the factors (R*(n+m) elements per n x m matrix instead of "
                                    "n*m)", metavar="R", minimum=1, fix="4 is a good start")
    powersgd_warmup_steps: int = setting(0, "PowerSGD: the first N steps reduce uncompressed", metavar="N",
                                         minimum=0)
    powersgd_min_compression: float = setting(2.0, "PowerSGD: matrices that would not shrink by at least this "
                                                   "factor (and every 1-D parameter) are reduced uncompressed",
                                              minimum=0, fix="0 compresses every matrix; 2 is the default")


@dataclass(frozen=True)
class MoESettings:
    """mixture of experts (Megatron's flags; unset: the --model preset's, else megalite.moe.MoEConfig's default)"""

    num_experts: int | None = setting(None, "routed experts per MoE layer (turns the model's MLPs into mixtures of "
                                            "experts)", minimum=1)
    moe_router_topk: int | None = setting(None, "experts per token (default 2)", minimum=1)
    moe_ffn_hidden_size: int | None = setting(None, "each expert's inner width (default: --ffn-hidden-size)", minimum=1)
    moe_layer_freq: int | None = setting(None, "every N-th block (from block 0) is an MoE block (default 1: all)",
                                         metavar="N", minimum=1)
    moe_router_score_function: MoEScoreFunction | None = setting(None, "router scores (default softmax)")
    moe_router_pre_softmax: bool | None = setting(None, "softmax over all experts before the top-k (default off: a "
                                                        "softmax over the k chosen logits, Mixtral's renormalised "
                                                        "weights)")
    moe_router_load_balancing_type: MoELoadBalancing | None = setting(None, "balancing loss: over the layer's tokens "
                                                                            "(aux_loss, default), per sequence, or "
                                                                            "none")
    moe_aux_loss_coeff: float | None = setting(None, "weight of the load-balancing loss (default 0)", minimum=0)
    moe_z_loss_coeff: float | None = setting(None, "weight of the router z-loss (default 0)", minimum=0)
    moe_router_enable_expert_bias: bool | None = setting(None, "DeepSeek-V3 auxiliary-loss-free balancing: a "
                                                               "per-expert score bias for the choice, stepped toward "
                                                               "the mean load after each step")
    moe_router_bias_update_rate: float | None = setting(None, "step of the expert bias (default 1e-3)", minimum=0)
    moe_shared_expert_intermediate_size: int | None = setting(None, "inner width of an always-active shared expert "
                                                                    "(default none)", minimum=1)
    moe_expert_capacity_factor: float | None = setting(None, "cap each expert at factor * tokens * topk / experts "
                                                             "routes per rank and layer (default: dropless)", above=0)
    moe_token_drop_policy: MoEDropPolicy | None = setting(None, "over capacity keep the highest-probability routes "
                                                                "(probs, default) or the earliest tokens (position)")


@dataclass(frozen=True)
class TrainingSettings:
    """training"""

    train_iters: int = setting(600, "optimizer steps", minimum=1)
    micro_batch_size: int = setting(8, "sequences per microbatch and dp rank", minimum=1)
    global_batch_size: int | None = setting(None, "sequences per optimizer step (default: micro-batch-size * dp)",
                                                  minimum=1)
    seed: int = setting(1234, "seed of the weights, the data order and dropout", minimum=0, maximum=2**32 - 1)
    eval_interval: int = setting(0, "evaluate every N steps (0: only at the end)", minimum=0)
    eval_iters: int = setting(4, "global batches per evaluation", minimum=0)
    cuda_graph: bool = setting(False, "capture each microbatch's forward and backward once as a CUDA graph and "
                                      "replay it (static shapes; tp = pp = cp = 1, zero 0/1, no dropout, "
                                      "recompute or offload; training/cuda_graph.py)")


@dataclass(frozen=True)
class OptimizerSettings:
    """optimizer (AdamW) and learning-rate schedule"""

    lr: float = setting(2e-3, "peak learning rate", minimum=0)
    min_lr: float = setting(2e-4, "learning rate at the end of the decay", minimum=0, at_most="lr")
    lr_warmup_iters: int = setting(30, "linear warm-up steps", minimum=0)
    lr_decay_style: LRDecay = setting(LRDecay.COSINE, "decay after warm-up")
    weight_decay: float = setting(0.1, "decoupled weight decay (not on biases and norms)", minimum=0)
    adam_beta1: float = setting(0.9, "AdamW beta1", minimum=0, below=1)
    adam_beta2: float = setting(0.95, "AdamW beta2", minimum=0, below=1)
    adam_eps: float = setting(1e-8, "AdamW epsilon", above=0)
    clip_grad: float = setting(1.0, "global grad-norm clip; 0 disables", minimum=0)


@dataclass(frozen=True)
class PrecisionSettings:
    """precision"""

    precision: Precision = setting(Precision.FP32, "parameter and activation dtype (bf16/fp16 keep fp32 master "
                                                   "weights and gradients)",
                                   aliases={"--bf16": Precision.BF16, "--fp16": Precision.FP16})
    grad_reduce_dtype: Precision = setting(Precision.FP32, "dtype of the data-parallel gradient reduction")
    initial_loss_scale: float = setting(2.0 ** 16, "fp16: first loss scale", above=0)
    loss_scale_window: int = setting(1000, "fp16: steps without overflow to grow", minimum=1)
    hysteresis: int = setting(2, "fp16: overflows tolerated before the scale backs off", minimum=1)
    loss_scale_backoff: float = setting(0.5, "fp16: factor applied on backoff", above=0, below=1)


@dataclass(frozen=True)
class DataSettings:
    """data"""

    data_path: tuple[str, ...] | None = setting(None, "PREFIX, or W1 PREFIX1 W2 PREFIX2 ... to blend (default: "
                                                      "the embedded corpus)")
    tokenizer: str | None = setting(None, "path to a tokenizer.json (default: byte level)")
    split: str = setting("969,30,1", "train,valid,test weights of the documents")


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
    elastic_batch: ElasticBatch = setting(ElasticBatch.KEEP, "resuming on another world (dp re-derived, tp/pp "
                                                             "kept): keep the checkpoint's global batch (more or "
                                                             "fewer accumulation steps; the loss curve continues), "
                                                             "or scale it with dp and rescale the learning rate")
    elastic_lr_rule: ElasticLRRule = setting(ElasticLRRule.LINEAR, "with --elastic-batch scale: the learning rate "
                                                                   "times the batch ratio r (linear) or sqrt(r)")


@dataclass(frozen=True)
class LoggingSettings:
    """logging, metrics and profiling"""

    log_interval: int = setting(50, "print and record every N steps", minimum=1)
    metrics_file: str | None = setting(None, "JSON lines, one object per logged step (the resolved configuration "
                                             "is written beside it)")
    tensorboard_dir: str | None = setting(None, "also write scalars for TensorBoard (when installed)")
    straggler_interval: int = setting(0, "every N steps name the slowest ranks (0: off)", minimum=0)
    peak_tflops: float | None = setting(None, "per-GPU peak for MFU (default: known GPUs)", above=0)
    profile_steps: tuple[int, int] | None = setting(None, "trace steps FIRST..LAST with torch.profiler on every rank "
                                                          "(Chrome trace per rank)", metavar=("FIRST", "LAST"),
                                                          minimum=1)
    profile_dir: str = setting("profile", "where --profile-steps writes its traces")


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
    check_replicas_interval: int = setting(0, "every K steps compare parameter checksums across replicas and stop "
                                              "(exit code 4) naming the first that differs; 0: off", minimum=0)


PARTS: dict[str, type] = {
    "model": ModelSettings, "parallel": ParallelSettings, "moe": MoESettings, "training": TrainingSettings,
    "optimizer": OptimizerSettings, "precision": PrecisionSettings, "data": DataSettings,
    "checkpoint": CheckpointSettings, "logging": LoggingSettings, "fault_tolerance": FaultToleranceSettings,
}


@dataclass(frozen=True)
class Setting:
    """One declared setting, as the parser, the config files and validation see it."""

    name: str
    part: str
    type: Any  # the annotation with None removed: int, float, str, bool, an enum, tuple[...]
    optional: bool
    default: Any
    help: str
    choices: tuple | None
    metavar: Any
    aliases: dict[str, Any]
    bounds: Bounds = NO_BOUNDS

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@functools.cache
def settings() -> dict[str, Setting]:
    """Every declared setting by name, in declaration order (names are unique across parts)."""
    out: dict[str, Setting] = {}
    for part, cls in PARTS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, args = hints[f.name], typing.get_args(hints[f.name])
            optional = type(None) in args
            if optional:
                kind = next(a for a in args if a is not type(None))
            choices = tuple(kind) if isinstance(kind, type) and issubclass(kind, enum.Enum) else f.metadata["choices"]
            if f.name in out:
                raise TypeError(f"setting {f.name!r} is declared twice ({out[f.name].part} and {part})")
            bounds = f.metadata["bounds"]
            if bounds.declared and not _numeric(kind):
                raise TypeError(f"setting {f.name!r}: bounds are for numbers, not {kind}")
            out[f.name] = Setting(f.name, part, kind, optional, f.default, f.metadata["help"], choices,
                                  f.metadata["metavar"], f.metadata["aliases"], bounds)
    return out


def _numeric(kind: Any) -> bool:
    inner = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else kind
    return inner in (int, float)


def coerce(spec: Setting, value: Any) -> Any:
    """A value from a flag or a config file as the setting's type; ValueError naming the setting."""
    if value is None:
        if spec.optional:
            return None
        raise ValueError(f"{spec.flag.lstrip('-')} cannot be empty (default: {spec.default})")
    kind = spec.type
    if typing.get_origin(kind) is tuple:
        items = [value] if isinstance(value, (str, int, float)) else list(value)
        inner = typing.get_args(kind)[0]
        if typing.get_args(kind)[-1] is not Ellipsis and len(items) != len(typing.get_args(kind)):
            raise ValueError(f"{spec.flag.lstrip('-')} takes {len(typing.get_args(kind))} values, got {items!r}")
        return tuple(_scalar(spec, inner, item) for item in items)
    return _scalar(spec, kind, value)


def _scalar(spec: Setting, kind: Any, value: Any) -> Any:
    name = spec.flag.lstrip("-")
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name} = {value!r} is not one of {[c.value for c in kind]}") from None
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} takes true or false, got {value!r}")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} takes an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{name} takes a number, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise ValueError(f"{name} takes a string, got {value!r}")
    value = kind(value)
    if spec.choices is not None and value not in spec.choices:
        raise ValueError(f"{name} = {value!r} is not one of {list(spec.choices)}")
    return value


@dataclass(frozen=True)
class RunConfig:
    """A whole run's configuration: one frozen object of parts (see the module docstring)."""

    model: ModelSettings = field(default_factory=ModelSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    moe: MoESettings = field(default_factory=MoESettings)
    training: TrainingSettings = field(default_factory=TrainingSettings)
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    precision: PrecisionSettings = field(default_factory=PrecisionSettings)
    data: DataSettings = field(default_factory=DataSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    fault_tolerance: FaultToleranceSettings = field(default_factory=FaultToleranceSettings)

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(cls, **values: Any) -> "RunConfig":
        """A RunConfig from flat setting names (`RunConfig.build(tp=2, zero=1)`); the rest default."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> "RunConfig":
        """A copy with the named settings changed (flat names; each is placed in its part)."""
        specs, changes = settings(), {}
        for name, value in values.items():
            if name not in specs:
                raise TypeError(f"unknown setting {name!r}")
            changes.setdefault(specs[name].part, {})[name] = coerce(specs[name], value)
        parts = {part: dataclasses.replace(getattr(self, part), **fields) for part, fields in changes.items()}
        return dataclasses.replace(self, **parts)

    def flat(self) -> dict[str, Any]:
        """{setting name: value} over every part."""
        return {name: getattr(getattr(self, spec.part), name) for name, spec in settings().items()}

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{part: {setting: value}}, JSON-ready (enums as their values, tuples as lists)."""
        out: dict[str, dict[str, Any]] = {part: {} for part in PARTS}
        for name, value in self.flat().items():
            out[settings()[name].part][name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, grouped: dict[str, dict[str, Any]]) -> "RunConfig":
        """Inverse of to_dict (e.g. the configuration saved in a checkpoint)."""
        return cls.build(**{name: value for part in grouped.values() for name, value in part.items()})

    # ------------------------------------------------------------------ derived (computed here only)

    def resolved(self, world_size: int, tokenizer_vocab_size: int | None = None) -> "RunConfig":
        """What depends on the launch filled in: dp (world / (tp*cp*pp)), the global batch
        (micro * dp when unset), the schedule's name, and the vocabulary (the tokenizer's)."""
        p = self.parallel
        model_ranks = p.tp * p.cp * p.pp
        dp = p.dp if p.dp is not None else (world_size // model_ranks if world_size % model_ranks == 0 else 1)
        schedule = p.pipeline_schedule or (Schedule.INTERLEAVED if p.virtual_stages > 1 else Schedule.ONE_F_ONE_B)
        if schedule == Schedule.ONE_F_ONE_B and p.virtual_stages > 1:
            schedule = Schedule.INTERLEAVED  # Megatron's name for 1F1B with virtual stages
        return self.replace(dp=dp, pipeline_schedule=schedule,
                            global_batch_size=self.training.global_batch_size or self.training.micro_batch_size * dp,
                            vocab_size=self.model.vocab_size or tokenizer_vocab_size)

    @property
    def dp(self) -> int:
        return self.parallel.dp or 1

    @property
    def world_size(self) -> int:
        return self.parallel.tp * self.parallel.cp * self.parallel.pp * self.dp

    @property
    def schedule(self) -> Schedule:
        return self.parallel.pipeline_schedule or self.resolved(self.world_size).parallel.pipeline_schedule

    @property
    def global_batch_size(self) -> int:
        return self.training.global_batch_size or self.training.micro_batch_size * self.dp

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on each dp rank (gradient accumulation steps)."""
        return max(1, self.global_batch_size // (self.training.micro_batch_size * self.dp))

    @property
    def training_dtype(self) -> str:
        return self.precision.precision.value

    def gpt_config(self) -> GPTConfig:
        """The model architecture: the preset with the explicit model settings (ValueError if invalid)."""
        m = self.model
        model = preset(m.model, num_layers=m.num_layers, hidden_size=m.hidden_size,
                       num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
                       ffn_hidden_size=m.ffn_hidden_size, seq_length=m.seq_length, vocab_size=m.vocab_size,
                       hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout)
        moe = self.moe_settings_given()
        if moe:  # the preset's experts (if any) with the explicit MoE settings over them
            base = dataclasses.asdict(model.moe) if model.moe is not None else {}
            if "num_experts" not in {**base, **moe}:
                flags = ", ".join("--" + k.replace("_", "-") for k, v in dataclasses.asdict(self.moe).items()
                                  if v is not None)
                raise ValueError(f"{flags} configure experts but the model has none: add --num-experts N (or a "
                                 f"preset with experts, e.g. --model moe-tiny)")
            model = model.replace(moe=MoEConfig(**{**base, **moe}))
        return model

    def moe_settings_given(self) -> dict[str, Any]:
        """The MoE settings set explicitly, as MoEConfig keywords (the flag names less their moe_router_/moe_)."""
        names = {"num_experts": "num_experts", "moe_router_topk": "topk", "moe_ffn_hidden_size": "ffn_hidden_size",
                 "moe_layer_freq": "layer_freq", "moe_router_score_function": "score_function",
                 "moe_router_pre_softmax": "pre_softmax", "moe_router_load_balancing_type": "load_balancing_type",
                 "moe_aux_loss_coeff": "aux_loss_coeff", "moe_z_loss_coeff": "z_loss_coeff",
                 "moe_router_enable_expert_bias": "enable_expert_bias",
                 "moe_router_bias_update_rate": "bias_update_rate",
                 "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
                 "moe_expert_capacity_factor": "capacity_factor", "moe_token_drop_policy": "token_drop_policy"}
        given = {names[k]: v for k, v in dataclasses.asdict(self.moe).items() if v is not None}
        return {k: (str(v) if isinstance(v, enum.Enum) else v) for k, v in given.items()}

    def chunk_layer_counts(self, num_layers: int) -> list[int]:
        """Blocks of each model chunk (pp * virtual_stages of them; ValueError if impossible)."""
        p = self.parallel
        return chunk_layer_counts(num_layers, p.pp, p.virtual_stages, p.decoder_first_stage_layers,
                                  p.decoder_last_stage_layers, p.pipeline_layout)

    def derived(self, tokenizer_vocab_size: int | None = None) -> dict[str, Any]:
        """The values computed from the settings, for --print-config and the run's banner."""
        model = self.gpt_config()
        return {"world_size": self.world_size, "dp": self.dp, "pipeline_schedule": str(self.schedule),
                "global_batch_size": self.global_batch_size, "num_microbatches": self.num_microbatches,
                "num_layers": model.num_layers, "hidden_size": model.hidden_size, "seq_length": model.seq_length,
                "vocab_size": model.vocab_size, "padded_vocab_size": model.padded_vocab_size(self.parallel.tp),
                "params": model.num_params(), "chunk_layers": self.chunk_layer_counts(model.num_layers)}

    # ------------------------------------------------------------------ validation

    def bound_problems(self) -> list[str]:
        """The settings outside the values their declarations accept (config_bounds.py), one
        message each naming the flag and the fix."""
        return bound_problems(settings().values(), self.flat())

    def validate(self) -> list[str]:
        """Every problem with the settings themselves, each naming its fix ([] when they hold): the
        declared bounds, the model architecture, combinations of settings, the data files. Pure:
        reads only the settings and, for --data-path, whether the files exist.

        What needs the world or the planner (world size, divisibility by tp/pp/cp, batch arithmetic,
        the pipeline schedule, memory) is checked where a run starts, on every rank before any
        process group exists: `megalite.training.launch_checks.launch_problems`, which includes these."""
        problems = self.bound_problems()
        if not problems:  # (a model of zero-sized dimensions cannot even be described)
            try:
                self.gpt_config()
            except ValueError as exc:
                problems.append(str(exc))
        problems += setting_problems(self) + data_problems(self.data)
        return list(dict.fromkeys(problems))
