"""The mixture-of-experts cases of tools/bench_kernels.py (`--ops grouped_mm,moe_permute`).

grouped_mm: megalite's Triton grouped GEMM against the two ways PyTorch offers, `loop` (one
matmul per expert over torch.split, the group sizes read on the host once, before timing) and
`torch_grouped_mm` (torch._grouped_mm, where this torch has it: 2.8+, bf16, Hopper first). Rows
report TFLOP/s and % of the dense bf16 matmul ceiling, and `x_loop` / `x_torch_grouped_mm`.
moe_permute / moe_unpermute: the row moves around the experts (permute includes the stable sort
and its one host read of the routed-row count; unpermute reuses a precomputed sorted_index) against
the PyTorch references and torch.compile of them; GB/s and % of copy.

Routing is a fixed random top-k (seeded): uniform (every expert gets about T * k / E rows), and for
the grouped GEMM also skewed (one expert with most rows: the weight gradient's worst case, one
program per tile of that expert looping over all its rows).
"""
from __future__ import annotations

from typing import Callable

import torch

import megalite.kernels as K
from bench_case import Case
from megalite.kernels.moe_permute import sort_by_expert

# (label, tokens, hidden, expert ffn, experts, top-k, skew), 8192 tokens each: Mixtral-8x7B's experts,
# DeepSeek-V2-Lite's many small ones (64 experts of 1408, top-6), and Mixtral with expert 0 chosen
# by most tokens (skew 0.5 added to its routing score: 75% of tokens pick it, 37% of the rows)
MOE_SHAPES = [("mixtral", 8192, 4096, 14336, 8, 2, 0.0), ("deepseek-v2-lite", 8192, 2048, 1408, 64, 6, 0.0),
              ("mixtral-skewed", 8192, 4096, 14336, 8, 2, 0.5)]
SMOKE_SHAPE = ("smoke", 16, 32, 48, 4, 2, 0.0)
EXTRA_BASELINES = ("loop", "torch_grouped_mm")  # ratio columns x_loop, x_torch_grouped_mm


def moe_cases(ops: set[str], quick: bool, device: str, dtype: torch.dtype, use_compile: bool,
              smoke: bool) -> list[Case]:
    shapes = [SMOKE_SHAPE] if smoke else MOE_SHAPES[:1] if quick else MOE_SHAPES
    element_size = torch.tensor([], dtype=dtype).element_size()
    cases = []
    for label, tokens, hidden, ffn, experts, top_k, skew in shapes:
        expert_ids = random_routing(tokens, experts, top_k, device, skew)
        if "grouped_mm" in ops:
            for name, k_dim, n_cols in (("up", hidden, ffn), ("down", ffn, hidden)):
                cases.append(grouped_mm_case(f"{label} {name}", expert_ids, experts, k_dim, n_cols, device, dtype))
        if "moe_permute" in ops and not skew:
            cases += permute_cases(label, expert_ids, experts, hidden, device, dtype, element_size, use_compile)
    return cases


def random_routing(tokens: int, experts: int, top_k: int, device: str, skew: float = 0.0) -> torch.Tensor:
    """int64 [tokens, top_k]: distinct experts per token, at random (seeded); uniform, or expert 0
    favoured by `skew` added to its uniform score."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(tokens, experts, generator=generator)
    scores[:, 0] += skew
    return scores.topk(top_k, dim=1).indices.to(device)


def grouped_mm_case(shape: str, expert_ids: torch.Tensor, experts: int, k_dim: int, n_cols: int, device: str,
                    dtype: torch.dtype) -> Case:
    """[T * k, K] rows sorted by expert times [E, K, N]; FLOPs 2 T K N forward, 3x that with dx and dweight.

    The weight is stored [E, N, K] (each expert an nn.Linear's [out, in], as Mixtral checkpoints and
    torch's own grouped_mm tests keep it) and every provider multiplies by its [E, K, N] view.
    """
    group_sizes = torch.bincount(expert_ids.reshape(-1), minlength=experts)
    rows = int(group_sizes.sum())
    sizes_on_host = group_sizes.tolist()

    def make_inputs():
        x = torch.randn(rows, k_dim, device=device, dtype=dtype).requires_grad_(True)
        stored = (torch.randn(experts, n_cols, k_dim, device=device, dtype=dtype) / k_dim ** 0.5).requires_grad_(True)
        return [x, stored]

    providers = {"megalite": lambda x, stored: K.grouped_mm(x, stored.transpose(1, 2), group_sizes),
                 "loop": lambda x, stored: per_expert_loop(x, stored.transpose(1, 2), sizes_on_host)}
    if hasattr(torch, "_grouped_mm"):
        ends = group_sizes.cumsum(0).to(torch.int32)
        providers["torch_grouped_mm"] = lambda x, stored: torch._grouped_mm(x, stored.transpose(1, 2), offs=ends)
    forward = 2.0 * rows * k_dim * n_cols
    return Case("grouped_mm", f"{shape} {rows}x{k_dim}x{n_cols} E{experts}", make_inputs, providers, forward,
                3 * forward, flops=True, extra={"baselines": EXTRA_BASELINES, "group_sizes": group_sizes})


def per_expert_loop(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """What an MoE layer without a grouped GEMM does: one matmul per expert (sizes known on the host)."""
    return torch.cat([piece @ weight[g] for g, piece in enumerate(torch.split(x, sizes))])


def permute_cases(label: str, expert_ids: torch.Tensor, experts: int, hidden: int, device: str, dtype: torch.dtype,
                  element_size: int, use_compile: bool) -> list[Case]:
    """permute_tokens (sort + gather, backward a per-token sum) and unpermute_tokens (weighted per-token
    sum, backward a gather with the weights' gradient), each on its own; bytes are each row read or
    written once."""
    tokens, top_k = expert_ids.shape
    rows = tokens * top_k
    sorted_index, _ = sort_by_expert(expert_ids, experts)
    weights = torch.rand(tokens, top_k, device=device).requires_grad_(True)

    def permute(fn: Callable):
        return lambda x: fn(x, expert_ids, experts)[0]

    def unpermute(fn: Callable):
        return lambda y, w: fn(y, sorted_index, w, tokens)

    def compiled(fn: Callable) -> dict:
        return {"compile": torch.compile(fn, dynamic=False)} if use_compile else {}

    token_bytes, row_bytes = tokens * hidden * element_size, rows * hidden * element_size
    return [
        Case("moe_permute", f"{label} {tokens}x{hidden} top{top_k} E{experts}",
             lambda: [torch.randn(tokens, hidden, device=device, dtype=dtype).requires_grad_(True)],
             {"megalite": permute(K.permute_tokens), "eager": permute(K.permute_tokens_reference),
              **compiled(permute(K.permute_tokens_reference))},
             token_bytes + row_bytes, 2 * (token_bytes + row_bytes)),  # fwd: x, rows; bwd: d rows, dx
        Case("moe_unpermute", f"{label} {tokens}x{hidden} top{top_k} E{experts}",
             lambda: [torch.randn(rows, hidden, device=device, dtype=dtype).requires_grad_(True),
                      weights.detach().clone().requires_grad_(True)],
             {"megalite": unpermute(K.unpermute_tokens), "eager": unpermute(K.unpermute_tokens_reference),
              **compiled(unpermute(K.unpermute_tokens_reference))},
             row_bytes + token_bytes, row_bytes + token_bytes + 2 * row_bytes),  # bwd: dout, y, dy
    ]
