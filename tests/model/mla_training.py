"""Two training steps of a tiny DeepSeek-shaped model, the parity tests' common run (MLA under cp,
MLA in FP8): the same seeded batches at every layout, and each final parameter kept whole at one
process or compared with the single process's slice on every other rank."""
from __future__ import annotations

import torch

from megalite.parameters import params as P
from megalite.testing import assert_tensor_close
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step


def batches(steps: int = 2) -> list[list[dict]]:
    """`steps` global batches of 4 samples of 16 tokens, each as two microbatches of 2."""
    out = []
    for step in range(steps):
        ids = torch.randint(0, 257, (4, 17), generator=torch.Generator().manual_seed(50 + step))
        out.append([{"input_ids": i[:, :-1], "labels": i[:, 1:]} for i in ids.split(2)])
    return out


def train_two_steps(m, cfg, reference=None):
    """(losses, grad norms, the model chunks, the final full parameters at one process; else each one
    compared with `reference`'s slice for this rank, 1e-5)."""
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    results = [train_step(optimizer.model, optimizer, batch, m, cfg, lr=1e-3) for batch in batches()]
    final = final_parameters(optimizer, chunks, cfg, reference)
    return [r.loss for r in results], [r.grad_norm for r in results], chunks, final


def final_parameters(optimizer, chunks, cfg, reference=None) -> dict:
    """Without `reference` (one process): every full parameter by name; else each rank's parameter compared
    with `reference`'s slice for this rank (1e-5) and {} returned."""
    final = {}
    with optimizer.model.gathered():
        for name, p in (item for c in chunks for item in c.logical_parameters()):
            if reference is None:
                final[name] = P.shard_spec(p).assemble([p.detach()])
            else:
                assert_tensor_close(p, P.shard_spec(p).shard(reference[name]), rtol=1e-5,
                                    what=f"{cfg.parallel} {name}")
    return final
