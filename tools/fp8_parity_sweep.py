"""How often an FP8 run at a tp or cp layout leaves the FP8 single process over a few steps.

Every layout casts the single process's numbers given the same inputs (tests/fp8), but a tp
layout's row-parallel sums and a cp layout's ring attention move fp32 values by an ulp, and a
value within an ulp of an FP8 rounding boundary then rounds the other way (docs/fp8.md). This
trains the parity tests' model (tiny-llama, 2 layers, float32, micro batch 2, global batch 8,
seq 16) for `--steps` steps on `--seeds` data seeds at one layout and at one process, and prints
each seed's largest relative loss difference and how many exceed 1e-5.

    python tools/fp8_parity_sweep.py --layout tp --recipe tensorwise --scales pow2 --seeds 8
"""
from __future__ import annotations

import argparse

import torch

from megalite.distributed import comm, mesh
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.testing import run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

MICRO, GLOBAL, SEQ = 2, 8, 16
LAYOUTS = {"tp": dict(tp=2, sequence_parallel=True), "cp": dict(cp=2)}


def _batches(vocab: int, seed: int, steps: int) -> list[list[dict]]:
    out = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(10 * seed + step))
        out.append([{"input_ids": i[:, :-1], "labels": i[:, 1:]} for i in ids.split(MICRO)])
    return out


def _losses(m, layout: dict, args, seed: int) -> list[float]:
    torch.set_num_threads(1)
    cfg = RunConfig.build(**layout, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3, weight_decay=0.1,
                          clip_grad=0.5, seed=3, adam_eps=1e-6, fp8_format="hybrid", fp8_recipe=args.recipe,
                          fp8_scales=args.scales)
    model = preset("tiny-llama", num_layers=2, num_attention_heads=4, num_query_groups=2, seq_length=SEQ)
    optimizer = build_optimizer(build_data_parallel(build_model_chunks(model, cfg, m), cfg, m), cfg)
    comm.ledger.reset()
    return [train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3).loss
            for mbs in _batches(model.vocab_size, seed, args.steps)]


def _at_layout(args, seed: int) -> list[float]:
    layout = LAYOUTS[args.layout]
    m = mesh.init_mesh(**{k: v for k, v in layout.items() if k in ("tp", "cp")})
    return _losses(m, layout, args, seed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="tp")
    parser.add_argument("--recipe", choices=("tensorwise", "rowwise"), default="tensorwise")
    parser.add_argument("--scales", choices=("pow2", "exact"), default="pow2")
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    worst = []
    for seed in range(args.seeds):
        reference = _losses(single_process_mesh("cpu"), {}, args, seed)
        got = run_distributed(_at_layout, 2, args, seed, timeout_s=600)[0]
        worst.append(max(abs(a - b) / abs(b) for a, b in zip(got, reference)))
    print(f"{args.layout} {args.recipe} {args.scales}: largest relative loss difference per seed "
          f"{' '.join(f'{w:.1e}' for w in worst)}; {sum(w > 1e-5 for w in worst)} of {args.seeds} above 1e-5")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
