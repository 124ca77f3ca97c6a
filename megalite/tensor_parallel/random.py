"""Tensor-parallel-aware dropout randomness: Philox streams whose masks do not depend on the layout.

A dropout mask is never stored. Each dropout *site* (the embedding's, and per global layer the
attention probabilities', the attention output's and the MLP output's) asks its stream for a
64-bit Philox key; element i of the site's *logical* tensor (the whole tensor of the tp=1
model) is kept iff philox(key, i) >= drop_threshold(p) (megalite.kernels.philox). The kernels
regenerate the mask from the key in backward, so no byte of it is kept for backward.

    key = hash(run seed, stream, site, n)      n: how many times this site has drawn before

Megatron's rules, kept with layout-free masks:
- `replicated`: activations every tp rank holds ([s, b, h] hidden states). Every rank draws the
  same key and builds the same mask, so replicas stay identical. Under sequence parallelism
  rank r holds rows [r*s/tp, (r+1)*s/tp) and builds exactly that part of the same mask.
- `tensor_parallel`: tensors split across tp ranks (attention probabilities [h/tp, b, s, s] on
  this rank's heads). Each rank builds the part of the logical mask at its heads' counters:
  ranks' masks differ (disjoint counter ranges, so no correlation) and together they are the
  tp=1 mask.
A mask is thus the same whatever (tp, sp, pp): keys depend on global layer numbers, not on the
rank, and a site counts its own draws, so the n-th training forward through a layer draws the
same key on any stage of any layout. Data-parallel replicas draw the same keys (as Megatron's).

Recompute: `checkpoint_with_rng` (model/recompute.py) saves the draw counters before a
checkpointed forward and restores them for its recompute, so the recompute draws the same keys
and later forwards are undisturbed. The state is a few Python integers; `get_state` gives it
as int64 tensors for checkpoints.
"""
from __future__ import annotations

import torch

from megalite.kernels.bias_dropout_add import bias_dropout_add

_MASK64 = (1 << 64) - 1
_STREAM_IDS = {"replicated": 1, "tensor_parallel": 2}


def _splitmix64(value: int) -> int:
    """SplitMix64's finaliser (Steele et al. 2014): a bijective 64-bit mix."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def mix_key(*words: int) -> int:
    """A Philox key in [0, 2^63) from integers (kernels take it as a signed 64-bit argument)."""
    key = 0
    for word in words:
        key = _splitmix64(key ^ (word & _MASK64))
    return key >> 1


class PhiloxStream:
    """Keys for dropout sites: draw(site) = mix(seed, stream, site, draws of that site so far)."""

    def __init__(self, seed: int, name: str):
        self.name = name
        self._base = mix_key(seed, _STREAM_IDS[name])
        self.draws: dict[int, int] = {}

    def draw(self, site: int) -> int:
        """The next key of `site` (an integer naming one dropout of the model)."""
        n = self.draws.get(site, 0)
        self.draws[site] = n + 1
        return mix_key(self._base, site, n)

    def get_state(self) -> torch.Tensor:
        """int64 [2 * sites]: (site, draws) pairs."""
        return torch.tensor([v for pair in sorted(self.draws.items()) for v in pair], dtype=torch.int64)

    def set_state(self, state: torch.Tensor) -> None:
        if state.dtype != torch.int64 or state.dim() != 1 or state.numel() % 2:
            raise ValueError(f"the {self.name} dropout stream's state must be int64 (site, draws) pairs, got "
                             f"{state.dtype} {list(state.shape)}: a checkpoint from before megalite's Philox "
                             "streams; load it without its RNG states (load_checkpoint(..., load_rng=False))")
        values = state.tolist()
        self.draws = dict(zip(values[0::2], values[1::2]))


class TensorParallelRNG:
    """The two streams of one model chunk; the same on every rank (see the module doc)."""

    def __init__(self, seed: int):
        self.replicated = PhiloxStream(seed, "replicated")
        self.tensor_parallel = PhiloxStream(seed, "tensor_parallel")

    def get_state(self) -> dict[str, torch.Tensor]:
        return {"replicated": self.replicated.get_state(), "tensor_parallel": self.tensor_parallel.get_state()}

    def set_state(self, state: dict[str, torch.Tensor]) -> None:
        self.replicated.set_state(state["replicated"])
        self.tensor_parallel.set_state(state["tensor_parallel"])

    def counters(self) -> tuple[dict[int, int], dict[int, int]]:
        """A copy of the draw counters (what recompute saves): Python integers only."""
        return dict(self.replicated.draws), dict(self.tensor_parallel.draws)

    def set_counters(self, counters: tuple[dict[int, int], dict[int, int]]) -> None:
        self.replicated.draws, self.tensor_parallel.draws = dict(counters[0]), dict(counters[1])


def dropout_site(layer_number: int | None, which: int) -> int:
    """The site number of dropout `which` (0, 1, 2) of global layer `layer_number`; None: the embedding."""
    return 0 if layer_number is None else 1 + 3 * layer_number + which


def dropout(x: torch.Tensor, p: float, stream: PhiloxStream, site: int, training: bool = True,
            offset: int | list[tuple[int, int, int]] = 0, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + dropout(x + bias) with the mask of `stream`'s next key at `site` (bias and residual optional).

    x [rows, ...] is this rank's part of the site's logical tensor: one contiguous run starting at
    element `offset` (0 when this rank holds all of it; rank * x.numel() for a sequence-parallel
    shard [s/tp, b, h]), or several runs [(first row of x, element offset, rows)] (context
    parallelism's two zigzag chunks; `zigzag.logical_row_offsets` gives either form).
    Not training or p == 0: no key is drawn and no element dropped.
    """
    if not training or p == 0.0:
        return bias_dropout_add(x, bias, residual)
    key = stream.draw(site)
    if isinstance(offset, int):
        return bias_dropout_add(x, bias, residual, p, key, offset)
    return torch.cat([bias_dropout_add(x[row:row + rows], bias, None if residual is None else residual[row:row + rows],
                                       p, key, start) for row, start, rows in offset], dim=0)
