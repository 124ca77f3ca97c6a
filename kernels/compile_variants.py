"""What kernels/compile_check.py compiles: every kernel as its CUDA launcher configures it (tiles,
warps, stages, constexpr flags) for a training-shaped call, and the argument specialisation
Triton's launcher would give that call (`specialize`).

A `Variant` is one kernel with its constexprs, launch options and the integer arguments that differ
from TYPICAL_INTS (a Llama-style 8B layer, micro batch 2 x 4096 tokens); `kernel_variants(dtype,
arch)` yields them all. kernels/compile_tiles.py compiles attention_variants with candidate tiles.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl

from . import attention_tiles, column_sum, flash_attention, fp8_cast, grouped_gemm, moe_permute
from . import flash_attention_backward as backward
from .dispatch import next_power_of_2

FP32_POINTERS = {"AMAX", "SCALE", "X_SCALE", "W_SCALE", "DY_SCALE", "RSTD", "MEAN", "DW_PARTIAL", "PARTIALS", "STATS", "LSE", "DLOSS", "DELTA", "PARAM", "EXP_AVG",
                 "EXP_AVG_SQ", "ROUTING_WEIGHTS", "DROUTING_WEIGHTS"}
INTEGER_POINTERS = {"TARGETS": "*i64", "SORTED_INDEX": "*i64", "ROW_OF_SLOT": "*i64", "ROW_OFFSETS": "*i32",
                    "TILE_OFFSETS": "*i32", "KEY_START": "*i32", "QUERY_END": "*i32"}
FLOAT_SCALARS = {"eps", "scale_log2", "softmax_scale", "decay_factor", "one_minus_beta1", "beta2", "step_size",
                 "bias_correction2_sqrt", "dropout_scale"}
TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
FP8_POINTERS = {"FP8_OUT": "*fp8e4nv", "FP8_OUT_T": "*fp8e4nv"}  # fp8_cast's outputs (e4m3; e5m2 compiles the same code)

# Integer arguments of a training-shaped call: Llama-style 8B layer, micro batch 2 x 4096 tokens
# (8192 rows), hidden 4096, 32 query / 8 kv heads of 128, ffn 14336, GPT-2's vocab 50257
# padded to 50304 (tp=1: a shard whose valid width is odd, as every GPT-2 run has).
TOKENS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 8192, 4096, 32, 8, 128, 14336
H100_SMS = 132  # persistent backward kernels launch a multiple of the SM count
TYPICAL_INTS = {
    "n_rows": TOKENS, "rows_per_program": TOKENS // 528, "n_elements": TOKENS * FFN,
    "batch": 2, "n_heads": HEADS, "half": HEAD_DIM // 2, "group_size": HEADS // KV_HEADS, "seq_len": 4096,
    "kv_len": 4096,
    # rope reads q or k straight out of the fused qkv projection, [s, b, h, d] strided views
    "x_stride_s": 2 * (HEADS + 2 * KV_HEADS) * HEAD_DIM, "x_stride_b": (HEADS + 2 * KV_HEADS) * HEAD_DIM,
    "x_stride_h": HEAD_DIM, "x_stride_d": 1, "cos_stride_s": HEAD_DIM, "sin_stride_s": HEAD_DIM,
    "cos_stride_b": 0, "sin_stride_b": 0,
    # attention takes [b, h, s, d] views of [s, b, h, d] activations
    "q_stride_b": HEADS * HEAD_DIM, "q_stride_h": HEAD_DIM, "q_stride_s": 2 * HEADS * HEAD_DIM,
    "k_stride_b": KV_HEADS * HEAD_DIM, "k_stride_h": HEAD_DIM, "k_stride_s": 2 * KV_HEADS * HEAD_DIM,
    "v_stride_b": KV_HEADS * HEAD_DIM, "v_stride_h": HEAD_DIM, "v_stride_s": 2 * KV_HEADS * HEAD_DIM,
    # and writes its output, reads its output's gradient, as [b, h, s, d] views of [s, b, h, d] too
    "o_stride_b": HEADS * HEAD_DIM, "o_stride_h": HEAD_DIM, "o_stride_s": 2 * HEADS * HEAD_DIM,
    "do_stride_b": HEADS * HEAD_DIM, "do_stride_h": HEAD_DIM, "do_stride_s": 2 * HEADS * HEAD_DIM,
    # cross entropy, tp=1: stats [tokens, 3] = (max, sum-exp, target logit)
    "n_cols": 50304, "n_valid": 50257, "row_stride": 50304, "vocab_start": 0, "ignore_index": -100,
    "stats_row_stride": 3, "max_slot": 0, "sumexp_slot": 1, "target_slot": 2,
    # dropout (Philox): a 63-bit key, the counter offset of tp rank 1's heads, p = 0.1
    "n_batch": 2, "seed": 0x5DEECE66D1234567, "dropout_seed": 0x5DEECE66D1234567, "offset": 2 ** 33 + 7,
    "dropout_offset": 2 ** 33 + 7, "threshold": 429496730, "drop_threshold": 429496730,
}


def _typical_row_ints(hidden: int) -> dict:
    return {"n_cols": hidden, "x_row_stride": hidden, "r_row_stride": hidden, "dy_row_stride": hidden,
            "dsum_row_stride": hidden}


@dataclass
class Variant:
    label: str
    kernel: object
    constexprs: dict
    options: dict
    ints: dict  # overrides of TYPICAL_INTS for this variant
    memory_bound: bool = True
    exact_math: bool = False  # statistics that must be correctly rounded: no approximate sqrt / division
    pointers: dict = field(default_factory=dict)  # pointer types by name where the name alone does not say (FP8)


def specialize(kernel, dtype: torch.dtype, variant: Variant):
    """(signature, constexprs, attrs) as Triton's launcher would build them for a typical call."""
    signature, constexprs, attrs = {}, dict(variant.constexprs), {}
    ints = dict(TYPICAL_INTS, **variant.ints)
    for index, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in variant.pointers:
            signature[name] = variant.pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in INTEGER_POINTERS or name in FP8_POINTERS:
            signature[name] = INTEGER_POINTERS.get(name) or FP8_POINTERS[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name.isupper():  # a tensor: fresh allocations are 16-byte aligned
            signature[name] = "*fp32" if name in FP32_POINTERS else f"*{TRITON_DTYPES[dtype]}"
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in FLOAT_SCALARS:
            signature[name] = "fp32"
        else:
            kind, spec = native_specialize_impl(BaseBackend, ints[name], False, True, True)
            if kind == "constexpr":  # an argument equal to 1
                signature[name], constexprs[name] = "constexpr", spec
            else:
                signature[name] = kind
                if spec == "D":
                    attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _norm_variants(rms_norm, layer_norm, cuda: torch.device):
    """The norms' kernels as their config functions launch them on an H100, and the column sum of
    their weight-gradient partials; hidden 768 (GPT-2) too. Statistics must be correctly rounded."""
    for hidden in (768, 4096, 8192):
        block, rows = next_power_of_2(hidden), _typical_row_ints(hidden)
        for module, name in ((rms_norm, "rms_norm"), (layer_norm, "layer_norm")):
            fwd, bwd = module._forward_config(hidden, cuda), module._backward_config(hidden, cuda)
            programs = min(bwd.programs_per_sm * H100_SMS, -(-TOKENS // bwd.rows))
            bwd_rows = dict(rows, rows_per_program=-(-TOKENS // (programs * bwd.rows)) * bwd.rows)
            for flag in (False, True):
                yield Variant(f"{name} fwd h={hidden} residual={flag}", getattr(module, f"_{name}_forward_kernel"),
                              dict(HAS_RESIDUAL=flag, ROWS=fwd.rows, BLOCK=block), {"num_warps": fwd.num_warps},
                              rows, exact_math=True)
                yield Variant(f"{name} bwd h={hidden} dsum={flag}", getattr(module, f"_{name}_backward_kernel"),
                              dict(HAS_DSUM=flag, ROWS=bwd.rows, BLOCK=block), {"num_warps": bwd.num_warps},
                              bwd_rows, exact_math=True)
        yield Variant(f"column_sum h={hidden}", column_sum._column_sum_kernel,
                      dict(BLOCK_P=column_sum.BLOCK_P, BLOCK_C=column_sum.BLOCK_C), {"num_warps": 4},
                      {"n_partials": H100_SMS, "n_cols": 2 * hidden, "partial_row_stride": 2 * hidden})


def kernel_variants(dtype: torch.dtype, arch: int = 90):
    """Every kernel as the CUDA launchers configure it, for a training-shaped call."""
    # the package re-exports functions under the modules' names (rms_norm, rope...): import modules
    adamw, bias_dropout_add, cross_entropy, gelu, layer_norm, rms_norm, rope, swiglu = (
        importlib.import_module(f"{__package__}.{name}") for name in
        ("adamw", "bias_dropout_add", "cross_entropy", "gelu", "layer_norm", "rms_norm", "rope", "swiglu"))

    cuda = torch.device("cuda")
    yield from _norm_variants(rms_norm, layer_norm, cuda)
    for flag in (False, True):
        for stage, kernel in (("fwd", gelu._gelu_forward_kernel), ("bwd", gelu._gelu_backward_kernel)):
            yield Variant(f"gelu {stage} bias={flag}", kernel, dict(HAS_BIAS=flag, BLOCK=gelu.BLOCK),
                          {"num_warps": 4}, {"n_cols": FFN})
    for dropout in (False, True):
        yield Variant(f"bias_dropout_add fwd dropout={dropout}", bias_dropout_add._bias_dropout_add_forward_kernel,
                      dict(HAS_BIAS=True, HAS_RESIDUAL=True, HAS_DROPOUT=dropout, BLOCK=bias_dropout_add.BLOCK),
                      {"num_warps": 4}, {"n_cols": HIDDEN, "n_elements": TOKENS * HIDDEN})
    yield Variant("bias_dropout_add bwd", bias_dropout_add._dropout_backward_kernel, dict(BLOCK=bias_dropout_add.BLOCK),
                  {"num_warps": 4}, {"n_elements": TOKENS * HIDDEN})
    block_c = bias_dropout_add.BIAS_GRAD_BLOCK_C
    yield Variant("bias_dropout_add bwd dbias", bias_dropout_add._dropout_bias_backward_kernel,
                  dict(BLOCK_R=bias_dropout_add.BIAS_GRAD_TILE // block_c, BLOCK_C=block_c), {"num_warps": 4},
                  {"n_cols": HIDDEN, "rows_per_program": TOKENS // 32})
    yield Variant("swiglu fwd", swiglu._swiglu_forward_kernel, dict(BLOCK=swiglu.BLOCK), {"num_warps": 4}, {})
    yield Variant("swiglu bwd", swiglu._swiglu_backward_kernel, dict(BLOCK=swiglu.BLOCK), {"num_warps": 4}, {})
    for transposed in (False, True):
        yield Variant(f"rope transposed={transposed}", rope._rope_kernel,
                      dict(TRANSPOSED=transposed, BLOCK_H=32, BLOCK_HALF=64),
                      {"num_warps": rope._num_warps(HEADS, HEAD_DIM, cuda)}, {})
    for vocab, n_valid, cols in ((50257, 50257, 50304), (128256, 128256 // 8, 128256 // 8)):
        block_v = cross_entropy._block_v(n_valid, cuda)
        shape = dict(n_valid=n_valid, n_cols=cols, row_stride=cols)
        for stage, kernel in (("stats", cross_entropy._softmax_stats_kernel),
                              ("grad", cross_entropy._softmax_grad_kernel)):
            yield Variant(f"cross_entropy {stage} V={vocab}{'/tp8' if cols < vocab else ''}", kernel,
                          dict(BLOCK_V=block_v), {"num_warps": 8}, shape)
    yield from attention_variants(dtype, arch)
    yield from moe_variants(dtype, arch)
    yield from fp8_variants(arch)
    yield Variant("adamw", adamw._adamw_kernel, dict(BLOCK=adamw.BLOCK), {"num_warps": 8}, {"n_elements": 1 << 24})


def fp8_variants(arch: int = 90):
    """The FP8 casts (sm_89+: FP8 needs Ada or Hopper), on an [8192, 4096] activation, both recipes."""
    if arch < 89:
        return
    shape = {"n_rows": TOKENS, "n_cols": HIDDEN, "x_row_stride": HIDDEN}
    tiles = dict(BLOCK_M=fp8_cast.BLOCK_M, BLOCK_K=fp8_cast.BLOCK_K)
    mant, min_exp, limit = fp8_cast.FORMATS[torch.float8_e4m3fn]
    for rowwise in (False, True):
        yield Variant(f"fp8 amax rowwise={rowwise}", fp8_cast._amax_kernel, dict(ROWWISE=rowwise, **tiles),
                      {"num_warps": 4}, shape)
    yield Variant("fp8 amax per column", fp8_cast._column_amax_kernel, tiles, {"num_warps": 4}, shape)
    # what the FP8 linear launches: tensorwise both copies (x, g) or the transposed one alone (W for
    # dgrad); per row, the row-major copy; per column, the transposed copy
    for scales, rowwise, colwise, write_q, write_t in (("tensor", False, False, True, True),
                                                       ("tensor", False, False, False, True),
                                                       ("row", True, False, True, False),
                                                       ("column", False, True, False, True)):
        label = f"fp8 cast_transpose {scales} q={int(write_q)} qT={int(write_t)}"
        yield Variant(label, fp8_cast._cast_transpose_kernel,
                      dict(ROWWISE=rowwise, COLWISE=colwise, WRITE_Q=write_q, WRITE_T=write_t, MANT=mant,
                           MIN_EXP=min_exp, LIMIT=limit, **tiles), {"num_warps": 4}, shape, exact_math=True)
    # rowwise in one launch (amax, scale, cast): per token (row-major), per column (transposed copy)
    for scales, colwise, write_q, write_t, pow2 in (("row", False, True, False, True), ("row", False, True, False, False),
                                                    ("row", False, True, True, True), ("column", True, False, True, True)):
        block_m, block_k = fp8_cast.COLUMN_TILE if colwise else fp8_cast.ROW_TILE
        label = f"fp8 scaled_cast {scales} q={int(write_q)} qT={int(write_t)} pow2={int(pow2)}"
        yield Variant(label, fp8_cast._scaled_cast_kernel,
                      dict(COLWISE=colwise, POW2=pow2, WRITE_Q=write_q, WRITE_T=write_t, MANT=mant, MIN_EXP=min_exp,
                           LIMIT=limit, BLOCK_M=block_m, BLOCK_K=block_k), {"num_warps": 4}, shape, exact_math=True)
    yield from fp8_grouped_variants(arch)


def fp8_grouped_variants(arch: int):
    """The experts' grouped GEMM with FP8 operands (megalite/fp8/grouped.py), per-expert tensorwise
    scales, the 16-bit tiles: forward (e4m3 x e4m3), dx (e5m2 gradient x e4m3 weight^T), dweight."""
    tiles = grouped_gemm.TILES[(min(arch // 10, 9), True)]
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    e4m3, e5m2 = "*fp8e4nv", "*fp8e5"
    per_group = dict(w_scale_stride_e=1, w_scale_stride_n=0)
    for name, k_dim, n_cols in (("up", HIDDEN, FFN), ("down", FFN, HIDDEN)):
        common = dict(n_groups=MOE_EXPERTS, w_stride_e=k_dim * n_cols, **per_group)
        # forward reads W_q [E, N, K] as [E, K, N] (K-major); dx reads the transposed copy [E, K, N] likewise
        for stage, k, n, x_type in (("fwd", k_dim, n_cols, e4m3), ("dx", n_cols, k_dim, e5m2)):
            yield Variant(f"fp8 grouped gemm {stage} {name}", grouped_gemm._grouped_mm_kernel,
                          dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                               GROUP_BLOCK=MOE_EXPERTS, GROUP_M=tiles.group_m, EVEN_K=k % tiles.block_k == 0,
                               DOT_PRECISION="tf32", SCALED=True), options,
                          dict(common, k_dim=k, n_cols=n, x_stride_t=k, y_stride_t=n, w_stride_k=1, w_stride_n=k),
                          memory_bound=False, pointers={"X": x_type, "W": e4m3})
        # dW_g [N, K] = g_g^T @ x_g: the kernel's X is the gradient, its DY the input, both read from
        # their transposed copies g_q^T [N, T], x_q^T [K, T] (contiguous along T, the contraction)
        yield Variant(f"fp8 grouped gemm dweight {name}", grouped_gemm._grouped_mm_weight_grad_kernel,
                      dict(BLOCK_K=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_T=tiles.block_t, DOT_PRECISION="tf32",
                           SCALED=True), options,
                      dict(k_dim=n_cols, n_cols=k_dim, x_stride_t=1, x_stride_k=TOKENS, dy_stride_t=1,
                           dy_stride_n=TOKENS, dw_stride_e=k_dim * n_cols, dw_stride_k=k_dim, x_scale_stride_e=1,
                           x_scale_stride_k=0, dy_scale_stride_e=1, dy_scale_stride_n=0), memory_bound=False,
                      pointers={"X": e5m2, "DY": e4m3, "DW": "*fp32"})


def attention_variants(dtype: torch.dtype, arch: int = 90, head_dims=None, tiles=None, label_suffix: str = ""):
    """The flash-attention kernels with the tiles the launchers pick on `arch` (attention_tiles:
    the measured entry, else the safe choice), or with `tiles` ({"fwd": tile, ...}) when given."""
    precision = "ieee" if dtype == torch.float32 else "tf32"
    for head_dim in head_dims or flash_attention.SUPPORTED_HEAD_DIMS:
        strides = {f"{t}_stride_{a}": v * head_dim // HEAD_DIM for t in ("q", "k", "v", "o", "do") for a in "bhs"
                   for v in [TYPICAL_INTS[f"{t}_stride_{a}"]]}
        # varlen: packed documents / a sliding window (kernels/attention_documents.py), causal
        for causal, dropout, varlen in ((True, False, False), (False, False, False), (True, True, False),
                                        (True, False, True)):
            chosen = tiles or attention_tiles.lookup(f"sm_{arch}", head_dim, dtype, causal, dropout)[0]
            common = dict(CAUSAL=causal, HEAD_DIM=head_dim, DOT_PRECISION=precision, DROPOUT=dropout, VARLEN=varlen)
            kind = f"causal={causal}{' dropout' if dropout else ''}{' varlen' if varlen else ''}"
            for stage, kernel in (("fwd", flash_attention._attention_forward_kernel),
                                  ("dkdv", backward._attention_dkdv_kernel), ("dq", backward._attention_dq_kernel)):
                block_m, block_n, warps, stages = chosen[stage]
                # causal: training lengths, whole blocks; non-causal: a ring block of any length
                even = {} if stage == "fwd" else dict(EVEN_M=causal, EVEN_N=causal)
                yield Variant(f"attention {stage} d={head_dim} {kind}{label_suffix}", kernel,
                              dict(common, BLOCK_M=block_m, BLOCK_N=block_n, **even),
                              {"num_warps": warps, "num_stages": stages}, strides, memory_bound=False)
            if dtype != torch.float32 and not varlen:  # the fused backward from the same tiles (float32 and
                # packed documents always run split)
                (m1, n1, _, _), (m2, n2, _, _) = chosen["dkdv"], chosen["dq"]
                launch = attention_tiles.fused_launch(chosen)
                yield Variant(f"attention bwd_fused d={head_dim} {kind}{label_suffix}",
                              backward._attention_backward_fused_kernel,
                              dict(common, BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2, EVEN_M=causal,
                                   EVEN_N=causal), dict(zip(("num_warps", "num_stages"), launch)), strides,
                              memory_bound=False)
        yield Variant(f"attention delta d={head_dim}{label_suffix}", backward._attention_delta_kernel,
                      dict(HEAD_DIM=head_dim, BLOCK_M=64), {}, strides)


# Mixtral-8x7B's experts: 8192 tokens top-2 (16384 routed rows), hidden 4096, expert ffn 14336, 8 experts
MOE_EXPERTS, MOE_TOP_K = 8, 2


def moe_variants(dtype: torch.dtype, arch: int = 90):
    """The grouped GEMM (forward, dx on weight^T's strides, dweight) with the tiles gemm_tiles picks on
    `arch`, for the up projection [4096 -> 14336] and the down one; the permute row moves."""
    tiles = grouped_gemm.TILES[(min(arch // 10, 9), dtype != torch.float32)]
    precision = "ieee" if dtype == torch.float32 else "tf32"
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    for name, k_dim, n_cols in (("up", HIDDEN, FFN), ("down", FFN, HIDDEN)):
        common = dict(n_groups=MOE_EXPERTS, w_stride_e=k_dim * n_cols, w_scale_stride_e=0, w_scale_stride_n=0)
        for stage, k, n, strides in (("fwd", k_dim, n_cols, dict(w_stride_k=n_cols, w_stride_n=1)),
                                     ("dx", n_cols, k_dim, dict(w_stride_k=1, w_stride_n=n_cols))):
            yield Variant(f"grouped_mm {stage} {name}", grouped_gemm._grouped_mm_kernel,
                          dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                               GROUP_BLOCK=MOE_EXPERTS, GROUP_M=tiles.group_m, EVEN_K=k % tiles.block_k == 0,
                               DOT_PRECISION=precision, SCALED=False), options,
                          dict(common, k_dim=k, n_cols=n, x_stride_t=k, y_stride_t=n, **strides), memory_bound=False)
        yield Variant(f"grouped_mm dweight {name}", grouped_gemm._grouped_mm_weight_grad_kernel,
                      dict(BLOCK_K=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_T=tiles.block_t,
                           DOT_PRECISION=precision, SCALED=False), options,
                      dict(k_dim=k_dim, n_cols=n_cols, x_stride_t=k_dim, x_stride_k=1, dy_stride_t=n_cols,
                           dy_stride_n=1, dw_stride_e=k_dim * n_cols, dw_stride_k=n_cols, x_scale_stride_e=0, x_scale_stride_k=0,
                           dy_scale_stride_e=0, dy_scale_stride_n=0), memory_bound=False)
    rows = dict(n_cols=HIDDEN, top_k=MOE_TOP_K, src_stride=HIDDEN, out_stride=HIDDEN, y_stride=HIDDEN)
    block_h = moe_permute._block_h(HIDDEN, torch.device("cuda"))
    for label, weighted, weight_grad in (("permute fwd", False, False), ("unpermute bwd", True, True)):
        yield Variant(f"moe {label} (gather rows)", moe_permute._gather_rows_kernel,
                      dict(WEIGHTED=weighted, WEIGHT_GRAD=weight_grad, BLOCK_H=block_h), {"num_warps": 4}, rows)
    for label, weighted in (("unpermute fwd", True), ("permute bwd", False)):
        yield Variant(f"moe {label} (combine slots)", moe_permute._combine_slots_kernel,
                      dict(WEIGHTED=weighted, BLOCK_H=block_h), {"num_warps": 4}, rows)
