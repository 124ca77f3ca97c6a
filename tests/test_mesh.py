"""Mesh: pure rank arithmetic over many layouts, then real gloo groups."""
import itertools

import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.testing import run_distributed

LAYOUTS = [(tp, pp, dp) for tp, pp, dp in itertools.product([1, 2, 3, 4, 8], [1, 2, 4], [1, 2, 3, 4])
           if tp * pp * dp <= 64]


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_rank_arithmetic_partitions_the_world(tp, pp, dp):
    world = tp * pp * dp
    for rank in range(world):
        t, d, p = mesh.rank_to_coords(rank, tp, pp, dp)
        assert mesh.coords_to_rank(t, d, p, tp, dp) == rank
        assert rank == t + tp * (d + dp * p)  # Megatron order: tp fastest, then dp, then pp
    for groups, size in ((mesh.tp_group_ranks(tp, pp, dp), tp), (mesh.dp_group_ranks(tp, pp, dp), dp),
                         (mesh.pp_group_ranks(tp, pp, dp), pp),
                         (mesh.model_parallel_group_ranks(tp, pp, dp), tp * pp)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), "each kind of group partitions the world"
        assert all(len(g) == size for g in groups)
    for g in mesh.tp_group_ranks(tp, pp, dp):
        assert g == list(range(g[0], g[0] + tp)), "tp groups are consecutive ranks (NVLink neighbours)"
    for g in mesh.pp_group_ranks(tp, pp, dp):
        assert [mesh.rank_to_coords(r, tp, pp, dp)[2] for r in g] == list(range(pp))
    for g in mesh.embedding_group_ranks(tp, pp, dp):
        stages = [mesh.rank_to_coords(r, tp, pp, dp)[2] for r in g]
        assert stages == ([0] if pp == 1 else [0, pp - 1])


def test_known_layout_matches_megatron_table():
    # tp=2, pp=2, dp=2 on 8 ranks: the example table from Megatron's initialize docstring.
    assert mesh.tp_group_ranks(2, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.dp_group_ranks(2, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.pp_group_ranks(2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def _groups_in_world(tp, pp):
    m = mesh.init_mesh(tp=tp, pp=pp)
    x = torch.tensor([float(m.rank)])
    tp_sum = comm.all_reduce(x.clone(), m.tp_group).item()
    dp_sum = comm.all_reduce(x.clone(), m.dp_group).item()
    pp_sum = comm.all_reduce(x.clone(), m.pp_group).item()
    return m.rank, (m.tp_rank, m.dp_rank, m.pp_rank), tp_sum, dp_sum, pp_sum, m.describe()


def test_real_groups_match_arithmetic():
    tp, pp, dp = 2, 2, 2
    results = run_distributed(_groups_in_world, 8, tp, pp)
    for rank, coords, tp_sum, dp_sum, pp_sum, table in results:
        assert coords == mesh.rank_to_coords(rank, tp, pp, dp)
        assert tp_sum == sum(next(g for g in mesh.tp_group_ranks(tp, pp, dp) if rank in g))
        assert dp_sum == sum(next(g for g in mesh.dp_group_ranks(tp, pp, dp) if rank in g))
        assert pp_sum == sum(next(g for g in mesh.pp_group_ranks(tp, pp, dp) if rank in g))
    assert "rank = tp_rank + tp*(dp_rank + dp*pp_rank)" in results[0][5]
    assert len(results[0][5].splitlines()) == 2 + 8


def _bad_world():
    mesh.init_mesh(tp=3)


def test_bad_world_fails_on_every_rank_without_hanging():
    with pytest.raises(Exception, match="not divisible by tp\\*pp"):
        run_distributed(_bad_world, 4, timeout_s=30)


# --- context parallelism: a cp dimension between tp and dp ------------------------------------

CP_LAYOUTS = [(tp, cp, pp, dp) for tp, cp, pp, dp in itertools.product([1, 2, 4], [1, 2, 3, 4], [1, 2], [1, 2, 3])
              if tp * cp * pp * dp <= 64]


def _group_of(groups, rank):
    return next(g for g in groups if rank in g)


@pytest.mark.parametrize("tp,cp,pp,dp", CP_LAYOUTS)
def test_context_parallel_rank_arithmetic(tp, cp, pp, dp):
    world = tp * cp * pp * dp
    for rank in range(world):
        t, d, p = mesh.rank_to_coords(rank, tp, pp, dp, cp)
        c = mesh.rank_to_cp_rank(rank, tp, cp)
        assert rank == t + tp * (c + cp * (d + dp * p))  # tp fastest, then cp, dp, pp
        assert mesh.coords_to_rank(t, d, p, tp, dp, c, cp) == rank
    kinds = {"tp": (mesh.tp_group_ranks, tp), "cp": (mesh.cp_group_ranks, cp), "dp": (mesh.dp_group_ranks, dp),
             "pp": (mesh.pp_group_ranks, pp), "dp_cp": (mesh.dp_cp_group_ranks, dp * cp),
             "mp": (mesh.model_parallel_group_ranks, tp * pp)}
    for name, (fn, size) in kinds.items():
        groups = fn(tp, pp, dp, cp)
        assert sorted(r for g in groups for r in g) == list(range(world)), f"{name} groups partition the world"
        assert all(len(g) == size for g in groups), name
    for rank in range(world):
        t, d, p = mesh.rank_to_coords(rank, tp, pp, dp, cp)
        c = mesh.rank_to_cp_rank(rank, tp, cp)
        ring = _group_of(mesh.cp_group_ranks(tp, pp, dp, cp), rank)
        assert ring == [mesh.coords_to_rank(t, d, p, tp, dp, i, cp) for i in range(cp)], "a ring is ordered by cp_rank"
        replicas = _group_of(mesh.dp_cp_group_ranks(tp, pp, dp, cp), rank)
        assert replicas == sorted(mesh.coords_to_rank(t, i, p, tp, dp, j, cp) for i in range(dp) for j in range(cp))
        # every dp group and every cp ring of a rank lies inside its dp x cp group
        assert set(_group_of(mesh.dp_group_ranks(tp, pp, dp, cp), rank)) <= set(replicas)
        assert set(ring) <= set(replicas)
        stages = _group_of(mesh.pp_group_ranks(tp, pp, dp, cp), rank)
        assert [mesh.rank_to_coords(r, tp, pp, dp, cp)[2] for r in stages] == list(range(pp))
        assert {mesh.rank_to_cp_rank(r, tp, cp) for r in stages} == {c}
    for g in mesh.tp_group_ranks(tp, pp, dp, cp):
        assert g == list(range(g[0], g[0] + tp)), "tp groups stay consecutive ranks"


def test_cp_one_keeps_every_layout():
    for tp, pp, dp in LAYOUTS:
        for fn in (mesh.tp_group_ranks, mesh.dp_group_ranks, mesh.pp_group_ranks, mesh.model_parallel_group_ranks,
                   mesh.embedding_group_ranks):
            assert fn(tp, pp, dp, 1) == fn(tp, pp, dp)
        assert mesh.dp_cp_group_ranks(tp, pp, dp, 1) == mesh.dp_group_ranks(tp, pp, dp)
        assert mesh.cp_group_ranks(tp, pp, dp, 1) == [[r] for r in range(tp * pp * dp)]


def test_known_context_parallel_layout():
    # tp=2, cp=2, dp=2 on 8 ranks: the ring joins tp-neighbour pairs, dp the next level out.
    assert mesh.tp_group_ranks(2, 1, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.cp_group_ranks(2, 1, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.dp_group_ranks(2, 1, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh.dp_cp_group_ranks(2, 1, 2, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def _context_parallel_groups_in_world(tp, cp):
    m = mesh.init_mesh(tp=tp, cp=cp)
    x = torch.tensor([float(m.rank)])
    sums = {name: comm.all_reduce(x.clone(), getattr(m, f"{name}_group")).item()
            for name in ("tp", "cp", "dp", "dp_cp", "pp")}
    return m.rank, (m.tp_rank, m.cp_rank, m.dp_rank, m.pp_rank), sums, comm.group_name(m.dp_cp_group), m.describe()


def test_real_context_parallel_groups_match_arithmetic():
    tp, cp, pp, dp = 2, 2, 1, 2
    results = run_distributed(_context_parallel_groups_in_world, 8, tp, cp)
    functions = {"tp": mesh.tp_group_ranks, "cp": mesh.cp_group_ranks, "dp": mesh.dp_group_ranks,
                 "dp_cp": mesh.dp_cp_group_ranks, "pp": mesh.pp_group_ranks}
    for rank, coords, sums, dp_cp_name, _ in results:
        t, d, p = mesh.rank_to_coords(rank, tp, pp, dp, cp)
        assert coords == (t, mesh.rank_to_cp_rank(rank, tp, cp), d, p)
        for name, fn in functions.items():
            assert sums[name] == sum(_group_of(fn(tp, pp, dp, cp), rank)), name
        assert dp_cp_name == "dp_cp"
    table = results[0][4]
    assert "rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank))" in table
    assert table.splitlines()[1].split()[:5] == ["rank", "tp", "cp", "dp", "pp"]
    assert table.splitlines()[2 + 6].split()[:5] == ["6", "0", "1", "1", "0"]  # rank 6 = 0 + 2*(1 + 2*1)


_FORGETFUL = """
import atexit, sys
import torch, torch.distributed as dist
# Registered before init_mesh's teardown, so it runs after it (atexit is last-in first-out).
atexit.register(lambda: print("process group alive at exit:", dist.is_initialized(), flush=True))
from megalite.distributed.mesh import init_mesh
from megalite.tensor_parallel import ColumnParallelLinear
mesh = init_mesh(tp=int(sys.argv[1]))
layer = ColumnParallelLinear(8, 16, gather_output=True)
layer(torch.randn(2, 8)).sum().backward()
if mesh.rank == int(sys.argv[2]):
    raise RuntimeError(f"planted failure on rank {mesh.rank}")
"""  # never calls destroy_mesh()


def _launch(world: int, crashing_rank: int) -> list[tuple[int, str]]:
    """Run _FORGETFUL as `world` real processes (a fresh interpreter each: atexit and interpreter
    finalization only happen there, not in forked test ranks); (exit code, output) per rank."""
    import os
    import subprocess
    import sys

    from megalite.testing import free_port

    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", _FORGETFUL, str(world), str(crashing_rank)], env=env,
                                      text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return [(p.wait(timeout=120), p.stdout.read()) for p in procs]


@pytest.mark.slow  # the quick tier keeps a smaller proof of the same feature
def test_script_without_destroy_mesh_exits_zero_and_a_crash_exits_nonzero():
    """init_mesh registers the process group's teardown for interpreter exit: without it gloo's
    group is destroyed during finalization, which can abort (SIGABRT) a finished job."""
    # Two fresh interpreters (each imports torch: the cost of this test); 20 of 20 four-rank torchrun
    # runs of the same script exited 0 by hand (docs/architecture/training_loop.md, "Exit").
    (clean_code, clean_output), (crash_code, crash_output) = _launch(2, crashing_rank=1)
    assert clean_code == 0 and "process group alive at exit: False" in clean_output, clean_output
    assert crash_code != 0 and "planted failure on rank 1" in crash_output, crash_output
