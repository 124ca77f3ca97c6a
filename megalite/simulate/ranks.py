"""Which ranks to simulate, and the group construction checked for every rank of the world.

`check_groups` walks every group `init_mesh` creates (megalite.distributed.topology's lists, in creation
order) and checks, for every global rank, from its coordinates alone (`rank_to_coords`): it is
in exactly one group of each kind; a tp group is the tp ranks 0..tp-1 of one (cp, dp, pp) place
in order, a cp ring the cp ranks of one (tp, dp, pp), a dp group the dp ranks of one (tp, cp,
pp), a pipeline group the stages 0..pp-1 of one (tp, cp, dp) in order, the embedding group its
first and last stage, an ep group ep consecutive (cp, dp) positions of one (tp, pp), and an
expert-dp group the positions of one ep rank. A simulated rank's real groups are then compared
with these (`compare_mesh`).
"""
from __future__ import annotations

from megalite.distributed import comm
from megalite.errors import UsageError
from megalite.layout import Layout
from megalite.distributed.mesh import Mesh
from megalite.distributed.topology import (cp_group_ranks, dp_cp_group_ranks, dp_group_ranks, dp_replicate_group_ranks,
                               dp_shard_group_ranks, embedding_group_ranks, ep_group_ranks, expert_dp_group_ranks,
                               expert_dp_shard_group_ranks, pp_group_ranks, rank_to_coords, rank_to_cp_rank,
                               tp_group_ranks)


def _coords(rank: int, tp: int, cp: int, dp: int, pp: int, dp_shard: int | None = None) -> dict[str, int]:
    t, d, p = rank_to_coords(rank, tp, pp, dp, cp)
    s = dp if dp_shard is None else dp_shard  # hybrid sharding: dp rank = shard index + S * replica index
    return {"tp": t, "cp": rank_to_cp_rank(rank, tp, cp), "dp": d, "pp": p, "replica": d // s, "shard_dp": d % s}


def expected_groups(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group of each kind `init_mesh` creates, by ledger name (hybrid sharding's three last)."""
    tp, cp, dp, pp, ep = layout.tp, layout.cp, layout.dp, layout.pp, layout.ep
    groups = {"tp": tp_group_ranks(tp, pp, dp, cp), "dp": dp_group_ranks(tp, pp, dp, cp),
              "pp": pp_group_ranks(tp, pp, dp, cp), "embedding": embedding_group_ranks(tp, pp, dp, cp)}
    if cp > 1:
        groups["cp"] = cp_group_ranks(tp, pp, dp, cp)
        groups["dp_cp"] = dp_cp_group_ranks(tp, pp, dp, cp)
    if ep > 1:
        groups["ep"] = ep_group_ranks(tp, pp, dp, cp, ep)
    if layout.expert_groups_apart:
        groups["edp"] = expert_dp_group_ranks(tp, pp, dp, cp, ep, layout.etp)
    if layout.dp_shard < dp:  # hybrid sharding's groups, created last
        groups["dp_shard"] = dp_shard_group_ranks(tp, pp, dp, cp, layout.dp_shard)
        groups["dp_replicate"] = dp_replicate_group_ranks(tp, pp, dp, cp, layout.dp_shard)
        if layout.expert_groups_apart:
            groups["edp_shard"] = expert_dp_shard_group_ranks(tp, pp, dp, cp, ep, layout.etp, layout.dp_shard)
    return groups


def _fixed_and_varying(kind: str, ep: int) -> tuple[tuple[str, ...], str | None]:
    """(coordinates all members share, the coordinate that counts 0, 1, ... along the group)."""
    return {"tp": (("cp", "dp", "pp"), "tp"), "cp": (("tp", "dp", "pp"), "cp"), "dp": (("tp", "cp", "pp"), "dp"),
            "pp": (("tp", "cp", "dp"), "pp"), "embedding": (("tp", "cp", "dp"), None),
            "dp_cp": (("tp", "pp"), None), "ep": (("tp", "pp"), None), "edp": (("pp",), None),
            "dp_shard": (("tp", "pp", "replica"), None), "dp_replicate": (("tp", "cp", "pp", "shard_dp"), "replica"),
            "edp_shard": (("pp", "replica"), None)}[kind]


def check_groups(layout: Layout) -> list[str]:
    """Problems with the group lists for every rank of the world (empty when all is well)."""
    tp, cp, dp, pp, ep, world = layout.tp, layout.cp, layout.dp, layout.pp, layout.ep, layout.world
    coords = [_coords(r, tp, cp, dp, pp, layout.dp_shard) for r in range(world)]
    problems = []
    for kind, groups in expected_groups(layout).items():
        held = [0] * world
        fixed, counting = _fixed_and_varying(kind, ep)
        for members in groups:
            for r in members:
                held[r] += 1
            if len({tuple(coords[r][c] for c in fixed) for r in members}) != 1:
                problems.append(f"{kind} group {members[:8]}: members differ in {fixed}")
            if counting is not None and [coords[r][counting] for r in members] != list(range(len(members))):
                problems.append(f"{kind} group {members[:8]}: not {counting} ranks 0..{len(members) - 1} in order")
            if kind == "embedding" and pp > 1 and [coords[r]["pp"] for r in members] != [0, pp - 1]:
                problems.append(f"embedding group {members}: not the first and last stage")
            if kind == "ep" and len({(coords[r]["dp"] * cp + coords[r]["cp"]) % ep for r in members}) != ep:
                problems.append(f"ep group {members[:8]}: repeats an ep rank")
            if kind == "edp" and len({(coords[r]["dp"] * cp + coords[r]["cp"]) % ep for r in members}) != 1:
                problems.append(f"edp group {members[:8]}: mixes ep ranks (different experts)")
        # the embedding group holds the first and last stage only
        wanted = [0 if kind == "embedding" and 0 < coords[r]["pp"] < pp - 1 else 1 for r in range(world)]
        problems += [f"rank {r} is in {n} {kind} groups ({wanted[r]} expected)"
                     for r, n in enumerate(held) if n != wanted[r]][:4]
    return problems


def compare_mesh(mesh: Mesh, expected: dict[str, list[list[int]]]) -> list[str]:
    """The simulated rank's real groups against the expected lists."""
    fields = {"tp": mesh.tp_group, "dp": mesh.dp_group, "pp": mesh.pp_group, "embedding": mesh.embedding_group,
              "cp": mesh.cp_group, "dp_cp": mesh.dp_cp_group, "ep": mesh.ep_group, "edp": mesh.expert_dp_group,
              "dp_shard": mesh.dp_shard_group, "dp_replicate": mesh.dp_replicate_group,
              "edp_shard": mesh.expert_dp_shard_group}
    problems = []
    for kind, groups in expected.items():
        mine = next((g for g in groups if mesh.rank in g), None)
        if mine is None:  # a middle stage is in no embedding group
            if fields[kind] is not None:
                problems.append(f"rank {mesh.rank}: holds a {kind} group the layout does not give it")
            continue
        real = comm.group_ranks(fields[kind])
        if real != mine:
            problems.append(f"rank {mesh.rank}: its {kind} group is {real[:8]}, the layout says {mine[:8]}")
    return problems


def representatives(layout: Layout) -> list[int]:
    """One rank of each distinct role: first, middle and last stage x first and last tp rank x
    first and last ep rank (dp, cp position 0 otherwise: the ranks that differ only there hold and
    send the same)."""
    tp, cp, dp, pp, ep = layout.tp, layout.cp, layout.dp, layout.pp, layout.ep
    chosen = set()
    for stage in sorted({0, pp // 2, pp - 1}):
        for t in sorted({0, tp - 1}):
            for e in sorted({0, ep - 1}):  # ep rank = (cp_rank + cp * dp_rank) % ep
                position = e  # the e-th member of the dp x cp group
                c, d = position % cp, position // cp
                chosen.add(t + tp * (c + cp * (d + dp * stage)))
    return sorted(chosen)


def parse_ranks(spec: str, layout: Layout) -> list[int]:
    """`all`, `representatives`, or a comma-separated list of global ranks; UsageError otherwise."""
    world = layout.world
    if spec == "all":
        return list(range(world))
    if spec == "representatives":
        return representatives(layout)
    try:
        ranks = [int(part) for part in spec.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--simulate-ranks {spec!r}: give all, representatives or global ranks like 0,517") from None
    outside = [r for r in ranks if not 0 <= r < world]
    if outside or not ranks:
        raise UsageError(f"--simulate-ranks: rank {outside[0] if outside else spec!r} is outside the world of {world} "
                         f"ranks (0..{world - 1}); choose ranks in that range")
    return sorted(set(ranks))
