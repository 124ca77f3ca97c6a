"""FP8 training in the planner: the GEMM rate, the casts, and the bytes FP8 takes off the wire.

With --fp8-format every transformer block's four linears (QKV, attention output, MLP in, MLP
out) run their three GEMMs at the profile's "fp8" peak (H100/H200: 1979 TFLOP/s dense, 2x bf16;
a profile without one keeps the training dtype's rate) and pay the casts as memory passes
(a = bytes of the training dtype, linear [m tokens, n out, k in]):

    forward   x and W read, x_q and W_q written:               (a + 1)(m k + n k)
    backward  g and W read and cast, transposed FP8 copies
              of W, g and x for the dgrad and wgrad GEMMs:     (a + 1)(m n + n k) + 2 (n k + m n + m k)

Bytes on the wire (comm.ledger conventions):
- sequence parallelism: the all-gather of a linear's input sends FP8 (1 byte per element instead
  of a) forward and again for the weight gradient (tensorwise); rowwise sends its per-token fp32
  scales along forward and re-gathers the training dtype for the weight gradient;
- --fp8-param-gather (ZeRO-3): the blocks' linear weights go over dp in 1 byte per element.

Pure arithmetic, no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.model import GPTConfig
from megalite.plan.layout import stage_layers
from megalite.plan.moe import stage_moe_layers

if TYPE_CHECKING:
    from megalite.config import RunConfig


def enabled(cfg: RunConfig) -> bool:
    return cfg.precision.fp8_format is not None


def linear_weight_elements(model: GPTConfig, tp: int, mlp: bool = True) -> int:
    """Elements of one block's linear weights on one tp rank (the FP8-cast weights): attention's
    QKV and output, and with `mlp` the dense MLP's two (an MoE block's experts are not counted)."""
    h, f, d = model.hidden_size, model.ffn_hidden_size, model.head_dim
    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * d
    mlp_in = f if model.flavour == "gpt2" else 2 * f
    return (h * qkv + model.num_attention_heads * d * h + ((h * mlp_in + f * h) if mlp else 0)) // tp


def gemm_precision(cfg: RunConfig, peak_tflops: dict[str, float]) -> str:
    """The rate the blocks' linears run at: "fp8" when on and the profile knows it."""
    return "fp8" if enabled(cfg) and "fp8" in peak_tflops else cfg.precision.precision


def cast_bytes(linears, a: int) -> tuple[int, int]:
    """(forward, backward) bytes the FP8 casts move for `linears` [(m, n, k), ...] (module docstring)."""
    forward = sum((a + 1) * (m * k + n * k) for m, n, k in linears)
    backward = sum((a + 1) * (m * n + n * k) + 2 * (n * k + m * n + m * k) for m, n, k in linears)
    return forward, backward


def sp_input_gather_bytes(cfg: RunConfig, u: int, a: int, tokens: int) -> int:
    """Bytes of one SP linear's input all-gathers (forward + the weight gradient's re-gather) for
    one [s, b, h] activation of u bytes in the training dtype (a per element; `tokens` = s*b)."""
    if not enabled(cfg):
        return 2 * u
    if cfg.precision.fp8_recipe == "rowwise":  # FP8 + fp32 scales forward, the training dtype again
        return u // a + 4 * tokens + u
    return 2 * (u // a)


def param_gather_bytes(model: GPTConfig, cfg: RunConfig, params: int, stage: int, p: int) -> int:
    """Bytes of one ZeRO-3 gather of stage `stage`'s `params` (p bytes per element); with
    --fp8-param-gather the blocks' linear weights count 1 byte (MoE experts: not modelled yet)."""
    if not (enabled(cfg) and cfg.precision.fp8_param_gather):
        return params * p
    layers, moe_layers, tp = stage_layers(model, cfg)[stage], stage_moe_layers(model, cfg, stage), cfg.parallel.tp
    fp8 = (layers - moe_layers) * linear_weight_elements(model, tp) + moe_layers * linear_weight_elements(model, tp,
                                                                                                       mlp=False)
    return (params - fp8) * p + fp8
