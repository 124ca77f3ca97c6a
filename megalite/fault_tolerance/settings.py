"""A fault-tolerant run's settings, its data, and the one-line refusals of a run it cannot make.

The data is synthetic and addressed by sample id, so any process — a restarted replica group, the
deterministic reference — can produce any sample of any step without reading a file or a sampler
state: the data position a healed group needs is the step number alone.

    step k, replica group g:  samples (k * groups + g) * per_group ... + per_group - 1, where per_group =
                              ranks_per_group * per_rank; the group's rank s takes its s-th run of
                              per_rank (= micro_batch_size * microbatches) of them
    sample i:                 seq_length + 1 tokens drawn from a generator seeded (seed, i), the first
                              i % 4 labels masked (-100), so groups hold different token counts and the
                              step's mean over the surviving tokens is not a plain mean of group means
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megalite.config import RunConfig
from megalite.config.model import GPTConfig, preset
from megalite.errors import UsageError


@dataclass(frozen=True)
class FaultTolerantRun:
    """Everything a replica group needs to take part (the same on every group)."""

    groups: int  # replica groups
    steps: int
    store_host: str = "127.0.0.1"
    store_port: int = 0
    min_groups: int = 1  # a quorum with fewer live groups ends the run in one line
    timeout_s: float = 30.0  # the longest wait for a live but slow group (quorum, collectives)
    dead_after_s: float = 1.0  # a group whose heartbeat is silent this long is dead: not waited for
    join_timeout_s: float = 60.0  # a restarted group waiting to be admitted
    start_timeout_s: float = 60.0  # the first quorum: every group building its model
    micro_batch_size: int = 2
    microbatches: int = 2  # per group and step (gradient accumulation)
    seq_length: int = 16
    num_layers: int = 2
    hidden_size: int = 32
    zero: int = 1
    lr: float = 3e-3
    seed: int = 3
    log_dir: str = "."
    ranks_per_group: int = 1  # W: each group its own world of W ranks, ZeRO over them (dp-shard S = W)
    step_pause_s: float = 0.0  # drills: seconds of stand-in compute per step (a tiny model steps in
    # milliseconds, a restarted group needs about a second to build: without it the run ends first)

    @property
    def per_rank(self) -> int:
        return self.micro_batch_size * self.microbatches

    @property
    def per_group(self) -> int:
        return self.per_rank * self.ranks_per_group

    def model(self) -> GPTConfig:
        return preset("tiny", num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=4,
                      seq_length=self.seq_length)

    def run_config(self) -> RunConfig:
        return RunConfig.build(micro_batch_size=self.micro_batch_size, global_batch_size=self.per_group,
                               lr=self.lr, weight_decay=0.1, clip_grad=1.0, seed=self.seed, adam_eps=1e-6,
                               zero=self.zero)

    def sample_ids(self, step: int, group: int, rank: int | None = None) -> range:
        """The group's samples of `step`, or those of its rank `rank` only."""
        first = (step * self.groups + group) * self.per_group
        if rank is None:
            return range(first, first + self.per_group)
        return range(first + rank * self.per_rank, first + (rank + 1) * self.per_rank)

    def microbatches_of(self, step: int, groups, rank: int | None = None) -> list[dict[str, torch.Tensor]]:
        """The step's microbatches of `groups` (in order; of their rank `rank` only when given), each
        {"input_ids", "labels"} [micro_batch_size, s]."""
        ids = [i for g in groups for i in self.sample_ids(step, g, rank)]
        rows = [torch.randint(0, 257, (self.seq_length + 1,),
                              generator=torch.Generator().manual_seed(self.seed * 1_000_003 + i)) for i in ids]
        tokens = torch.stack(rows)  # [samples, s + 1]
        inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
        for row, i in enumerate(ids):
            labels[row, :i % 4] = -100
        return [{"input_ids": x, "labels": y} for x, y in zip(inputs.split(self.micro_batch_size),
                                                              labels.split(self.micro_batch_size))]


def check_run(run: FaultTolerantRun) -> None:
    """Refuse, in one line each, what this recovery cannot do (before any group starts)."""
    if run.groups < 1:
        raise UsageError(f"--groups {run.groups}: need at least 1 replica group")
    if not 1 <= run.min_groups <= run.groups:
        raise UsageError(f"--ft-min-groups {run.min_groups} must be in [1, {run.groups}] (the replica groups "
                         f"of the run); choose --ft-min-groups between 1 and --groups")
    if run.zero not in (0, 1):
        raise UsageError(f"--zero {run.zero}: in-place recovery covers ZeRO 0 and 1 (a group heals from "
                         f"whole-group state); choose --zero 0 or 1")
    if run.ranks_per_group < 1:
        raise UsageError(f"--ft-group-ranks {run.ranks_per_group}: a replica group needs at least 1 rank")
    if run.timeout_s <= 0 or run.dead_after_s <= 0 or run.steps < 1:
        raise UsageError("--ft-timeout-s and --ft-dead-after-s must be > 0 and --train-iters >= 1")
