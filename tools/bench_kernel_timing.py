"""The two clocks of tools/bench_kernels.py, and the ceilings measured with them.

    gpu_ms   triton.testing.do_bench_cudagraph: many calls captured into one CUDA graph and
             replayed, so only the kernels are timed (no Python, autograd bookkeeping or launch
             latency). Rates, % of ceiling and every x_ ratio are computed from it.
    host_ms  triton.testing.do_bench: CUDA events around each eager call (L2 flushed before
             each): what an eager caller pays, host included.

A row is host-bound when host_ms > HOST_BOUND_FACTOR x gpu_ms: the host, not the kernels, set
what the eager call cost (the first GPU run timed rms_norm fwd+bwd at 0.36 ms for ~76 us of
memory traffic; that was Python and launches). When a call cannot be captured (it syncs with the
host, or refuses capture as torch's non-capturable AdamW does) gpu_ms falls back to host_ms and
the row's `timing` says `events` instead of `graph`. With --smoke-timing (CPU, tests the
harness only) both clocks are the wall clock and `timing` says `wall`.
"""
from __future__ import annotations

import gc
import inspect
import time
from dataclasses import dataclass
from typing import Callable

import torch

HOST_BOUND_FACTOR = 1.15


@dataclass
class Timing:
    gpu_ms: float
    host_ms: float
    timing: str  # "graph", "events" (capture failed: gpu_ms is host_ms) or "wall" (--smoke-timing)
    note: str = ""  # why the graph clock was not used, when it was not

    @property
    def host_bound(self) -> bool | None:
        """host_ms > 1.15 x gpu_ms; None when there is no kernels-only time to compare with."""
        if self.timing == "events":
            return None
        return self.host_ms > HOST_BOUND_FACTOR * self.gpu_ms


@dataclass
class Timers:
    host: Callable  # (fn, grad_to_none=None) -> ms per call, host included
    graph: Callable  # (fn, grad_to_none=None) -> ms per call, kernels only; raises when capture fails
    smoke: bool


def _wall_clock(fn, grad_to_none=None) -> float:
    """One warm-up call (first-call compiles), then one timed call: tests the harness, not speed."""
    fn()
    for t in grad_to_none or []:
        t.grad = None
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def make_timer(smoke: bool, quick: bool):
    """The host-inclusive clock: do_bench's median (events around each call, L2 flushed first).

    grad_to_none: leaves whose .grad is reset before each call (no gradient accumulation timed).
    Also used by tools/tune_attention.py, whose kernels run for milliseconds (host cost negligible).
    """
    if smoke:
        return _wall_clock
    import triton.testing  # optional (Linux only, setup.py): only the GPU timers need it

    warmup, rep = (10, 50) if quick else (25, 100)

    def events(fn, grad_to_none=None):
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none,
                                             return_mode="median"))
    return events


def make_graph_timer(smoke: bool, quick: bool):
    """The kernels-only clock: do_bench_cudagraph (median of 10 replays of ~rep ms of calls each).

    do_bench_cudagraph captures on a side stream and, inside the captured region, sets .grad = None
    on grad_to_none before every call, so each replayed backward writes fresh gradients from the
    graph's pool instead of accumulating. Raises whatever the capture raised.
    """
    if smoke:
        return _wall_clock
    import triton.testing  # optional (Linux only, setup.py): only the GPU timers need it

    bench = triton.testing.do_bench_cudagraph
    # capture repeats fn about rep / (its eager time) times and the graph is replayed 10 times:
    # ~11 x rep ms per row, so rep stays modest
    rep = 10 if quick else 20
    options = {"return_mode": "median"} if "return_mode" in inspect.signature(bench).parameters else {}

    def graph(fn, grad_to_none=None):
        torch.cuda.synchronize()  # inputs were made on the default stream; capture runs on another
        previous_stream = torch.cuda.current_stream()
        gc_was_enabled = gc.isenabled()
        # a Triton kernel finalised by the cyclic GC mid-capture unloads its module, which
        # invalidates the capture (triton 3.9 disables GC around its capture itself; 3.6 may not)
        gc.disable()
        try:
            # older triton refuses to capture on the default stream; newer ones make their own side stream
            with torch.cuda.stream(torch.cuda.Stream()):
                return float(bench(fn, rep=rep, grad_to_none=grad_to_none, **options))
        finally:
            if gc_was_enabled:
                gc.enable()
            # torch.cuda.graph's __exit__ does not restore the stream when capture_end raises
            torch.cuda.set_stream(previous_stream)
    return graph


def make_timers(smoke: bool, quick: bool) -> Timers:
    return Timers(make_timer(smoke, quick), make_graph_timer(smoke, quick), smoke)


def time_both(fn, grad_to_none, timers: Timers) -> Timing:
    """host_ms first (plain eager calls), then gpu_ms; a call that cannot be captured falls back to events."""
    host_ms = timers.host(fn, grad_to_none=grad_to_none)
    if timers.smoke:
        return Timing(timers.graph(fn, grad_to_none=grad_to_none), host_ms, "wall")
    if torch.cuda.is_available():
        sync = host_sync_in(fn)
        if sync:  # known before capturing: a capture it would break is not even tried
            return Timing(host_ms, host_ms, "events", f"not captured: it syncs with the host ({sync})")
        torch.cuda.empty_cache()  # the graph allocates from its own pool: give it do_bench's cached blocks
    try:
        return Timing(timers.graph(fn, grad_to_none=grad_to_none), host_ms, "graph")
    except Exception as exc:  # noqa: BLE001 - e.g. torch's non-capturable AdamW refuses capture
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        cause = exc
        while cause.__context__ is not None:  # capture_end's own error hides what broke the capture
            cause = cause.__context__
        message = str(cause).splitlines()[0][:80] if str(cause) else ""
        return Timing(host_ms, host_ms, "events", f"graph capture failed ({type(cause).__name__}: {message})")


def host_sync_in(fn) -> str:
    """What in one call of fn waits for the GPU (an .item(), bool(tensor), nonzero...), or '' if nothing.

    torch's sync debug mode raises at the first such wait. A sync inside a capture would invalidate
    it, and torch's capture_end then skips resetting its allocator's routing, so it is caught here.
    """
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:80] if str(exc) else type(exc).__name__
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return ""


def measure_ceilings(timers: Timers, device: str, smoke: bool) -> dict:
    """Device-to-device copy bandwidth (1 GiB; the faster clock, see below) and bf16 matmul rate
    (8192^3, kernels-only clock)."""
    n_bytes = 2**30 if not smoke else 2**22
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy = time_both(lambda: dst.copy_(src), None, timers)
    del src, dst
    n = 8192 if not smoke else 256
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    matmul = time_both(lambda: a @ b, None, timers)
    # a copy_ captured in a graph ran at 2.77 TB/s on an H200 against 4.25 eagerly, while an SM
    # elementwise copy reached 4.29 in the graph: the graph's memcpy is not the GPU's copy speed, so the
    # ceiling is the faster of the two clocks
    copy_ms = min(copy.gpu_ms, copy.host_ms)
    return {"copy_GBps": 2 * n_bytes / copy_ms / 1e6, "matmul_TFLOPs": 2 * n**3 / matmul.gpu_ms / 1e9,
            "timing": f"copy {copy.timing}, matmul {matmul.timing}"}
