"""--rampup-batch-size START INCREMENT SAMPLES: the global batch grows during the first samples.

Megatron-LM's rule (its num_microbatches_calculator), as a function of the samples consumed
before a step, c: with n = (G - START) / INCREMENT increments over SAMPLES samples, the step's
global batch is

    G                                      when c > SAMPLES
    START + floor(c * n / SAMPLES) * INCREMENT   otherwise

(Megatron computes floor(c / (SAMPLES / n)) in floating point; the integer form is the same
number without rounding). The micro batch stays fixed, so the number of microbatches per step,
batch / (micro_batch_size * dp), grows with it; every size START, START + INCREMENT, ..., G must
divide by micro_batch_size * dp (checked before the run starts, `rampup_problems`). Because the
batch is a function of the samples consumed, which checkpoints store, a run resumed in the
middle of the ramp continues with exactly the batches the uninterrupted run takes.

Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megalite.config import RunConfig


@dataclass(frozen=True)
class BatchRampup:
    start: int  # the first steps' global batch
    increment: int  # added at each increase
    samples: int  # samples over which the batch grows from start to global_batch_size
    global_batch_size: int  # the batch after the ramp

    @classmethod
    def of(cls, cfg: RunConfig) -> "BatchRampup | None":
        """The ramp of a resolved RunConfig (None without --rampup-batch-size)."""
        given = cfg.training.rampup_batch_size
        return None if given is None else cls(*given, cfg.global_batch_size)

    @property
    def increments(self) -> int:
        return (self.global_batch_size - self.start) // self.increment

    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after `consumed_samples` samples."""
        if consumed_samples > self.samples:
            return self.global_batch_size
        return self.start + consumed_samples * self.increments // self.samples * self.increment

    def sizes(self) -> list[int]:
        """Every global batch the ramp runs, smallest first (the last is global_batch_size)."""
        return list(range(self.start, self.global_batch_size + 1, self.increment))

    def samples_in(self, steps: int, consumed_samples: int) -> int:
        """Samples the next `steps` steps consume from `consumed_samples` on (the ramp's steps one by one,
        then full batches)."""
        total = 0
        while steps > 0 and consumed_samples + total <= self.samples:
            total += self.batch_size_at(consumed_samples + total)
            steps -= 1
        return total + max(steps, 0) * self.global_batch_size

    def ramp_steps(self) -> int:
        """Steps run below the full batch (from no samples consumed)."""
        steps = consumed = 0
        while self.batch_size_at(consumed) < self.global_batch_size:
            consumed += self.batch_size_at(consumed)
            steps += 1
        return steps

    def batch_sizes(self, steps: int, consumed_samples: int = 0) -> list[int]:
        """The global batch of each of `steps` steps from `consumed_samples` on."""
        out = []
        for _ in range(steps):
            out.append(self.batch_size_at(consumed_samples))
            consumed_samples += out[-1]
        return out


def rampup_problems(cfg: RunConfig) -> list[str]:
    """What makes the ramp of a resolved RunConfig impossible, each naming its fix ([] when none)."""
    given = cfg.training.rampup_batch_size
    if given is None:
        return []
    start, increment, samples = given
    g, unit = cfg.global_batch_size, cfg.training.micro_batch_size * cfg.dp
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if start >= g:
        return [f"{flag}: START {start} must be below --global-batch-size {g} (the batch it grows to); lower START "
                f"or drop --rampup-batch-size"]
    if (g - start) % increment:
        return [f"{flag}: --global-batch-size {g} - START {start} = {g - start} is not a multiple of INCREMENT "
                f"{increment}; choose an INCREMENT dividing {g - start}"]
    bad = [size for size in BatchRampup(start, increment, samples, g).sizes() if size % unit]
    if bad:
        return [f"{flag}: the ramp's global batch {bad[0]} is not a multiple of micro_batch_size*dp = "
                f"{cfg.training.micro_batch_size}*{cfg.dp} = {unit} (every batch from START by INCREMENT must be); "
                f"choose START and INCREMENT multiples of {unit}"]
    if cfg.training.cuda_graph and cfg.parallel.pp > 1:
        return [f"{flag} with --cuda-graph at pp > 1: the captured pipeline has a fixed number of microbatches and "
                f"the ramp changes it; drop one of the two"]
    return []


def microbatch_counts(cfg: RunConfig) -> list[int]:
    """The distinct numbers of microbatches per step a resolved RunConfig runs (one without a ramp)."""
    ramp = BatchRampup.of(cfg)
    unit = cfg.training.micro_batch_size * cfg.dp
    return [cfg.num_microbatches] if ramp is None else [size // unit for size in ramp.sizes()]
