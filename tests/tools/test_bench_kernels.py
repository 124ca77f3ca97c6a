"""tools/bench_kernels.py on CPU: the timing harness (wall clock, interpreter), its two clocks'
columns, the goals summary and the attention case's layout and FLOPs (tools/tune_attention.py:
tests/tools/test_tune_attention.py)."""
import csv
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megalite.kernels import HAVE_TRITON
from megalite.kernels.dispatch import interpreter_ready

TOOLS = Path(__file__).resolve().parents[2] / "tools"
TOOL = TOOLS / "bench_kernels.py"
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One --smoke-timing run of rms_norm (the interpreter is slow: one run serves several tests)."""
    out = tmp_path_factory.mktemp("smoke") / "rows.csv"
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-W", "ignore", str(TOOL), "--smoke-timing", "--ops", "rms_norm",
                             "--no-compile", "--csv", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result.stdout, list(csv.DictReader(out.open()))


@pytest.fixture
def bench(monkeypatch):
    """tools/bench_kernels.py imported as when run from tools/ (it imports its sibling modules)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_kernels
    return bench_kernels


def test_timing_harness_writes_rows_for_every_provider(smoke_run):
    _, rows = smoke_run
    assert {(r["provider"], r["mode"]) for r in rows} >= {("megalite", "fwd"), ("megalite", "fwd+bwd"),
                                                          ("eager", "fwd"), ("eager", "fwd+bwd")}
    assert all(not r["error"] and float(r["median_ms"]) > 0 for r in rows), rows


def test_smoke_run_writes_both_clocks_and_the_ratios_for_every_row(smoke_run):
    _, rows = smoke_run
    assert rows and {"gpu_ms", "host_ms", "timing", "host_bound", "x_sdpa", "command"} <= set(rows[0])
    eager = {r["mode"]: float(r["gpu_ms"]) for r in rows if r["provider"] == "eager"}
    for r in rows:
        gpu_ms, host_ms = float(r["gpu_ms"]), float(r["host_ms"])
        assert gpu_ms > 0 and host_ms > 0 and r["timing"] == "wall", r  # --smoke-timing: both are the wall clock
        assert r["host_bound"] == str(host_ms > 1.15 * gpu_ms), r
        assert r["median_ms"] == r["gpu_ms"], r  # kept for older readers: the figure rates come from
        assert float(r["x_eager"]) == pytest.approx(eager[r["mode"]] / gpu_ms, rel=1e-9), r
        assert math.isnan(float(r["x_sdpa"])) and math.isnan(float(r["x_compile"])), r  # no such provider here
        assert r["device"] == "cpu" and r["torch"] and r["triton"] and "--smoke-timing" in r["command"], r


def test_goals_summary_prints_one_line_per_declared_goal(smoke_run, bench):
    stdout, _ = smoke_run
    lines = stdout.splitlines()
    start = lines.index("goals (from gpu_ms; printed, never asserted):") + 1
    summary = lines[start:start + len(bench.GOALS) + 1]
    assert summary[-1].startswith("wrote "), summary  # exactly one line per goal before the CSV line
    for goal, line in zip(bench.GOALS, summary):
        assert line.strip().startswith(goal.name) and f">= {goal.target:g}" in line, (goal, line)
        assert line.rstrip().endswith("not measured"), line  # rms_norm at 16x96 only, no compile: none measurable


def _verdicts(bench, rows) -> dict:
    """goal_lines' verdict and figure per goal, keyed by (metric, first op, first provider)."""
    verdicts = {}
    for goal, line in zip(bench.GOALS, bench.goal_lines(rows)):
        match = re.search(r"\s(-|[\d.]+)\s+goal >= \S+\s+(met|NOT met|not measured)", line)
        verdicts[goal.metric, goal.ops[0], goal.providers[0]] = (match.group(2), match.group(1), line)
    return verdicts


def test_goal_lines_judge_the_worst_matching_row(bench):
    def row(op, shape, provider, mode, **metrics):
        return dict(op=op, shape=shape, provider=provider, mode=mode, **metrics)
    rows = [row("rms_norm", "8192x4096", "megalite", "fwd+bwd", pct_of_ceiling=75.0, x_compile=1.2),
            row("rms_norm", "8192x8192", "megalite", "fwd+bwd", pct_of_ceiling=10.0, x_compile=1.1),  # other shape
            row("layer_norm", "8192x4096", "megalite", "fwd+bwd", pct_of_ceiling=59.9, x_compile=0.97),
            row("layer_norm", "8192x4096", "eager", "fwd+bwd", pct_of_ceiling=5.0, x_compile=0.2),  # not megalite
            row("adamw", "5000", "megalite", "step", pct_of_ceiling=90.0, x_compile=math.nan),  # no compile: ignored
            row("attention", "a", "auto", "fwd+bwd", x_sdpa=1.3), row("attention", "b", "auto", "fwd+bwd", x_sdpa=0.9),
            row("attention", "a", "megalite", "fwd+bwd", x_sdpa=0.85),
            row("attention", "a", "megalite", "fwd", x_sdpa=0.1)]  # forward only: not a fwd+bwd goal
    verdicts = _verdicts(bench, rows)
    assert verdicts["pct_of_ceiling", "rms_norm", "megalite"][:2] == ("met", "75.00")
    assert verdicts["pct_of_ceiling", "layer_norm", "megalite"][:2] == ("NOT met", "59.90")
    assert verdicts["pct_of_ceiling", "rope", "megalite"][:2] == ("not measured", "-")
    compile_goal = verdicts["x_compile", "rms_norm", "megalite"]
    assert compile_goal[:2] == ("NOT met", "0.97") and "worst of 3: layer_norm 8192x4096 fwd+bwd" in compile_goal[2]
    assert verdicts["x_sdpa", "attention", "auto"][:2] == ("NOT met", "0.90")
    assert verdicts["x_sdpa", "attention", "megalite"][:2] == ("met", "0.85")


@pytest.mark.skipif(not interpreter_ready(), reason="triton was imported in compiled mode")
def test_attention_case_uses_the_models_permuted_layout_and_sdpas_causal_flops(bench):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    (case,) = bench.build_cases({"attention"}, quick=True, device="cpu", dtype=torch.float32, use_compile=False,
                                smoke=True)
    q, k, v = case.make_inputs()
    b, h, s, d = q.shape
    hk = k.shape[1]
    assert h == 4 * hk and k.shape == v.shape == (b, hk, s, d)
    for t, n in ((q, h), (k, hk), (v, hk)):  # [s, b, n, d] permuted to [b, n, s, d], as Attention.core passes
        assert t.stride() == (n * d, d, b * n * d, 1), t.stride()
        assert t.is_leaf and t.requires_grad  # so the timers can reset .grad between calls
    assert not q.is_contiguous()  # (k, v: one kv head of batch 1 here, contiguous either way)
    q2, k2, v2 = bench.attention_inputs(2, 8, 2, 5, 16, torch.float32, "cpu")  # the function tune_attention can use
    assert [t.stride() for t in (q2, k2, v2)] == [(128, 16, 256, 1), (32, 16, 64, 1), (32, 16, 64, 1)]
    assert q2.shape == (2, 8, 5, 16) and k2.shape == v2.shape == (2, 2, 5, 16) and not k2.is_contiguous()
    import bench_kernel_cases  # two kv heads: query head i must read kv head i // 4, as the reference does
    torch.testing.assert_close(bench_kernel_cases.sdpa_repeated_kv(q2, k2, v2), bench.K.attention_reference(q2, k2, v2))
    # torch's own count of SDPA's two matmuls (the math backend computes the whole square), halved by
    # the causal mask; the backward counts 2.5x the forward (FlashAttention-2: scores recomputed)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        out = case.providers["sdpa"](q, k, v)
    for name in ("sdpa-gqa", "auto"):  # the baselines compute what megalite's reference does
        if name in case.providers:
            torch.testing.assert_close(case.providers[name](q, k, v), out)
    torch.testing.assert_close(bench.K.attention_reference(q, k, v), out)
    assert case.flops and case.fwd_units == counter.get_total_flops() / 2
    assert case.fwd_bwd_units == 3.5 * case.fwd_units
    assert {"megalite", "auto", "sdpa"} <= set(case.providers) and "compile" not in case.providers


def test_attention_sweep_shapes_and_their_memory(bench, monkeypatch):
    import torch

    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # the real one takes seconds to import
    sweep = bench.build_cases({"attention"}, quick=False, device="cpu", dtype=torch.bfloat16, use_compile=True,
                              smoke=False)
    expected = [f"b{16384 // s}xh{4096 // d}/{1024 // d}xs{s}xd{d} causal" for d in (64, 128)
                for s in (1024, 2048, 4096, 8192, 16384)]
    assert [c.shape for c in sweep] == expected
    assert all("compile" not in c.providers for c in sweep)  # it recompiles per shape: --quick only
    # 16384 tokens of 4096 query features whatever s: q is 128 MiB; sdpa's repeated k, v and all the
    # gradients stay near 1.6 GB, far below an 80 GB GPU
    assert all(1.5e9 < c.memory_bytes < 1.7e9 for c in sweep), [c.memory_bytes for c in sweep]
    quick = bench.build_cases({"attention"}, quick=True, device="cpu", dtype=torch.bfloat16, use_compile=True,
                              smoke=False)
    assert [c.shape for c in quick] == ["b4xh32/8xs4096xd128 causal", "b4xh64/16xs4096xd64 causal"]
    assert all("compile" in c.providers for c in quick)


@pytest.mark.skipif(not interpreter_ready(), reason="triton was imported in compiled mode")
def test_attention_rows_carry_x_sdpa_and_providers_restore_the_backend(bench, monkeypatch):
    import torch

    import bench_kernel_cases
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "torch")
    (case,) = bench.build_cases({"attention"}, quick=True, device="cpu", dtype=torch.float32, use_compile=False,
                                smoke=True)
    seen = []

    def spy(q, k, v):  # megalite's dispatch on CPU, noting the backend it was called under
        seen.append(os.environ["MEGALITE_KERNEL_BACKEND"])
        return case.providers["sdpa"](q, k, v)
    # the interpreted Triton kernels are too slow for this test: the SDPA providers and a spy
    case.providers = {name: fn for name, fn in case.providers.items() if name.startswith("sdpa")}
    case.providers["auto"] = bench_kernel_cases._with_backend("auto", spy)
    rows = bench.run_case(case, bench.make_timers(smoke=True, quick=True), {"copy_GBps": 1.0, "matmul_TFLOPs": 1.0})
    assert {(r["provider"], r["mode"]) for r in rows} == {(p, m) for p in case.providers for m in ("fwd", "fwd+bwd")}
    sdpa = {r["mode"]: r["gpu_ms"] for r in rows if r["provider"] == "sdpa"}
    for r in rows:
        units = case.fwd_bwd_units if r["mode"] == "fwd+bwd" else case.fwd_units
        assert not r["error"] and r["timing"] == "wall", r
        assert r["x_sdpa"] == pytest.approx(sdpa[r["mode"]] / r["gpu_ms"]) and math.isnan(r["x_eager"]), r
        assert r["rate"] == pytest.approx(units / r["gpu_ms"] / 1e9) and r["pct_of_ceiling"] == pytest.approx(
            100 * r["rate"]), r
    assert seen and set(seen) == {"auto"} and os.environ["MEGALITE_KERNEL_BACKEND"] == "torch"


def test_a_failed_capture_falls_back_to_events_and_names_its_cause(bench):
    import bench_kernel_timing

    def graph(fn, grad_to_none=None):  # as torch.cuda.graph does: capture_end's error hides the cause
        try:
            raise RuntimeError("operation not permitted when stream is capturing")
        except RuntimeError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
    timers = bench_kernel_timing.Timers(host=lambda fn, grad_to_none=None: 2.5, graph=graph, smoke=False)
    timing = bench_kernel_timing.time_both(lambda: None, None, timers)
    assert (timing.gpu_ms, timing.host_ms, timing.timing, timing.host_bound) == (2.5, 2.5, "events", None)
    assert "operation not permitted when stream is capturing" in timing.note
    graph_timers = bench_kernel_timing.Timers(host=lambda fn, grad_to_none=None: 2.5,
                                              graph=lambda fn, grad_to_none=None: 2.0, smoke=False)
    timing = bench_kernel_timing.time_both(lambda: None, None, graph_timers)
    assert (timing.gpu_ms, timing.timing, timing.host_bound) == (2.0, "graph", True)  # 2.5 > 1.15 x 2.0


def test_a_case_needing_more_memory_than_is_free_is_skipped(bench, monkeypatch, capsys):
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "mem_get_info", lambda *args: (10e9, 80e9))
    case = bench.Case("attention", "huge", lambda: pytest.fail("a skipped case must not build inputs"),
                      {"sdpa": None}, 1.0, 1.0, memory_bytes=20e9)
    assert bench.run_cases([case], None, {}, "bfloat16", {}) == []
    assert "skipped: needs ~20.0 GB, 10.0 GB free" in capsys.readouterr().out


@pytest.mark.skipif(not interpreter_ready(), reason="triton was imported in compiled mode")
def test_every_case_builds_inputs_of_its_own_shape(monkeypatch):
    """Each case's first input has the elements its shape names, whichever ops are built with it
    (a case's make_inputs once read a shape variable late and got the last-built op's)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_kernel_cases as cases_module
    ops = {"rms_norm", "layer_norm", "gelu", "swiglu", "rope", "cross_entropy", "adamw"}  # --ops names
    cases = cases_module.build_cases(ops, quick=True, device="cpu", dtype=cases_module.torch.float32,
                                     use_compile=False, smoke=True)
    assert sorted(c.op for c in cases) == sorted(ops - {"gelu"} | {"bias_gelu"})
    for case in cases:
        dims = [int("".join(ch for ch in part if ch.isdigit())) for part in case.shape.split("x")]
        expected = 1
        for dim in dims:
            expected *= dim
        assert case.make_inputs()[0].numel() == expected, (case.op, case.shape)


@pytest.mark.skipif(not interpreter_ready(), reason="triton was imported in compiled mode")
def test_each_liger_provider_calls_its_own_op(monkeypatch):
    """With liger_kernel present each case's `liger` provider calls that op's Liger function (the
    norms once called whichever Liger function was looked up last: cross entropy's)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    import bench_kernel_cases as cases_module
    monkeypatch.setattr(cases_module, "_liger", lambda name: (lambda *args, **kwargs: name))
    ops = {"rms_norm", "layer_norm", "swiglu", "cross_entropy"}
    cases = cases_module.build_cases(ops, quick=True, device="cpu", dtype=cases_module.torch.float32,
                                     use_compile=False, smoke=True)
    called = {case.op: case.providers["liger"](*case.make_inputs()) for case in cases}
    assert called == {op: f"liger_{op}" for op in ops}


def test_moe_cases_time_the_same_products_and_carry_their_baselines_ratios(bench):
    """The grouped GEMM's baselines compute what the reference does (the loop on host-read sizes,
    torch._grouped_mm on int32 group ends), its FLOPs are 2 T K N (x3 with dx and dweight), and
    its rows carry x_loop / x_torch_grouped_mm. (The interpreted kernel itself: tests/kernels.)"""
    import torch

    cases = bench.build_cases({"grouped_mm", "moe_permute"}, quick=True, device="cpu", dtype=torch.float32,
                              use_compile=False, smoke=True)
    assert [c.op for c in cases] == ["grouped_mm", "grouped_mm", "moe_permute", "moe_unpermute"]
    gemm = cases[0]
    x, stored = gemm.make_inputs()
    weight = stored.transpose(1, 2)  # stored [E, N, K], multiplied as [E, K, N]
    rows, k_dim = x.shape
    experts, _, n_cols = weight.shape
    assert rows == 16 * 2 and gemm.flops and gemm.fwd_units == 2 * rows * k_dim * n_cols == gemm.fwd_bwd_units / 3
    expected = bench.K.grouped_mm_reference(x, weight, gemm.extra["group_sizes"])
    torch.testing.assert_close(gemm.providers["loop"](x, stored), expected)
    baselines = ["loop"]
    if "torch_grouped_mm" in gemm.providers:
        try:
            torch.testing.assert_close(gemm.providers["torch_grouped_mm"](x, stored), expected)
            baselines.append("torch_grouped_mm")
        except RuntimeError:  # this torch's CPU build lacks it for float32: the GPU is what it is for
            pass
    gemm.providers = {name: gemm.providers[name] for name in baselines}
    timed = bench.run_case(gemm, bench.make_timers(smoke=True, quick=True), {"copy_GBps": 1.0, "matmul_TFLOPs": 1.0})
    loop = {r["mode"]: r["gpu_ms"] for r in timed if r["provider"] == "loop"}
    for r in timed:
        assert not r["error"] and r["x_loop"] == pytest.approx(loop[r["mode"]] / r["gpu_ms"]), r
    permute, unpermute = cases[2:]
    assert {"megalite", "eager"} == set(permute.providers) == set(unpermute.providers)
    (tokens_x,) = permute.make_inputs()
    y, weights = unpermute.make_inputs()
    assert y.shape == (2 * tokens_x.shape[0], tokens_x.shape[1]) and weights.shape == (tokens_x.shape[0], 2)
