"""kernels/fp8_cast.py in Triton's interpreter against megalite.fp8.scaling's torch casts: the same
amax and the same FP8 bits (odd shapes, both formats, tensorwise and rowwise), and q^T = q.t()."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # this test runs the kernels on CPU, whatever the environment says

import pytest  # noqa: E402
import torch  # noqa: E402

from megalite.fp8.scaling import amax as torch_amax, cast, scale_of  # noqa: E402
from megalite.kernels import fp8_cast  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("rowwise", [False, True])
def test_cast_transpose_matches_torch_bit_for_bit(dtype, rowwise, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(0)
    x = torch.randn(70, 100) * torch.logspace(-6, 2, 100)  # columns from 1e-6 to 1e2: subnormals to the max
    x[3, 5] = 0.0
    x[4, 6] = -0.0  # kept -0 (the kernel once tested y < 0, which -0 is not)
    a = fp8_cast.amax(x, rowwise)
    expected_amax = torch_amax(x, -1 if rowwise else None)
    assert torch.equal(a, expected_amax)
    scale = scale_of(a, dtype)
    q, qt = fp8_cast.cast_transpose(x, scale, dtype)
    expected = cast(x, scale, dtype)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8)), (q.float() != expected.float()).sum()
    assert torch.equal(qt.view(torch.uint8), expected.t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("rowwise_dim", [None, -1, 0])
def test_quantize_runs_the_kernels_where_they_apply_with_the_same_result(rowwise_dim, monkeypatch):
    """megalite.fp8.scaling.quantize on the Triton backend (interpreted here) against its torch path."""
    from megalite.fp8.scaling import quantize

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(1)
    x = torch.randn(6, 5, 24)  # [s, b, K]
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "torch")
    expected = quantize(x, torch.float8_e4m3fn, rowwise_dim)
    launched = []
    for name in ("amax", "cast_transpose", "scaled_cast"):
        real = getattr(fp8_cast, name)
        monkeypatch.setattr(fp8_cast, name, lambda *a, _n=name, _r=real, **k: launched.append(_n) or _r(*a, **k))
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "triton")
    got = quantize(x, torch.float8_e4m3fn, rowwise_dim)
    # tensorwise: the amax pass, then the cast; per row: one launch; per column (along the tokens): torch's path
    assert launched == {None: ["amax", "cast_transpose"], -1: ["scaled_cast"], 0: []}[rowwise_dim]
    assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
    assert torch.equal(got[1], expected[1]) and got[1].shape == expected[1].shape


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_per_column_scales_cast_straight_into_the_transposed_copy(dtype, monkeypatch):
    """column_amax and a [1, K] scale (rowwise's weight gradient, W's input-gradient cast): the
    transposed copy alone, the same bits as torch's per-column cast transposed."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(2)
    x = torch.randn(130, 70) * torch.logspace(-5, 2, 130)[:, None]  # rows from 1e-5 to 1e2
    a = fp8_cast.column_amax(x)
    assert torch.equal(a, torch_amax(x, 0))
    scale = scale_of(a, dtype)
    q, qt = fp8_cast.cast_transpose(x, scale, dtype, rowmajor=False)
    assert q is None
    assert torch.equal(qt.view(torch.uint8), cast(x, scale, dtype).t().contiguous().view(torch.uint8))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_on_the_kernels_equals_its_torch_path_bit_for_bit(recipe, monkeypatch):
    """The FP8 linear with every cast by the kernel (one pass writing the row-major and/or the
    transposed copy each GEMM reads) against the same linear on torch's casts and transposes:
    output and all three gradients bit-equal; and no cast is followed by a separate transpose."""
    from megalite.fp8 import Fp8Recipe
    from megalite.fp8.linear import fp8_linear

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    r = Fp8Recipe("hybrid", recipe)

    def run(backend):
        monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", backend)
        torch.manual_seed(0)
        x = torch.randn(6, 5, 40, requires_grad=True)  # [s, b, K]
        w = torch.randn(24, 40, requires_grad=True)  # [N, K]
        b = torch.randn(24, requires_grad=True)
        y = fp8_linear(x, w, b, r)
        y.backward(torch.randn(6, 5, 24))
        return [y.detach(), x.grad, w.grad, b.grad]

    expected = run("torch")
    writes, one_launch = [], []
    real = fp8_cast.cast_transpose
    monkeypatch.setattr(fp8_cast, "cast_transpose",
                        lambda x, s, d, transpose=True, rowmajor=True: writes.append((rowmajor, transpose))
                        or real(x, s, d, transpose, rowmajor))
    real_scaled = fp8_cast.scaled_cast
    monkeypatch.setattr(fp8_cast, "scaled_cast",
                        lambda x, d, per_column=False, pow2=True, rowmajor=True, transpose=False:
                        writes.append((rowmajor, transpose)) or one_launch.append(1)
                        or real_scaled(x, d, per_column, pow2, rowmajor, transpose))
    got = run("triton")
    for what, a, e in zip(("y", "dx", "dW", "db"), got, expected):
        assert torch.equal(a, e), what
    if recipe == "tensorwise":  # x: forward + wgrad; W: forward, then its transposed copy; g: both copies
        assert sorted(writes) == sorted([(True, True), (True, False), (False, True), (True, True)])
    else:  # x, W forward (per row); g per row, W per column (transposed); wgrad: g, x per column (transposed)
        assert sorted(writes) == sorted([(True, False)] * 3 + [(False, True)] * 3)
        assert len(one_launch) == 6  # each its amax, scale and cast in one launch (no rank to reduce over)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("pow2", [True, False])
def test_one_launch_rowwise_cast_equals_amax_scale_and_cast(dtype, per_column, pow2, monkeypatch):
    """scaled_cast: a line's amax, its scale (pow2 or exact, divided as torch divides) and the cast in
    one launch, against megalite.fp8.scaling's torch steps: the same inverse scales and FP8 bits, in
    the row-major copy and the transposed one; lines longer than a tile (two loops), a zero line and -0."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch.manual_seed(3)
    x = torch.randn(37, 300) * torch.logspace(-7, 3, 300)  # [M, K]: 300 > one tile's 256 (and 64) columns
    x = x * torch.logspace(-2, 2, 37)[:, None]  # rows and columns over many binades
    x[5] = 0.0  # a zero row: scale max / 1e-12
    x[:, 7] = 0.0  # and a zero column
    x[9, 11] = -0.0
    dim = 0 if per_column else -1
    scale = scale_of(torch_amax(x, dim), dtype, pow2)
    expected = cast(x, scale, dtype)
    q, qt, inv = fp8_cast.scaled_cast(x, dtype, per_column, pow2, rowmajor=True, transpose=True)
    assert torch.equal(inv, scale.reciprocal()) and inv.shape == scale.shape
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8)), (q.float() != expected.float()).sum()
    assert torch.equal(qt.view(torch.uint8), expected.t().contiguous().view(torch.uint8))
    q_only, none, _ = fp8_cast.scaled_cast(x, dtype, per_column, pow2)
    assert none is None and torch.equal(q_only.view(torch.uint8), expected.view(torch.uint8))
