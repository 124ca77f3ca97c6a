"""The instruction vocabulary shared by schedules, verifier and executor.

An instruction is (kind, local chunk, microbatch). Compute kinds:
  FWD          forward of chunk c on microbatch m
  BWD          full backward (input and weight gradients)
  BWD_INPUT    zero-bubble "B": input gradient only; weight-gradient work is queued
  BWD_WEIGHT   zero-bubble "W": run the queued weight-gradient work of (c, m)
Transfer kinds (peer stage and chunk from p2p.peer):
  SEND_ACT / RECV_ACT     the output / input activation of (c, m)
  SEND_GRAD / RECV_GRAD   the gradient w.r.t. the input / output of (c, m)

Execution semantics: a maximal run of consecutive transfer instructions is ONE batch, posted
together; the stage waits for every op of it before its next compute instruction.
"""
from __future__ import annotations

from dataclasses import dataclass

FWD, BWD, BWD_INPUT, BWD_WEIGHT = "FWD", "BWD", "BWD_INPUT", "BWD_WEIGHT"
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"
COMPUTE_KINDS = (FWD, BWD, BWD_INPUT, BWD_WEIGHT)
TRANSFER_KINDS = (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)
SEND_KINDS = (SEND_ACT, SEND_GRAD)


@dataclass(frozen=True)
class Instr:
    kind: str
    chunk: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}(chunk {self.chunk}, mb {self.microbatch})"

    @property
    def is_transfer(self) -> bool:
        return self.kind in TRANSFER_KINDS


Schedule = list[list[Instr]]  # schedule[stage] = that stage's instructions in order


def split_steps(ops: list[Instr]) -> list[list[Instr]]:
    """Execution steps: a compute instruction alone, or a maximal run of transfers (one batch)."""
    steps: list[list[Instr]] = []
    for op in ops:
        if op.is_transfer and steps and steps[-1][-1].is_transfer:
            steps[-1].append(op)
        else:
            steps.append([op])
    return steps


def format_schedule(schedule: Schedule, compute_only: bool = True) -> str:
    """One line per stage: F/B/b/w = FWD/BWD/BWD_INPUT/BWD_WEIGHT, then chunk.microbatch.

    With compute_only=False transfers show as [>a0.1 <g0.0] batches (send act, recv grad...).
    """
    letter = {FWD: "F", BWD: "B", BWD_INPUT: "b", BWD_WEIGHT: "w",
              SEND_ACT: ">a", RECV_ACT: "<a", SEND_GRAD: ">g", RECV_GRAD: "<g"}
    lines = []
    for r, ops in enumerate(schedule):
        shown = []
        for step in split_steps(list(ops)):
            text = " ".join(f"{letter[op.kind]}{op.chunk}.{op.microbatch}" for op in step)
            if step[0].is_transfer:
                if not compute_only:
                    shown.append(f"[{text}]")
            else:
                shown.append(text)
        lines.append(f"stage {r}: " + " ".join(shown))
    return "\n".join(lines)
