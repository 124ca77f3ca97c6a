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
- --fp8-param-gather (ZeRO-3): the blocks' linear weights go over dp in 1 byte per element;
- the amax all-reduces of the scales: plan/fp8_amax.py.

Memory: what tensorwise keeps for backward (the linears' inputs in 1 byte: attention_saved_change,
mlp_saved_change, expert_saved_change, added by plan/activations.py) and the MLP-out linear's
working set (forward_buffer_bytes, plan/buffers.py); docs/fp8.md compares them with --simulate.

Pure arithmetic, no torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.choices import Fp8ScalingRecipe, Recompute
from megalite.config.model import GPTConfig
from megalite.plan.layout import DTYPE_BYTES, local_seq_length, stage_layers
from megalite.plan.moe import routed_tokens, stage_moe_layers

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


def sp_input_gathers(cfg: RunConfig, u: int, a: int, tokens: int) -> tuple[int, int]:
    """(forward, backward) bytes of one SP linear's input all-gathers for one [s, b, h] activation of u bytes
    in the training dtype (a per element; `tokens` = s*b): the forward gather, and the weight gradient's
    re-gather in backward. Full recompute re-runs only the forward one (tensorwise: FP8 both ways; rowwise:
    FP8 and the per-token fp32 scales forward, the training dtype again for the weight gradient, whose
    scales run along the tokens, across the shards)."""
    if not enabled(cfg):
        return u, u
    if cfg.precision.fp8_recipe == Fp8ScalingRecipe.ROWWISE:
        return u // a + 4 * tokens, u
    return u // a, u // a


def _saves_fp8_inputs(cfg: RunConfig) -> bool:
    """Tensorwise keeps each linear's input as FP8 (x_q^T, or the SP shard x_q) and its scale for
    backward; rowwise and blockwise keep the input itself (their weight-gradient scales run along
    the tokens, another direction), as the training-dtype linear does."""
    return enabled(cfg) and cfg.precision.fp8_recipe == Fp8ScalingRecipe.TENSORWISE


def attention_saved_change(model: GPTConfig, cfg: RunConfig, recompute: str, kept_once: bool) -> int:
    """Bytes one block keeps for backward beyond plan/activations' count, per microbatch, from its
    attention's two FP8 linears (tensorwise): the QKV input in 1 byte instead of a (the norm output
    [s, b, h]/sp is then not kept), the out-projection's input x_q^T [h/tp, s*b] in 1 byte, and a 4-byte
    scale each. The attention output stays where the core keeps it for its own backward (the Triton
    kernels without recompute: `kept_once`); else its copy is no longer kept (a -> 1 byte)."""
    if not _saves_fp8_inputs(cfg):
        return 0
    a, t = DTYPE_BYTES[cfg.precision.precision], cfg.parallel.tp
    sp = t if cfg.parallel.sequence_parallel else 1
    sbh = local_seq_length(model, cfg) * cfg.training.micro_batch_size * model.hidden_size
    tokens = sbh // model.hidden_size
    out_input = tokens * model.num_attention_heads * (model.head_dim if model.mla is None else model.mla.v_head_dim) // t
    out_change = out_input if (kept_once and recompute == Recompute.NONE) else -(a - 1) * out_input
    if model.mla is None:
        return -(a - 1) * sbh // sp + out_change + 2 * 4
    return _latent_inputs_change(model, a, tokens, sp) + out_change + 3 * 4


def _latent_inputs_change(model: GPTConfig, a: int, tokens: int, sp: int) -> int:
    """MLA's two up-projections keep their inputs [s/sp, b, r] (the normed latents, which nothing else
    keeps) in 1 byte instead of a; without a query latent q_up reads the norm output x, which the plain
    key/value down-projection keeps anyway, so its FP8 copy is kept beside it."""
    mla = model.mla
    change = -(a - 1) * tokens * mla.kv_lora_rank // sp
    if mla.q_lora_rank is None:
        return change + tokens * model.hidden_size // sp
    return change - (a - 1) * tokens * mla.q_lora_rank // sp


def mlp_saved_change(model: GPTConfig, cfg: RunConfig) -> int:
    """The same for a dense MLP's two FP8 linears: fc1's input (the norm output) and fc2's (the
    activation's output [s, b, f/tp], which nothing else keeps) in 1 byte instead of a, and two scales."""
    if not _saves_fp8_inputs(cfg):
        return 0
    a, t = DTYPE_BYTES[cfg.precision.precision], cfg.parallel.tp
    sp = t if cfg.parallel.sequence_parallel else 1
    tokens = local_seq_length(model, cfg) * cfg.training.micro_batch_size
    return -(a - 1) * (tokens * model.hidden_size // sp + tokens * model.ffn_hidden_size // t) + 2 * 4


def expert_saved_change(model: GPTConfig, cfg: RunConfig) -> int:
    """Bytes an MoE block's grouped FP8 experts keep beyond plan/moe's routing count, per microbatch:
    each of the two grouped GEMMs keeps its rows' group ids (int64 [R], R = the rows this rank's experts
    receive) and, tensorwise, its input as x_q^T in 1 byte instead of a ([R, h] into fc1, [R, f_e/etp]
    into fc2) with the [E] per-expert scales, and a shared expert's two linear inputs in 1 byte. Blockwise runs the experts through the FP8 linear one
    after another (views of the rows: nothing more)."""
    if not enabled(cfg) or cfg.precision.fp8_recipe == Fp8ScalingRecipe.BLOCKWISE:
        return 0
    moe, a = model.moe, DTYPE_BYTES[cfg.precision.precision]
    rows, experts = routed_tokens(model, cfg) * moe.topk, moe.num_experts // cfg.parallel.ep
    n = 2 * 8 * rows
    if _saves_fp8_inputs(cfg):
        n += -(a - 1) * rows * (model.hidden_size + moe.expert_ffn(model.ffn_hidden_size) // cfg.etp_size)
        n += 2 * 4 * experts
        if moe.shared_expert_intermediate_size:  # its two linears (no SP): inputs [T, h], [T, f_s/tp] in 1 byte
            tokens = local_seq_length(model, cfg) * cfg.training.micro_batch_size
            n += -(a - 1) * tokens * (model.hidden_size + moe.shared_expert_intermediate_size // cfg.parallel.tp)
            n += 2 * 4
    return n


def expert_weight_cast_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """The grouped experts' input-gradient weight cast (megalite/fp8/grouped.py, in torch): the local
    experts' weights stacked [E, K, N] in the training dtype, their fp32 scaled copy, the FP8 cast and
    its transposed copy, for the widest GEMM: (a + 4 + 2) E h max(mlp_in, f_e)/etp bytes."""
    if not enabled(cfg) or model.moe is None or cfg.precision.fp8_recipe == Fp8ScalingRecipe.BLOCKWISE:
        return 0
    moe, h = model.moe, model.hidden_size
    ffn = moe.expert_ffn(model.ffn_hidden_size)
    widest = moe.num_experts // cfg.parallel.ep * h * max(ffn if model.flavour == "gpt2" else 2 * ffn, ffn)
    return (DTYPE_BYTES[cfg.precision.precision] + 4 + 2) * widest // cfg.etp_size


def forward_buffer_bytes(model: GPTConfig, cfg: RunConfig, output_bytes: int) -> int:
    """A dense block's working set at its MLP-out linear in FP8 (`output_bytes`: the training dtype's,
    its output and the output's tp reduction, plan/buffers.py): tensorwise keeps only the FP8 copy of
    the linear's input for backward, but the input itself [T, f/tp] (the activation's output) lives
    until the MLP's forward returns, beside the larger of that reduction and the GEMM's own operands:
    the FP8 copy x_q [T, f/tp], W_q [h, f/tp] and the output [T, h] (rowwise and blockwise keep the
    input, an activation, and add fp32 scales). Found by --simulate (docs/fp8.md)."""
    if not enabled(cfg):
        return 0
    a, t = DTYPE_BYTES[cfg.precision.precision], cfg.parallel.tp
    tokens, h, f = local_seq_length(model, cfg) * cfg.training.micro_batch_size, model.hidden_size, model.ffn_hidden_size
    gemm = tokens * f // t + h * f // t + a * tokens * h
    if not _saves_fp8_inputs(cfg):
        return max(output_bytes, gemm + 4 * (tokens + h))
    return a * tokens * f // t + max(output_bytes, gemm)


def param_gather_bytes(model: GPTConfig, cfg: RunConfig, params: int, stage: int, p: int) -> int:
    """Bytes of one ZeRO-3 gather of stage `stage`'s `params` (p bytes per element); with
    --fp8-param-gather the blocks' linear weights count 1 byte (MoE experts: not modelled yet)."""
    if not (enabled(cfg) and cfg.precision.fp8_param_gather):
        return params * p
    layers, moe_layers, tp = stage_layers(model, cfg)[stage], stage_moe_layers(model, cfg, stage), cfg.parallel.tp
    fp8 = (layers - moe_layers) * linear_weight_elements(model, tp) + moe_layers * linear_weight_elements(model, tp,
                                                                                                       mlp=False)
    return (params - fp8) * p + fp8
