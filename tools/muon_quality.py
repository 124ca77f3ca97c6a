"""Muon against AdamW on tiny-llama and the default corpus: each at its own best lr of a small sweep,
several seeds; how many steps AdamW needs to reach Muon's final loss (docs/muon.md).

    python tools/muon_quality.py --steps 150 --lrs 1e-3 3e-3 1e-2 --seeds 1 2 3 --jobs 2 --out muon_quality.json

Each run is `examples/pretrain_gpt.py --model tiny-llama` (one process, this machine's devices) with the
same data order for both optimizers at a seed. The loss compared is the training loss averaged over a
window of `--window` steps (the curve is noisy at these sizes); the sweep picks each optimizer's lr by the
mean final windowed loss over the first seed, then runs the other seeds at it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(optimizer: str, lr: float, seed: int, steps: int, extra: list[str]) -> list[float]:
    """Training losses per step of one run."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        command = [sys.executable, str(ROOT / "examples" / "pretrain_gpt.py"), "--model", "tiny-llama",
                   "--train-iters", str(steps), "--lr", str(lr), "--min-lr", str(lr / 10), "--optimizer", optimizer,
                   "--seed", str(seed), "--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters",
                   str(max(1, steps // 20)), "--metrics-file", str(metrics), *extra]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if "loss" in r and "step" in r]


def windowed(losses: list[float], window: int) -> list[float]:
    """The mean of the `window` losses ending at each step (fewer at the start)."""
    return [statistics.fmean(losses[max(0, i + 1 - window):i + 1]) for i in range(len(losses))]


def steps_to_reach(curve: list[float], target: float) -> int | None:
    """The first step (1-based) whose windowed loss is at or below `target`; None if never."""
    return next((i + 1 for i, value in enumerate(curve) if value <= target), None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each one process)")
    parser.add_argument("--out", type=Path, default=None, help="write every curve and the summary as JSON")
    parser.add_argument("extra", nargs="*", help="more flags for pretrain_gpt.py (after --)")
    args = parser.parse_args(argv)
    curves: dict[str, list[float]] = {}
    best = {}

    def runs(jobs: list[tuple[str, float, int]]) -> None:  # (optimizer, lr, seed), `--jobs` at a time
        with ThreadPoolExecutor(args.jobs) as pool:
            for (optimizer, lr, seed), losses in zip(jobs, pool.map(
                    lambda job: run(*job, args.steps, args.extra), jobs)):
                curves[f"{optimizer} lr={lr} seed={seed}"] = losses
                print(f"{optimizer} lr {lr:g} seed {seed}: final loss {windowed(losses, args.window)[-1]:.4f}",
                      flush=True)

    runs([(optimizer, lr, args.seeds[0]) for optimizer in ("adamw", "muon") for lr in args.lrs])
    for optimizer in ("adamw", "muon"):
        best[optimizer] = min(args.lrs, key=lambda lr: windowed(curves[f"{optimizer} lr={lr} seed={args.seeds[0]}"],
                                                               args.window)[-1])
    runs([(optimizer, best[optimizer], seed) for optimizer in ("adamw", "muon") for seed in args.seeds[1:]])
    summary = {"best_lr": best, "per_seed": []}
    for seed in args.seeds:
        adamw = windowed(curves[f"adamw lr={best['adamw']} seed={seed}"], args.window)
        muon = windowed(curves[f"muon lr={best['muon']} seed={seed}"], args.window)
        needed = steps_to_reach(adamw, muon[-1])
        muon_needs = steps_to_reach(muon, adamw[-1])  # the other way round, inside the same schedule
        summary["per_seed"].append({"seed": seed, "adamw_final": adamw[-1], "muon_final": muon[-1],
                                    "adamw_steps_to_muon_final": needed, "muon_steps_to_adamw_final": muon_needs})
        print(f"seed {seed}: AdamW (lr {best['adamw']:g}) {adamw[-1]:.4f}, Muon (lr {best['muon']:g}) {muon[-1]:.4f}; "
              f"AdamW reaches Muon's final loss at step {needed if needed else f'> {args.steps}'} of {args.steps}; "
              f"Muon reaches AdamW's at step {muon_needs if muon_needs else f'> {args.steps}'}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "summary": summary,
                                        "curves": curves}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
