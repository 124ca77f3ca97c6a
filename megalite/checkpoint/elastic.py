"""Elastic resize: a run's checkpoint resumed on another world, planned before any process group exists.

    plan = plan_resume(cfg, world_size, given_settings(argv))   # every rank, from the shared --load directory
    cfg = plan.cfg                                               # then resolved and validated as usual

A checkpoint holds the resolved configuration of the run that wrote it (metadata["train_config"])
and this module's `ElasticState` (metadata["extra"]["elastic"]). When a run resumes on a world of
another size (a new launch with fewer or more ranks, or `torchrun --nnodes MIN:MAX` restarting with
the nodes it has):

- the layout: tp, pp, cp and ep are the checkpoint's unless given on the command
  line; dp is re-derived from the new world (a `--dp` equal to the checkpoint's, i.e. the same
  command line launched again, is dropped; another `--dp` is the person's choice and is validated).
  An ep that is the checkpoint's (kept, or the same `--ep` given again) but no longer divides the
  new dp x cp becomes the largest ep below it that divides both dp x cp and the expert count
  (experts load at any ep: checkpoints store each expert whole);
- the global batch, by `--elastic-batch`:
  keep  (default) the checkpoint's global batch G, split into G / (micro * new dp) accumulation
        steps. Every step then reads the same samples in the same microbatches and the loss curve
        continues (see docs/architecture/decisions.md for what is bit-identical in fp32);
  scale G * new dp / old dp (each replica keeps its microbatches per step), and --lr / --min-lr
        times r (`--elastic-lr-rule linear`) or sqrt(r) (`sqrt`), r = new G / old G. The factor
        compounds over resizes and is carried in every checkpoint, so a plain restart keeps it;
- the data position is the checkpoint's consumed_samples, a global index: the next step reads
  positions [consumed, consumed + G) whatever the world, so no sample is read twice or skipped.

The batch is state of the run, like the step: on any resume (resized or not) the checkpoint's
global batch and learning-rate factor carry over while the batch flags are the ones the checkpoint's
run was given (`--global-batch-size`, or `--micro-batch-size` when the global batch was left to
default to micro * dp). Different batch flags are a deliberate change: the flags' batch is used at the
new dp and the factor restarts at 1.

A resize that cannot work (the world not a multiple of tp*pp, a kept batch that the new dp does not
divide) is a ConfigError naming the fix, raised on every rank before any collective. Pure file reads:
every rank reads the same metadata.json, so every rank plans the same run.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megalite.config.choices import ElasticBatch
from megalite.checkpoint import storage
from megalite.checkpoint.reader import CheckpointReader
from megalite.checkpoint.storage import CheckpointCorruptError
from megalite.config import ElasticBatch, ElasticLRRule, RunConfig, settings
from megalite.errors import ConfigError

STATE_KEY = "elastic"  # metadata["extra"][STATE_KEY]
KEPT_LAYOUT = ("tp", "pp", "cp", "ep")  # kept from the checkpoint on a resize unless given


@dataclass(frozen=True)
class ElasticState:
    """What a checkpoint carries about its run's batch besides train_config: the batch flags the run
    was given (to tell the same command line launched again from a deliberate change) and the factor
    that scale resizes applied to --lr and --min-lr."""

    requested_global_batch_size: int | None  # --global-batch-size as given (None: micro * dp)
    requested_micro_batch_size: int
    lr_factor: float = 1.0

    @classmethod
    def of_flags(cls, cfg: RunConfig) -> "ElasticState":
        """The state of a run that starts from these flags (given, not yet resolved)."""
        return cls(cfg.training.global_batch_size, cfg.training.micro_batch_size)

    def request(self) -> tuple:
        """What decides the batch: the global batch when given, else the micro batch (G = micro * dp)."""
        if self.requested_global_batch_size is not None:
            return ("global_batch_size", self.requested_global_batch_size)
        return ("micro_batch_size", self.requested_micro_batch_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_metadata(cls, metadata: dict) -> "ElasticState | None":
        saved = (metadata.get("extra") or {}).get(STATE_KEY)
        if not isinstance(saved, dict):
            return None  # a checkpoint written before elastic resize existed
        return cls(saved.get("requested_global_batch_size"), saved["requested_micro_batch_size"],
                   float(saved.get("lr_factor", 1.0)))


@dataclass(frozen=True)
class Resize:
    """A change of world size (or of dp) between a checkpoint and the run resuming it."""

    step: int  # the checkpoint's step: the new world runs steps step+1, ...
    consumed_samples: int
    old_world_size: int
    new_world_size: int
    old_dp: int
    new_dp: int
    old_global_batch_size: int
    new_global_batch_size: int
    old_num_microbatches: int
    new_num_microbatches: int
    batch_rule: str  # keep | scale | flags (the batch flags changed: elastic rules do not apply)
    lr_rule: str | None  # linear | sqrt under scale
    lr_factor: float  # applied by this resize
    lr_factor_total: float  # applied to --lr/--min-lr from now on (this and earlier resizes)
    old_lr: float
    new_lr: float
    tp: int
    pp: int
    cp: int = 1
    old_ep: int = 1  # expert parallelism: the checkpoint's, and this run's (fitted to the new dp x cp)
    new_ep: int = 1

    def record(self) -> dict[str, Any]:
        """The metrics line: {"event": "resize", "step", old/new world, dp, global batch, LR factor, ...}."""
        return {"event": "resize", **dataclasses.asdict(self)}

    def describe(self) -> str:
        """The one loud line rank 0 prints."""
        cp = f", cp {self.cp}" if self.cp > 1 else ""
        ep = "" if self.old_ep == self.new_ep == 1 else \
            f", ep {self.new_ep}" if self.old_ep == self.new_ep else f", ep {self.old_ep} -> {self.new_ep}"
        head = (f"megalite: ELASTIC RESIZE after step {self.step}: world {self.old_world_size} -> "
                f"{self.new_world_size} ranks (tp {self.tp}, pp {self.pp}{cp}; dp {self.old_dp} -> {self.new_dp}{ep})")
        if self.batch_rule == "flags":
            batch = (f"global batch {_change(self.old_global_batch_size, self.new_global_batch_size)} set by the batch "
                     f"flags")
        elif self.new_global_batch_size == self.old_global_batch_size:
            batch = f"--elastic-batch {self.batch_rule}: global batch {self.new_global_batch_size} kept"
        else:
            batch = (f"--elastic-batch {self.batch_rule}: global batch {self.old_global_batch_size} -> "
                     f"{self.new_global_batch_size}")
        batch += f" (accumulation {self.old_num_microbatches} -> {self.new_num_microbatches})"
        if self.lr_factor == 1.0:
            lr = f"learning rate unchanged (peak {self.new_lr:.3e})"
        else:
            lr = (f"learning rate x{self.lr_factor:.6g} by the {self.lr_rule} rule: peak {self.old_lr:.3e} -> "
                  f"{self.new_lr:.3e} (x{self.lr_factor_total:.6g} of --lr)")
        return f"{head}; {batch}; {lr}; data continues at sample {self.consumed_samples}"


@dataclass(frozen=True)
class ResumePlan:
    """The flags adapted to the checkpoint a run resumes from (before resolution and validation)."""

    cfg: RunConfig
    state: ElasticState  # written into every checkpoint of this run
    step: int | None = None  # the checkpoint planned from; None: nothing to resume
    metadata: dict | None = dataclasses.field(default=None, repr=False, compare=False)
    resize: Resize | None = None
    notes: tuple[str, ...] = ()  # what else was taken from the checkpoint, for rank 0's log

    @classmethod
    def fresh(cls, cfg: RunConfig) -> "ResumePlan":
        return cls(cfg, ElasticState.of_flags(cfg))

    def messages(self) -> list[str]:
        return [*self.notes] + ([self.resize.describe()] if self.resize else [])


# ---------------------------------------------------------------------------------------------
# Which checkpoint
# ---------------------------------------------------------------------------------------------


def find_checkpoint(load_dir: str, step: int | None = None) -> tuple[int, dict] | None:
    """(step, metadata) of the checkpoint `load_checkpoint` starts from: `step` (or a step
    directory given as load_dir), else the newest complete one `latest` allows whose metadata.json
    verifies against its manifest. None when there is none (load_checkpoint then starts from
    scratch, or names the missing --load-step). A newer format raises CheckpointMismatchError."""
    root = Path(load_dir)
    named = storage.STEP_DIR.match(root.name)
    if named and (root / storage.MANIFEST).exists():
        root, step = root.parent, int(named.group(1))
    steps = storage.complete_steps(root)
    if step is not None:
        candidates = [step] if step in steps else []
    else:
        latest = storage.latest_step(root)
        candidates = [s for s in reversed(steps) if latest is None or s <= latest]
    for candidate in candidates:
        try:
            reader = CheckpointReader(root / storage.step_dir_name(candidate))
        except CheckpointCorruptError:
            continue  # load_checkpoint falls back past it too
        reader.close()
        return candidate, reader.metadata
    return None


def elastic_fields(metadata: dict) -> tuple:
    """What a resume plan depends on: (world, dp, global batch, elastic state)."""
    train = _flat(metadata.get("train_config"))
    return (metadata["layout"]["world_size"], metadata["layout"]["dp"], train.get("global_batch_size"),
            ElasticState.from_metadata(metadata))


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


def plan_resume(cfg: RunConfig, world_size: int, given: frozenset[str] = frozenset()) -> ResumePlan:
    """`cfg` (the flags, unresolved) adapted to the checkpoint --load resumes from on `world_size`
    ranks; `given` names the settings set on the command line or in a config file. Raises
    ConfigError (every rank alike) when the resize cannot work."""
    ck = cfg.checkpoint
    if not ck.load or ck.no_load_optim or ck.finetune:  # nothing to resume, or weights only (a new run)
        return ResumePlan.fresh(cfg)
    found = find_checkpoint(ck.load, ck.load_step)
    if found is None or not isinstance(found[1].get("train_config"), dict):
        return ResumePlan.fresh(cfg)  # nothing yet, or a checkpoint without a run (e.g. an HF import)
    step, metadata = found
    saved = _flat(metadata["train_config"])
    old_world, old_dp = metadata["layout"]["world_size"], metadata["layout"]["dp"]
    notes: list[str] = []
    if world_size != old_world:
        cfg = _keep_layout(cfg, saved, old_dp, given, notes)
    per_replica = cfg.replace(dp=1).world_size  # tp * pp (* cp): the ranks of one model replica
    if world_size % per_replica:
        raise ConfigError(_world_problem(step, metadata, world_size, per_replica, cfg))
    new_dp = cfg.parallel.dp or world_size // per_replica
    if world_size != old_world:
        cfg = _fit_expert_parallel(cfg, saved, new_dp, given, notes)
    state = ElasticState.of_flags(cfg)
    saved_state = ElasticState.from_metadata(metadata) or _legacy_state(saved, old_dp)
    old_batch = saved["global_batch_size"]
    if state.request() != saved_state.request():  # the person changed the batch flags: they decide
        new_batch = cfg.training.global_batch_size or cfg.training.micro_batch_size * new_dp
        rule, lr_rule, factor, total = "flags", None, 1.0, 1.0
        notes.append(f"megalite: the batch flags differ from checkpoint step {step}'s run: global batch "
                     f"{_change(old_batch, new_batch)} from the flags, learning rate from --lr (no elastic factor)")
    else:
        rule, lr_rule = str(cfg.checkpoint.elastic_batch), None
        new_batch, factor = old_batch, 1.0
        if rule == ElasticBatch.SCALE and new_dp != old_dp:
            new_batch = _scaled_batch(step, old_batch, old_dp, new_dp)
            lr_rule = str(cfg.checkpoint.elastic_lr_rule)
            ratio = new_batch / old_batch
            factor = ratio if lr_rule == ElasticLRRule.LINEAR else math.sqrt(ratio)
        total = saved_state.lr_factor * factor
    micro = cfg.training.micro_batch_size
    if new_batch % (micro * new_dp):
        raise ConfigError(_batch_problem(step, rule, new_batch, micro, new_dp, per_replica, old_batch))
    o = cfg.optimizer
    cfg = cfg.replace(global_batch_size=new_batch, lr=o.lr * total, min_lr=o.min_lr * total)
    state = dataclasses.replace(state, lr_factor=total)
    resize = None
    if world_size != old_world or new_dp != old_dp:
        resize = Resize(step, int(metadata["consumed_samples"]), old_world, world_size, old_dp, new_dp, old_batch,
                        new_batch, max(1, old_batch // (saved["micro_batch_size"] * old_dp)),
                        new_batch // (micro * new_dp), rule, lr_rule, factor, total, saved["lr"],
                        cfg.optimizer.lr, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp,
                        old_ep=saved.get("ep", 1), new_ep=cfg.parallel.ep)
    return ResumePlan(cfg, state, step, metadata, resize, tuple(notes))


def _flat(train_config: Any) -> dict[str, Any]:
    """{setting: value} of a checkpoint's train_config ({part: {setting: value}})."""
    if not isinstance(train_config, dict):
        return {}
    return {name: value for part in train_config.values() if isinstance(part, dict) for name, value in part.items()}


def _legacy_state(saved: dict, old_dp: int) -> ElasticState:
    """A checkpoint without ElasticState: its resolved batch stands for the request (no earlier
    scale resize can have happened), so the same flags at its dp count as the same request."""
    micro = saved["micro_batch_size"]
    batch = saved["global_batch_size"]
    return ElasticState(None if batch == micro * old_dp else batch, micro)


def _keep_layout(cfg: RunConfig, saved: dict, old_dp: int, given: frozenset[str], notes: list[str]) -> RunConfig:
    """tp, pp and cp from the checkpoint where the command line does not set them; a --dp that is the
    checkpoint's (the same command line launched on another world) is re-derived."""
    declared = settings()
    kept = {name: saved[name] for name in KEPT_LAYOUT
            if name in declared and name in saved and name not in given
            and saved[name] != getattr(getattr(cfg, declared[name].part), name)}
    if kept:
        cfg = cfg.replace(**kept)
        notes.append("megalite: kept from the checkpoint (not on the command line): "
                     + ", ".join(f"--{name} {value}" for name, value in kept.items()))
    if cfg.parallel.dp is not None and cfg.parallel.dp == old_dp:
        notes.append(f"megalite: --dp {old_dp} is the checkpoint's; re-derived from the new world")
        cfg = cfg.replace(dp=None)
    return cfg


def _fit_expert_parallel(cfg: RunConfig, saved: dict, new_dp: int, given: frozenset[str],
                         notes: list[str]) -> RunConfig:
    """The checkpoint's ep (kept, or the same --ep launched again) where the new world still holds it;
    else the largest ep below it dividing the new dp x cp and the expert count. An --ep other than the
    checkpoint's is the person's choice: validated like any setting (refused with its fix)."""
    ep, replicas = cfg.parallel.ep, new_dp * cfg.parallel.cp
    if ep == 1 or replicas % ep == 0 or ("ep" in given and ep != saved.get("ep")):
        return cfg
    try:
        moe = cfg.gpt_config().moe
    except ValueError:
        return cfg  # the model settings are wrong: validation names the problem
    if moe is None:
        return cfg  # --ep without experts: refused by validation
    fitted = max(e for e in range(1, ep + 1) if replicas % e == 0 and moe.num_experts % e == 0)
    notes.append(f"megalite: --ep {ep} (the checkpoint's) does not divide dp*cp = {new_dp}*{cfg.parallel.cp} on "
                 f"the new world; ep {fitted} instead (the experts load at any ep)")
    return cfg.replace(ep=fitted)


def _scaled_batch(step: int, old_batch: int, old_dp: int, new_dp: int) -> int:
    if (old_batch * new_dp) % old_dp:
        raise ConfigError(f"  - --elastic-batch scale: the global batch {old_batch} of checkpoint step {step} "
                          f"times dp {new_dp}/{old_dp} is not a whole number; use --elastic-batch keep or a world "
                          f"whose dp makes it one")
    return old_batch * new_dp // old_dp


def _world_problem(step: int, metadata: dict, world_size: int, per_replica: int, cfg: RunConfig) -> str:
    layout, p = metadata["layout"], cfg.parallel
    multiples = ", ".join(str(per_replica * k) for k in range(1, 5))
    saved_cp = f" x cp {layout['cp']}" if layout.get("cp", 1) > 1 else ""
    cp = f" x cp {p.cp}" if p.cp > 1 else ""
    return (f"  - resuming checkpoint step {step} (saved on {layout['world_size']} ranks: tp {layout['tp']} x pp "
            f"{layout['pp']}{saved_cp} x dp {layout['dp']}) on {world_size} ranks: {world_size} is not a multiple of "
            f"the {per_replica} ranks of one model replica (tp {p.tp} x pp {p.pp}{cp}); launch {multiples}, ... ranks, "
            f"or give --tp/--pp{'/--cp' if cp else ''} that divide {world_size}")


def _batch_problem(step: int, rule: str, batch: int, micro: int, dp: int, per_replica: int, old_batch: int) -> str:
    dps = [d for d in range(1, batch // micro + 1) if (batch // micro) % d == 0] if batch % micro == 0 else []
    micros = [m for m in range(1, batch // dp + 1) if batch % (m * dp) == 0]
    fixes = []
    if micros:
        fixes.append(f"--micro-batch-size {_either(micros[-3:])}")
    if dps:
        worlds = [d * per_replica for d in dps[:6]]
        fixes.append(f"a world of {_either(worlds)} rank{'s' if worlds[-1] > 1 else ''}")
    if rule == ElasticBatch.KEEP:
        fixes.append("--elastic-batch scale (the batch follows dp)")
    else:
        fixes.append("--global-batch-size a multiple of micro * dp")
    what = {"keep": f"--elastic-batch keep holds checkpoint step {step}'s global batch {batch}",
            "scale": f"--elastic-batch scale makes checkpoint step {step}'s global batch {old_batch} {batch}",
            "flags": f"the global batch {batch}"}[rule]
    return (f"  - {what}, which is not divisible by micro {micro} x dp {dp} = {micro * dp}; use "
            + ", or ".join(fixes))


def _change(old: int, new: int) -> str:
    """'16 -> 32', or '16 (unchanged)' where a change was expected but the numbers agree."""
    return f"{old} -> {new}" if old != new else f"{new} (unchanged)"


def _either(values: list[int]) -> str:
    """'1', '1 or 2', '1, 2 or 4'."""
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} or {text[-1]}"
