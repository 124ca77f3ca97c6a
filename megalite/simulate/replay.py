"""The step time of a layout by replaying its verified pipeline schedule with the planner's costs.

Each stage runs its instruction list (`pipeline.schedules.build_schedule`, the one the executor
runs) in order. A compute instruction costs the planner's per-microbatch time of one model chunk
on that stage (`plan.timing`'s stage compute, split evenly over the stage's v chunks; forward and
backward apart) plus its share of the stage's exposed tp and cp transfers; it starts when the
stage is free and its input has arrived: the previous virtual stage's forward (or the next one's
backward) plus one pipeline transfer, at the planner's seconds per send on the link the pp group
crosses. The makespan holds compute, transfers and the real bubble of that schedule; the
data-parallel tail, the optimizer and the step's scalar all-reduces are the closed form's
(`predict_step_time`), added after.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megalite.config import RunConfig
from megalite.pipeline.instructions import BWD, BWD_INPUT, BWD_WEIGHT, FWD
from megalite.pipeline.partition import chunk_location, model_chunk_id
from megalite.pipeline.schedules import build_schedule, chunk_placement
from megalite.plan.layout import is_v_shaped
from megalite.plan.hardware import load_profile
from megalite.training.advice import BUBBLE_LIMIT, EXPOSED_DP_LIMIT, bubble_advice, exposed_dp_advice
from megalite.plan.comm_time import stage_communication
from megalite.plan.timing import MEGALITE, predict_step_time, stage_compute



@dataclass
class Replay:
    seconds: float  # the replayed step: makespan + dp + optimizer + sync (+ offload)
    closed_form: float  # predict_step_time(...).total
    makespan: float
    bubble_fraction: float  # idle share of the busiest stage over the makespan
    exposed_dp_fraction: float  # data-parallel seconds compute does not hide, over the step
    pp: int = 1
    hardware: str = ""
    # per stage: {"stage", "forward_s", "backward_s" (one chunk and microbatch), "pp_send_s" (one send),
    # "busy_s" (its instructions' seconds), "idle_fraction" (of the makespan)}
    stages: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The replay for --simulate-json's "replay" key (seconds; fractions of the makespan or step)."""
        out = asdict(self)
        out.pop("pp")
        return out

    def describe(self) -> str:
        ratio = self.seconds / self.closed_form if self.closed_form else float("nan")
        lines = [f"step time{' on ' + self.hardware if self.hardware else ''}: replayed schedule {self.seconds:.3f} s, planner's closed form {self.closed_form:.3f} s "
                 f"(x{ratio:.3f}); bubble {100 * self.bubble_fraction:.1f}% of the pipeline"]
        if abs(ratio - 1) > 0.05:
            lines.append("  the replay and the closed form differ by more than 5%: the closed form's bubble "
                         "(the average stage's share) is what differs; the replay ran the schedule itself")
        if self.pp > 1 and self.bubble_fraction > BUBBLE_LIMIT:  # the training loop's advice, from the replay
            lines.append("  " + bubble_advice(self.bubble_fraction, self.pp))
        if self.exposed_dp_fraction > EXPOSED_DP_LIMIT:
            lines.append("  " + exposed_dp_advice(self.exposed_dp_fraction))
        return "\n".join(lines)


def _stage_costs(cfg: RunConfig, hw, per_node: int) -> list[tuple[float, float, float, float]]:
    """Per stage: (forward, backward seconds of one chunk and microbatch, seconds per pp send)."""
    model, m, v = cfg.gpt_config(), cfg.num_microbatches, cfg.parallel.virtual_stages
    slowdown = hw.compute_slowdown(per_node)
    out = []
    for stage in range(cfg.parallel.pp):
        device, host, backward, attention = stage_compute(model, cfg, hw, MEGALITE, stage)
        forward = device - backward
        if hw.host_synchronous:
            forward, backward = forward + host[0], backward + host[1]
        else:  # the host queues ahead of the device: the slower of the two sets each pass
            forward, backward = max(forward, host[0]), max(backward, host[1])
        comm = stage_communication(model, cfg, hw, MEGALITE, per_node, stage, attention * slowdown)
        inline = (comm["tp"] + comm["cp"]) / m  # exposed in each microbatch, split like its compute
        share = forward / max(forward + backward, 1e-30)
        ends = stage in (0, cfg.parallel.pp - 1)  # DualPipeV: both ends of the V lose a send each way
        sends = 2 * m * v - ((2 * m if is_v_shaped(cfg) else m) if ends else 0)
        per_send = comm["pp"] / max(sends, 1)
        out.append(((forward * slowdown + inline * share) / v, (backward * slowdown + inline * (1 - share)) / v,
                    per_send))
    return out


def _makespan(cfg: RunConfig, costs) -> tuple[float, list[float]]:
    """Run every stage's instruction list; (makespan, busy seconds per stage)."""
    pp, v, m = cfg.parallel.pp, cfg.parallel.virtual_stages, cfg.num_microbatches
    placement = chunk_placement(cfg.schedule)
    schedule = [[op for op in ops if op.kind in (FWD, BWD, BWD_INPUT, BWD_WEIGHT)]
                for ops in build_schedule(str(cfg.schedule), pp, m, v)]
    done: dict[tuple[str, int, int], float] = {}  # (pass, virtual stage, microbatch) -> finish time
    free, busy, position = [0.0] * pp, [0.0] * pp, [0] * pp
    last = pp * v - 1
    while any(position[s] < len(schedule[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while position[s] < len(schedule[s]):
                op = schedule[s][position[s]]
                k = model_chunk_id(pp, s, op.chunk, placement)  # the virtual stage
                forward = op.kind == FWD
                if forward:
                    needed = ("F", k - 1, op.microbatch) if k > 0 else None
                elif op.kind == BWD_WEIGHT:
                    needed = ("B", k, op.microbatch)
                else:
                    needed = ("B", k + 1, op.microbatch) if k < last else ("F", k, op.microbatch)
                if needed is not None and needed not in done:
                    break
                arrival = 0.0 if needed is None else done[needed]
                sender = chunk_location(pp, needed[1], placement)[0] if needed is not None else s
                if sender != s:  # from another stage: one transfer (DualPipeV's turn stays on its stage)
                    arrival += costs[sender][2]
                cost = costs[s][0] if forward else costs[s][1] * (0.5 if op.kind != BWD else 1.0)
                start = max(free[s], arrival)
                free[s] = start + cost
                busy[s] += cost
                done[("F" if forward else ("W" if op.kind == BWD_WEIGHT else "B"), k, op.microbatch)] = free[s]
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule's replay is stuck: an instruction waits for one that never runs")
    return max(free), busy


def replay_step_time(cfg: RunConfig, hardware=None, ranks_per_node: int | None = None) -> Replay:
    """The replayed step beside `predict_step_time` on the same profile."""
    hw = load_profile(hardware)
    per_node = min(cfg.world_size, ranks_per_node or hw.devices_per_node or cfg.world_size)
    closed = predict_step_time(cfg.gpt_config(), cfg, hw, ranks_per_node)
    costs = _stage_costs(cfg, hw, per_node)
    if cfg.parallel.pp == 1:
        span = cfg.num_microbatches * (costs[0][0] + costs[0][1])
        busy = [span]
    else:
        span, busy = _makespan(cfg, costs)
    tail = closed.dp + closed.optimizer + closed.sync + closed.offload
    seconds = span + tail
    stages = [{"stage": s, "forward_s": f, "backward_s": b, "pp_send_s": send, "busy_s": busy[s],
               "idle_fraction": 1.0 - busy[s] / span if span else 0.0} for s, (f, b, send) in enumerate(costs)]
    return Replay(seconds, closed.total, span, 1.0 - max(busy) / span if span else 0.0,
                  closed.dp / seconds if seconds else 0.0, cfg.parallel.pp, getattr(hw, "name", ""), stages)
