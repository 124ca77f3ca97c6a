"""A toy model for executor tests: embedding -> residual Linear+tanh blocks -> head + CE.

Its linear layers honour megalite's weight-gradient routing (`defer_weight_grads`), like
megalite's parallel linears, so ZB-H1's B/W split is exercised for real. `ToyChunk` mirrors
the GPT model's stage contract: forward(x, labels=None, reduction="mean") takes input ids
[b, s] on the first chunk, hidden states [s, b, h] elsewhere, and returns hidden states or
(on the last chunk, given labels) the cross-entropy loss.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from megalite.parameters import params as P
from megalite.tensor_parallel.layers import linear


class DeferrableLinear(torch.nn.Linear):
    """nn.Linear through megalite's `linear`, whose weight gradients honour the routing."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class ToyModel(torch.nn.Module):
    """The whole model; pipeline chunks are sliced from it so every layout is the same model."""

    def __init__(self, vocab: int = 32, hidden: int = 16, num_layers: int = 8, tied: bool = True, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embedding = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(DeferrableLinear(hidden, hidden) for _ in range(num_layers))
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embedding.weight
        self.tied = tied

    def forward(self, x, labels=None, reduction="mean"):
        return run_layers(self, x, labels, reduction, True, True, range(len(self.blocks)))


def run_layers(module, x, labels, reduction, pre_process, post_process, blocks):
    if pre_process:
        x = module.embedding(x).transpose(0, 1)  # [b, s] -> [s, b, h]
    for block in blocks:
        x = x + torch.tanh(module.blocks[block](x) if isinstance(block, int) else block(x))
    if not post_process:
        return x
    logits = module.head(x)  # [s, b, vocab]
    if labels is None:
        return logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.t().reshape(-1), reduction=reduction)


class ToyChunk(torch.nn.Module):
    """Layers `layer_ids` of `full` (copied), plus its embedding / head on the first / last chunk."""

    def __init__(self, full: ToyModel, layer_ids: range, pre_process: bool, post_process: bool):
        super().__init__()
        self.layer_ids = list(layer_ids)
        self.blocks = torch.nn.ModuleList(copy.deepcopy(full.blocks[i]) for i in layer_ids)
        self.pre_process, self.post_process = pre_process, post_process
        if pre_process:
            self.embedding = copy.deepcopy(full.embedding)
            P.declare(self.embedding.weight, tied_across_stages=full.tied)
        if post_process:
            self.head = copy.deepcopy(full.head)
            P.declare(self.head.weight, tied_across_stages=full.tied)
            if pre_process and full.tied:  # one chunk holds both ends: tie locally
                self.head.weight = self.embedding.weight

    def forward(self, x, labels=None, reduction="mean"):
        return run_layers(self, x, labels, reduction, self.pre_process, self.post_process, list(self.blocks))

    def oracle_names(self) -> dict[str, str]:
        """This chunk's parameter names -> the same parameter's name in ToyModel."""
        names = {}
        for name, _ in self.named_parameters():
            if name.startswith("blocks."):
                _, j, rest = name.split(".", 2)
                names[name] = f"blocks.{self.layer_ids[int(j)]}.{rest}"
            elif name.startswith("head.") and P.is_tied_across_stages(self.head.weight):
                names[name] = "embedding.weight"  # tied in the one-process model
            else:
                names[name] = name
        return names
