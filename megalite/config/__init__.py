"""RunConfig: every setting of a training run, declared once.

A setting is a field of one part (model, parallel, moe, training, optimizer, precision, data,
checkpoint, logging, fault_tolerance; the parts live in config/model_parts.py and config/run_parts.py) declared with
`setting(default, help, ...)`: its name
(the flag is `--` + the name with dashes, Megatron-LM's spelling), its type (the annotation),
its default, its choices (an enum declared once in config/choices.py), its help and, for a
number, the values it accepts (`minimum=1`, `below=1`, `at_most="lr"`: config/bounds.py). Everything
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
import json
import typing
from dataclasses import dataclass, field
from typing import Any

from megalite.config.mla import latent_attention
from megalite.config.model import GPTConfig, preset
from megalite.layout import Layout
from megalite.config.moe import MoEConfig
from megalite.pipeline.partition import chunk_layer_counts
from megalite.config import megatron
from megalite.config.bounds import NO_BOUNDS, Bounds, bound_problems
from megalite.config.checks import data_problems, setting_problems
from megalite.config.choices import (  # noqa: F401  (re-exported: the choices belong to the settings)
    Precision, Recompute, Schedule, LRDecay, ElasticBatch, ElasticLRRule, OnNonFinite, CPCommType, CPSplit,
    GradCompression, MoEScoreFunction, MoELoadBalancing, MoEDropPolicy, MoEDispatcher, SFTOverlong)


from megalite.config.setting import setting  # noqa: F401  (re-exported: how a setting is declared)
from megalite.config.model_parts import ModelSettings, ParallelSettings, MoESettings  # noqa: F401  (RunConfig's parts)
from megalite.config.run_parts import (  # noqa: F401  (re-exported: RunConfig's other parts, and all of them in order)
    TrainingSettings, OptimizerSettings, PrecisionSettings, DataSettings, CheckpointSettings, LoggingSettings,
    FaultToleranceSettings, PARTS)


# MoEConfig fields a run may change over a checkpoint's experts (the rest are the model's shape)
MOE_TRAINING_FIELDS = ("load_balancing_type", "aux_loss_coeff", "z_loss_coeff", "enable_expert_bias",
                       "bias_update_rate", "capacity_factor", "token_drop_policy", "force_load_balancing")


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
    synonyms: tuple[str, ...] = ()  # other names of `flag` (same value), e.g. --expert-model-parallel-size

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
                                  f.metadata["metavar"], {**f.metadata["aliases"], **megatron.ALIASES.get(f.name, {})},
                                  bounds, f.metadata["synonyms"] + megatron.SYNONYMS.get(f.name, ()))
    taken = [flag.lstrip("-").replace("-", "_") for s in out.values() for flag in (*s.synonyms, *s.aliases)]
    clashes = sorted({name for name in taken if name in out or taken.count(name) > 1})
    if clashes:  # a config key or a flag would name two settings
        raise TypeError(f"flag synonym or alias {clashes[0]!r} is also another setting's name or declared twice")
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
    # Not a setting: the GPTConfig (as JSON) of the checkpoint --load names, which is then the model
    # (megalite.checkpoint.model_shape.adopt_checkpoint_model sets it; gpt_config reads it)
    checkpoint_model: str | None = None

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
        return self.replace(dp=dp, pipeline_schedule=self._schedule_name(),
                            global_batch_size=self.training.global_batch_size or self.training.micro_batch_size * dp,
                            vocab_size=self.model.vocab_size or tokenizer_vocab_size)

    @property
    def dp(self) -> int:
        return self.parallel.dp or 1

    @property
    def dp_shard(self) -> int:
        """S, the data-parallel ranks ZeRO shards over: --dp-shard, or dp / --num-distributed-optimizer-instances,
        else dp (flat ZeRO). `checks.dp_shard_problems` refuses a value that does not divide dp."""
        p = self.parallel
        if p.dp_shard is not None:
            return p.dp_shard
        instances = p.num_distributed_optimizer_instances
        return self.dp // instances if instances and self.dp % instances == 0 else self.dp

    @property
    def world_size(self) -> int:
        return self.parallel.tp * self.parallel.cp * self.parallel.pp * self.dp

    @property
    def etp_size(self) -> int:
        """The expert tensor-parallel size the experts run with: --etp when it is 1 or --tp (validate()
        refuses anything else, read here as --tp). The mesh's `etp_size` for an MoE model."""
        etp, tp = self.parallel.etp, self.parallel.tp
        return etp if etp in (1, tp) else tp

    def layout(self, world_size: int | None = None, model: GPTConfig | None = None) -> Layout:
        """The run's parallel sizes as one validated `Layout` (LayoutError naming the fix): on `world_size`
        ranks when given (dp inferred from it when --dp is unset), for `model`'s experts (default: this
        configuration's model; ValueError if that cannot be built)."""
        p, model = self.parallel, model if model is not None else self.gpt_config()
        # --dp-shard as given; from --num-distributed-optimizer-instances only once dp is known
        dp_shard = p.dp_shard if p.dp_shard is not None or p.dp is None else self.dp_shard
        return Layout(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, vp=p.virtual_stages, ep=p.ep, etp=p.etp, world=world_size,
                      dp_shard=dp_shard, num_experts=model.moe.num_experts if model.moe is not None else 0)

    @property
    def experts_whole(self) -> bool:
        """etp = 1 under tp > 1: whole experts on every tp rank, each routing its own 1/tp of the tokens
        (the mesh's and `LayerGroups`' `experts_whole`); False: experts split over tp like the dense MLP."""
        return self.etp_size < self.parallel.tp

    @property
    def schedule(self) -> Schedule:
        return self.parallel.pipeline_schedule or self._schedule_name()

    def _schedule_name(self) -> Schedule:
        """The schedule run: the one given, else 1f1b, or interleaved when --virtual-stages > 1."""
        p = self.parallel
        schedule = p.pipeline_schedule or (Schedule.INTERLEAVED if p.virtual_stages > 1 else Schedule.ONE_F_ONE_B)
        if schedule == Schedule.ONE_F_ONE_B and p.virtual_stages > 1:
            schedule = Schedule.INTERLEAVED  # Megatron's name for 1F1B with virtual stages
        return schedule

    @property
    def global_batch_size(self) -> int:
        return self.training.global_batch_size or self.training.micro_batch_size * self.dp

    @property
    def num_microbatches(self) -> int:
        """Microbatches per step on each dp rank (gradient accumulation steps)."""
        return max(1, self.global_batch_size // (self.training.micro_batch_size * self.dp))

    @property
    def lr_schedule_iters(self) -> tuple[int, int]:
        """(warm-up steps, decay steps) of the learning rate (--lr-warmup-fraction, --lr-decay-iters)."""
        return megatron.lr_iters(self.optimizer, self.training.train_iters)

    @property
    def training_dtype(self) -> str:
        return self.precision.precision.value

    def with_checkpoint_model(self, model_json: str | None) -> "RunConfig":
        """A copy whose model is `model_json` (a checkpoint's GPTConfig as JSON; None: the settings')."""
        return dataclasses.replace(self, checkpoint_model=model_json)

    def gpt_config(self) -> GPTConfig:
        """The model architecture: the preset with the explicit model settings (ValueError if invalid), or
        the checkpoint's model with the settings that are no part of its shape (`checkpoint_model`)."""
        m = self.model
        if self.checkpoint_model is not None:
            return self._checkpoint_gpt_config()
        given = dict(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
                     num_query_groups=m.num_query_groups, ffn_hidden_size=m.ffn_hidden_size,
                     seq_length=m.seq_length, vocab_size=m.vocab_size, hidden_dropout=m.hidden_dropout,
                     attention_dropout=m.attention_dropout, window_size=m.window_size)
        # Megatron's names (--init-method-std, --swiglu, ...) over them: config.megatron.model_overrides
        model = preset(m.model, **{**given, **megatron.model_overrides(m)})
        problem = megatron.position_problem(m, model.seq_length)
        if problem:
            raise ValueError(problem)
        model = latent_attention(model, m)
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

    def _checkpoint_gpt_config(self) -> GPTConfig:
        """The checkpoint's model with this run's dropouts, --seq-length (when given) and MoE training
        settings (megalite.checkpoint.model_shape refused any shape flag that contradicts it)."""
        m = self.model
        model = GPTConfig(**json.loads(self.checkpoint_model))
        model = model.replace(hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                              seq_length=m.seq_length or model.seq_length)
        training_moe = {k: v for k, v in self.moe_settings_given().items() if k in MOE_TRAINING_FIELDS}
        if model.moe is not None and training_moe:
            model = model.replace(moe=model.moe.replace(**training_moe))
        problem = megatron.position_problem(m, model.seq_length)
        if problem:
            raise ValueError(problem)
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
                 "moe_expert_capacity_factor": "capacity_factor", "moe_token_drop_policy": "token_drop_policy",
                 "moe_router_force_load_balancing": "force_load_balancing", "moe_router_num_groups": "num_groups",
                 "moe_router_group_topk": "group_topk", "moe_router_topk_scaling_factor": "topk_scaling_factor"}
        given = {names[k]: v for k, v in dataclasses.asdict(self.moe).items() if v is not None}
        if "layer_freq" in given and len(given["layer_freq"]) == 1:  # one number: a frequency, not a list
            given["layer_freq"] = given["layer_freq"][0]
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
        """The settings outside the values their declarations accept (config/bounds.py), one
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
