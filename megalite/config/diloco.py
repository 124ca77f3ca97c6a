"""Streaming DiLoCo's fragments and their schedule (Douillard et al. 2025): pure arithmetic, no torch.

`--diloco-fragments F` splits the model into F fragments of contiguous transformer layers; fragment p
is synchronised across the replica groups every H = --diloco-inner-steps steps, at steps staggered by
H/F, so each sync carries ~1/F of the parameters and the replica links carry the same total per H
steps. Read by the outer optimizer (megalite/data_parallel/diloco.py) and the planner
(megalite/plan/diloco.py), so both count the same elements at the same steps.

- Layer l of L goes to fragment l * F // L: contiguous blocks, sizes differing by at most one layer
  (L = 6, F = 4: layers 0-1, 2, 3-4, 5).
- The embeddings (word and position) travel with the first fragment, the layers they feed; every other
  parameter outside the blocks (the final norm, an untied output layer, MTP depths) with the last.
- Steps are counted from 1 (the count after the step ran): every H/F steps one fragment syncs, in turn
  0, 1, ..., F-1, so fragment p syncs at the steps t with t % H == (p + 1) * H/F % H. At F = 1 that is
  every H steps, plain DiLoCo.
"""
from __future__ import annotations

import re

_LAYER = re.compile(r"layers\.(\d+)\.")
_FIRST = ("word_embeddings", "position_embeddings")


def layer_fragment(layer: int, *, num_layers: int, fragments: int) -> int:
    """The fragment of transformer layer `layer` (0-based, of `num_layers`)."""
    return layer * fragments // num_layers


def parameter_fragment(name: str, *, num_layers: int, fragments: int) -> int:
    """The fragment of the parameter with logical name `name` ('layers.3.mlp.fc1.weight',
    'word_embeddings.weight', 'final_norm.weight', ...)."""
    match = _LAYER.match(name)
    if match:
        return layer_fragment(int(match.group(1)), num_layers=num_layers, fragments=fragments)
    return 0 if name.startswith(_FIRST) else fragments - 1


def fragment_layers(*, num_layers: int, fragments: int) -> list[int]:
    """How many transformer layers each fragment holds."""
    counts = [0] * fragments
    for layer in range(num_layers):
        counts[layer_fragment(layer, num_layers=num_layers, fragments=fragments)] += 1
    return counts


def synced_fragment(step: int, *, inner_steps: int, fragments: int) -> int | None:
    """The fragment whose outer step runs after step `step` (counted from 1), or None."""
    period = inner_steps // fragments
    if step < 1 or step % period:
        return None
    return (step // period - 1) % fragments


def fragment_problem(*, inner_steps: int, fragments: int, num_layers: int) -> str | None:
    """Why F fragments cannot split H inner steps and L layers, in one line, or None."""
    if fragments > num_layers:
        return (f"--diloco-fragments {fragments} is more fragments than the model's {num_layers} layers; choose "
                f"--diloco-fragments <= {num_layers} dividing --diloco-inner-steps {inner_steps}")
    if inner_steps % fragments:
        choices = [f for f in range(1, min(inner_steps, num_layers) + 1) if inner_steps % f == 0]
        return (f"--diloco-fragments {fragments} does not divide --diloco-inner-steps {inner_steps} (one fragment "
                f"syncs every H/F steps); choose --diloco-fragments in {choices}")
    return None
