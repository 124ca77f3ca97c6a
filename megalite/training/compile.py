"""--compile: torch.compile of each transformer block, in place (torchtitan compiles per block too).

`nn.Module.compile()` swaps the block's call for the compiled one and leaves the module, its parameters and
their names alone, so the data-parallel wrapper, the optimizer and the layout-free checkpoint see the same
tensors as in eager mode. Per block rather than the whole model: the blocks are alike, so one compiled graph
serves them all (dynamo recompiles only for a new shape), and the pipeline's stage boundaries, the
recomputation wrapper and megalite's collectives around the blocks stay eager code. Layouts with a
collective inside a block (tp, cp, ep) are refused by megalite/config/checks.py: a 2-rank tp run under
compile did not finish within 900 s on gloo, so they are not proven equal.
"""
from __future__ import annotations

from torch import nn


def compile_blocks(chunks: list[nn.Module]) -> int:
    """Compile every block of each chunk (a GPTModel's `layers`; a module without them whole); returns how
    many modules were compiled."""
    count = 0
    for chunk in chunks:
        blocks = getattr(chunk, "layers", None)
        for module in (blocks if isinstance(blocks, nn.ModuleList) else [chunk]):
            module.compile()
            count += 1
    return count
