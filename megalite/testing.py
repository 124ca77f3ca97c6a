"""Run a function on N real gloo ranks, forked from this process (tests, tools, examples).

`fork` starts 8 ranks in well under a second; `spawn` re-imports torch in every rank and
costs seconds. Each rank gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT), one intra-op thread (so 8 ranks share 2 cores without
oversubscription), and its return value travels back pickled. An exception on any rank is
re-raised here with that rank's traceback; a rank that does not finish within `timeout_s`
is killed and reported, so a broken collective fails the test instead of hanging it.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch

from megalite.distributed import comm, mesh


class RankFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, kwargs, conn, env):
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    _compile_in_process()
    try:
        result = fn(*args, **kwargs)
        # Pickled here, by value: tensors sent as shared-memory handles vanish when the rank exits.
        conn.send(("ok", pickle.dumps(result)))
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            mesh.destroy_mesh()
        except Exception:
            pass
        conn.close()


def _compile_in_process() -> None:
    """A forked rank compiles inductor's kernels itself. Where the parent compiled before forking, inductor's
    compile pool (a ThreadPoolExecutor, cached) came along without its threads: a job the rank hands it never
    runs, and the rank waits for it, idle, for as long as one lets it (a pp 2 --compile world sat 6+ minutes).
    Only where inductor is loaded already: importing it costs seconds."""
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.compile_threads = 1


def run_distributed(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0,
                    env: dict[str, str] | None = None, **kwargs) -> list[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` forked ranks; return the results by rank.

    `fn` typically calls `megalite.distributed.mesh.init_mesh(...)` first, which reads the environment
    set up here.
    """
    ctx = mp.get_context("fork")
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, args, kwargs, child, env or {}),
                        daemon=True)
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)

    results: list[Any] = [None] * world_size
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    pending = set(range(world_size))
    while pending and time.monotonic() < deadline:
        for rank in list(pending):
            conn = conns[rank]
            if conn.poll(0.01):
                try:
                    status, payload = conn.recv()
                except EOFError:
                    status, payload = "error", "rank exited without reporting (killed or crashed)"
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
                pending.discard(rank)
            elif not procs[rank].is_alive() and not conn.poll(0):
                errors[rank] = f"rank exited with code {procs[rank].exitcode} without reporting"
                pending.discard(rank)
        if errors and pending:
            # One rank failed; the others are likely blocked in a collective waiting for it.
            time.sleep(0.5)
            break
    failed_first = sorted(errors)
    for rank in pending:
        errors.setdefault(rank, f"still running after rank {failed_first[0]} failed (likely blocked in a collective)"
                          if failed_first else f"did not finish within {timeout_s:.0f} s (hung or too slow)")
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    if errors:
        first = failed_first[0] if failed_first else min(errors)
        summary = "; ".join(f"rank {r}: {errors[r].splitlines()[0]}" for r in sorted(errors))
        raise RankFailed(f"{len(errors)} of {world_size} ranks failed ({summary})\n"
                         f"--- rank {first} ---\n{errors[first]}")
    return results


def assert_tensor_close(actual, expected, rtol: float = 1e-5, what: str = "") -> None:
    """||actual - expected|| <= rtol * ||expected||: relative error of the tensor as a whole.

    For parameters after several Adam steps an elementwise relative test is ill-conditioned:
    Adam divides by sqrt(v), so an element whose gradient is near zero turns float32
    summation-order noise (1e-7 relative) into update differences of 1e-4 relative for that
    element alone. The tensor-relative error stays at the 1e-7 level unless something is wrong.
    """
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    error, scale = (actual - expected).norm().item(), expected.norm().item()
    if not error <= rtol * scale + 1e-12:
        raise AssertionError(f"{what}: relative error {error / max(scale, 1e-30):.3e} > {rtol:.1e} "
                             f"(|diff| {error:.3e}, |expected| {scale:.3e})")


class _LandsAtWait:
    """An async all-gather handle whose result reaches the output only when wait() is called."""

    def __init__(self, handle, scratch, output):
        self._handle, self._scratch, self._output = handle, scratch, output

    def wait(self) -> None:
        self._handle.wait()
        self._output.copy_(self._scratch)


def _aliases(inner, outer) -> bool:
    """True when tensor `inner` lies inside the memory of `outer`."""
    start, size = outer.data_ptr(), outer.numel() * outer.element_size()
    return outer.untyped_storage().data_ptr() == inner.untyped_storage().data_ptr() and \
        start <= inner.data_ptr() < start + size


@contextlib.contextmanager
def gathers_land_at_wait():
    """Make every asynchronous `comm.all_gather_into` deterministic about the worst case: its
    output is NaN from the launch until the handle's `wait()`, when the real result lands.

    A network can deliver a gather's bytes at any moment before the wait returns; reading the
    output earlier is a race that a lucky schedule hides. Under this context every such read
    reads NaN, so a test of overlapped gathers fails every time instead of sometimes.
    """
    real = comm.all_gather_into

    def land_at_wait(output, input, group, async_op=False):
        if not async_op:
            return real(output, input, group)
        scratch = output.new_empty(output.shape)
        mine = input.clone()  # an in-place gather's input is a slot of `output`, poisoned below
        handle = real(scratch, mine, group, async_op=True)
        output.fill_(float("nan"))
        if _aliases(input, output):  # this rank's own slot is in place from the start
            input.copy_(mine)
        return _LandsAtWait(handle, scratch, output)

    comm.all_gather_into = land_at_wait
    try:
        yield
    finally:
        comm.all_gather_into = real
