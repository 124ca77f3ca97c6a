"""`pretrain_gpt.py --simulate`: the layout's world simulated rank by rank, beside the planner.

    python examples/pretrain_gpt.py --model llama-13b --tp 8 --pp 4 --dp 2 --simulate
    ... --simulate-ranks all | representatives | 0,517   --simulate-json out.json

The world size is the layout's (tp*cp*pp*dp). Every rank's group construction is checked first
(`ranks.check_groups`), then each chosen rank runs its set-up and one step (`rank_step`). The
report prints each term measured and planned with their ratio, and names every term (and every
group's bytes) where the two differ by more than 3%.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from megalite.config import RunConfig
from megalite.data import load_tokenizer
from megalite.errors import UsageError, report_usage_error
from megalite.simulate.planned import planned_terms
from megalite.plan.ep_nodes import describe as describe_ep_nodes, ep_node_traffic
from megalite.plan.hardware import load_profile
from megalite.plan.links import describe as describe_links, link_uses
from megalite.simulate.ranks import check_groups, compare_mesh, expected_groups, parse_ranks
from megalite.simulate.rank_step import simulate_rank
from megalite.simulate.replay import replay_step_time
from megalite.training.configure import configure, training_vocabulary

TOLERANCE = 0.03
TERMS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_peak_bytes", "peak_bytes")


def refuse_real_world() -> None:
    """--simulate runs in one process; inside a real torchrun world it would be every rank's job."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError("--simulate runs the whole world in one process: launch it with python, not torchrun "
                         f"(WORLD_SIZE={os.environ['WORLD_SIZE']})")


def differences(measured: dict, planned: dict) -> list[str]:
    """Each term (and group of comm_bytes) where measured and planned differ by more than 3%."""
    out = []
    pairs = [(t, measured[t], planned[t]) for t in TERMS]
    groups = sorted(set(measured["comm_bytes"]) | set(planned["comm_bytes"]))
    pairs += [(f"comm_bytes[{g}]", measured["comm_bytes"].get(g, 0), planned["comm_bytes"].get(g, 0)) for g in groups]
    for name, m, p in pairs:
        if abs(m - p) > TOLERANCE * max(abs(p), 1):
            out.append(f"{name}: measured {m:,} planned {p:,}" + (f" (x{m / p:.3f})" if p else ""))
    return out


def _row(name: str, m: int, p: int) -> str:
    ratio = f"{m / p:8.4f}" if p else "       -"
    return f"    {name:<28} {m / 1e6:14.3f} {p / 1e6:14.3f} {ratio}"


def describe(entry: dict) -> str:
    m, p = entry["measured"], entry["planned"]
    c = entry["coords"]
    lines = [f"rank {entry['rank']} (tp {c['tp']} cp {c['cp']} dp {c['dp']} pp {c['pp']} ep {c['ep']}), "
             f"{entry['seconds']:.2f} s:   {'MB measured':>14} {'MB planned':>14}    ratio"]
    lines += [_row(t, m[t], p[t]) for t in TERMS]
    for g in sorted(set(m["comm_bytes"]) | set(p["comm_bytes"])):
        lines.append(_row(f"comm {g}", m["comm_bytes"].get(g, 0), p["comm_bytes"].get(g, 0)))
    lines += [f"    DIFFERS > 3%: {d}" for d in entry["differences"]]
    return "\n".join(lines)


def simulate(cfg: RunConfig, ranks_spec: str = "representatives", json_path: str | None = None,
             print_fn=print) -> dict:
    """Check every rank's groups, simulate the chosen ranks; the report (also written to json_path)."""
    refuse_real_world()
    p, layout = cfg.parallel, cfg.layout()
    ranks = parse_ranks(ranks_spec, layout)
    started = time.perf_counter()
    problems = check_groups(layout)
    if problems:
        raise RuntimeError("the layout's groups are wrong: " + "; ".join(problems[:5]))
    shard = f" as dp_shard {cfg.dp_shard} x {cfg.dp // cfg.dp_shard}" if cfg.dp_shard < cfg.dp else ""
    print_fn(f"simulate: world {cfg.world_size} (tp {p.tp} cp {p.cp} dp {cfg.dp}{shard} pp {p.pp} ep {p.ep}): groups of "
             f"every rank checked; simulating {len(ranks)} rank(s)")
    expected = expected_groups(layout)
    entries = []
    for rank in ranks:
        measured = simulate_rank(cfg, rank, check_mesh=lambda mesh: compare_mesh(mesh, expected))
        planned = planned_terms(cfg, measured.coords["pp"], rank=measured.rank)
        entry = {"rank": rank, "coords": measured.coords, "measured": measured.terms(), "planned": planned,
                 "seconds": measured.seconds}
        entry["differences"] = differences(entry["measured"], planned)
        entries.append(entry)
        print_fn(describe(entry))
    report = {"world_size": cfg.world_size, "seconds": time.perf_counter() - started,
              "ranks": [{k: e[k] for k in ("rank", "coords", "measured", "planned")} for e in entries]}
    differing = sum(1 for e in entries if e["differences"])
    print_fn(f"simulate: {len(entries)} rank(s) in {report['seconds']:.1f} s; "
             + (f"{differing} with a term more than 3% from the planner" if differing else
                "every term within 3% of the planner"))
    replay = replay_step_time(cfg)  # on the planner's default GPU profile
    print_fn(replay.describe())
    report["replay"] = replay.as_dict()  # beside the keys: the step time, per stage
    uses = link_uses(cfg.gpt_config(), cfg)  # per group of stage 0: bytes, link, seconds, exposed (plan/links.py)
    print_fn(f"per link, a rank of stage 0 (the planner's seconds; bytes as simulated above):\n{describe_links(uses)}")
    report["links"] = [u.as_dict() for u in uses]
    per_node = min(cfg.world_size, load_profile(None).devices_per_node or cfg.world_size)
    traffic = ep_node_traffic(cfg.gpt_config(), cfg, 0, per_node)  # the ep rows crossing nodes (plan/ep_nodes.py)
    if traffic is not None and traffic.nodes > 1:
        print_fn(f"    {describe_ep_nodes(traffic)}")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return report


def main(cfg: RunConfig, actions: dict, *, preset_given: bool = False) -> int:
    """The --simulate action (megalite.commands): the configuration resolved and validated for the
    layout's world (`configure`, as for a real launch, less the memory check), then `simulate`; a
    mistake is one line and exit code 2. `preset_given`: --model named on the command line, whose
    vocabulary the run keeps (`training_vocabulary`)."""
    try:
        refuse_real_world()
        tokens = None if cfg.data.mock_data else load_tokenizer(cfg.data.tokenizer).vocab_size
        vocab, _ = training_vocabulary(cfg, tokens, preset_given=preset_given)
        cfg = configure(cfg, cfg.world_size, vocab)
        simulate(cfg, actions["simulate_ranks"], actions["simulate_json"])
    except UsageError as exc:
        return report_usage_error(exc, 0)
    return 0
