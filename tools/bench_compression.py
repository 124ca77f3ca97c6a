"""Gradient compression benchmark: megalite's PowerSGD vs uncompressed, and torch DDP's powerSGD_hook.

Every system trains the default model (`--model tiny`: GPT-2 flavour, 4 layers, h=128, 0.86M
parameters) on the default corpus with the default optimizer and learning-rate schedule, on
`--dp` forked gloo ranks (CPU), from the same initial weights and on the same global batches:

- megalite, uncompressed (ZeRO 0: one all-reduce of every gradient per step): the baseline;
- megalite --grad-compression powersgd at each --ranks R;
- torch DistributedDataParallel with `powerSGD_hook` at each R (same warm-up, error feedback,
  warm start, min compression rate), and with `allreduce_hook` (torch's uncompressed).

Printed per system: bytes per step on the dp group over the compressed steps (megalite: its
comm ledger; torch: the tensors its hooks hand to torch.distributed.all_reduce, counted the
same way), the ratio of the uncompressed baseline's bytes to them, the final training loss
(mean of the last 20 steps), the validation loss after the last step and their distance from
the baseline's in %, the compressor's state per rank, and the median step time (shared CPUs:
indicative only). `--metrics-dir` writes one metrics file per system (JSON lines: step, loss),
which tools/plot_metrics.py draws.

    python tools/bench_compression.py --dp 4 --steps 300 --ranks 1 4 8 --metrics-dir runs/compression
    python tools/plot_metrics.py runs/compression/*.jsonl --out docs/compression_loss.png
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import json
import os
import platform
import statistics
import sys
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.distributed import comm  # noqa: E402
from megalite.distributed import mesh as mesh_lib  # noqa: E402
from megalite.config import RunConfig  # noqa: E402
from megalite.data import EvalSampler, GlobalBatchSampler, build_gpt_datasets, load_microbatches  # noqa: E402
from megalite.data.tokenizer import load_tokenizer  # noqa: E402
from megalite.optim.lr_schedule import LRSchedule  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402
from megalite.training.step import (build_data_parallel, build_model_chunks, build_optimizer, evaluate,  # noqa: E402
                                    global_target_tokens, train_step)
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402

LAST = 20  # steps averaged into the final training loss


class Data:
    """The run's datasets and this rank's global batches (the training loop's data path)."""

    def __init__(self, cfg: RunConfig, m):
        tokenizer = load_tokenizer(None)
        self.cfg, self.m = cfg, m
        self.train_set, self.valid_set, _ = build_gpt_datasets(None, cfg.data.split, cfg.gpt_config().seq_length,
                                                               cfg.training.seed, tokenizer)

    def batches(self):
        t = self.cfg.training
        sampler = GlobalBatchSampler(len(self.train_set), self.cfg.global_batch_size, t.micro_batch_size,
                                     self.m.dp_rank, self.m.dp_size, seed=t.seed)
        for _, indices in zip(range(t.train_iters), sampler):
            yield load_microbatches(self.train_set, indices)

    def validation(self):
        t = self.cfg.training
        batches = EvalSampler(len(self.valid_set), t.eval_iters, self.cfg.global_batch_size, t.micro_batch_size,
                              self.m.dp_rank, self.m.dp_size)
        return [mb for indices in batches for mb in load_microbatches(self.valid_set, indices)]


def _lr_schedule(cfg: RunConfig) -> LRSchedule:
    o = cfg.optimizer
    return LRSchedule(o.lr, o.min_lr, *cfg.lr_schedule_iters, str(o.lr_decay_style))


def _megalite(m, cfg: RunConfig, data: Data) -> dict:
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    model = build_data_parallel(chunks, cfg, m)
    optimizer, lr_at = build_optimizer(model, cfg), _lr_schedule(cfg)
    losses, dp_bytes, times = [], [], []
    for step, microbatches in enumerate(data.batches()):
        comm.ledger.reset()
        start = time.perf_counter()
        result = train_step(model, optimizer, microbatches, m, cfg, lr_at(step))
        times.append(time.perf_counter() - start)
        losses.append(result.loss)
        dp_bytes.append(comm.ledger.total_bytes(group="dp") - 8)  # less the step's 8-byte token count
    state = model.compression.state_bytes() if model.compression is not None else 0
    return dict(losses=losses, dp_bytes=dp_bytes, times=times, state_bytes=state,
                val_loss=evaluate(chunks, data.validation(), m, cfg))


class _CountingAllReduce:
    """Count the bytes torch's comm hooks hand to torch.distributed.all_reduce (ledger convention:
    the tensor), while installed."""

    def __init__(self):
        self.bytes, self._original = 0, None

    def __enter__(self):
        self._original = torch.distributed.all_reduce

        def counted(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        torch.distributed.all_reduce = counted
        return self

    def __exit__(self, *exc):
        torch.distributed.all_reduce = self._original


def _torch_ddp(m, cfg: RunConfig, data: Data, rank: int | None, warmup: int) -> dict:
    """torch DDP over the same model and data: powerSGD_hook at `rank`, or allreduce_hook (None)."""
    model = build_model_chunks(cfg.gpt_config(), cfg, m)[0]  # the same seeded weights as megalite's
    # One bucket, as megalite's (its default 40M elements hold this model): with DDP's default 1 MiB first
    # bucket, two buckets' PowerSGD hooks issue their chained all-reduces from two threads, and on gloo the
    # ranks interleaved them differently (a collective size mismatch aborted the run).
    ddp = DistributedDataParallel(model, process_group=m.dp_group, bucket_cap_mb=64)
    state = None
    if rank is None:
        ddp.register_comm_hook(m.dp_group, default_hooks.allreduce_hook)
    else:
        p = cfg.parallel
        state = psgd.PowerSGDState(m.dp_group, matrix_approximation_rank=rank, start_powerSGD_iter=warmup,
                                   min_compression_rate=p.powersgd_min_compression, use_error_feedback=True,
                                   warm_start=True, random_seed=cfg.training.seed)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    o = cfg.optimizer
    groups = [{"params": [q for q in model.parameters() if q.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [q for q in model.parameters() if q.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)
    lr_at, losses, dp_bytes, times = _lr_schedule(cfg), [], [], []
    for step, microbatches in enumerate(data.batches()):
        start = time.perf_counter()
        tokens = global_target_tokens(microbatches, m)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        (mb,) = microbatches  # one microbatch per rank: DDP reduces in its backward
        with _CountingAllReduce() as counter:
            loss_sum = ddp(mb["input_ids"], mb["labels"], reduction="sum")
            (loss_sum * (m.dp_size / tokens)).backward()  # DDP averages: mean of dp * local/tokens = global mean
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        optimizer.step()
        total = torch.tensor([loss_sum.item()], dtype=torch.float64)
        comm.all_reduce(total, m.dp_group)
        times.append(time.perf_counter() - start)
        losses.append(float(total) / tokens)
        dp_bytes.append(counter.bytes)
    state_bytes = 0 if state is None else 4 * sum(t.numel() for d in (state.error_dict, state.p_memory_dict,
                                                                       state.q_memory_dict) for t in d.values())
    return dict(losses=losses, dp_bytes=dp_bytes, times=times, state_bytes=state_bytes,
                val_loss=evaluate([model], data.validation(), m, cfg))


def _bench_rank(args) -> dict:
    m = mesh_lib.init_mesh(dp=args.dp)
    base = RunConfig.build(dp=args.dp, micro_batch_size=args.micro_batch, global_batch_size=args.global_batch,
                           train_iters=args.steps, eval_iters=args.eval_iters).resolved(args.dp, 257)
    data = Data(base, m)
    systems = {"megalite uncompressed": lambda: _megalite(m, base, data)}
    for rank in args.ranks:
        cfg = base.replace(grad_compression="powersgd", powersgd_rank=rank, powersgd_warmup_steps=args.warmup)
        systems[f"megalite powersgd rank {rank}"] = lambda cfg=cfg: _megalite(m, cfg, data)
    if not args.no_torch:
        systems["torch DDP allreduce_hook"] = lambda: _torch_ddp(m, base, data, None, args.warmup)
        for rank in args.ranks:
            systems[f"torch DDP powerSGD_hook rank {rank}"] = lambda rank=rank: _torch_ddp(m, base, data, rank,
                                                                                          args.warmup)
    results = {}
    for name, run in systems.items():
        started = time.perf_counter()
        results[name] = run()
        if m.rank == 0:
            print(f"  {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {"results": results, "params": base.gpt_config().num_params()}


def _write_metrics(directory: str, results: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, r in results.items():
        with open(os.path.join(directory, name.replace(" ", "_") + ".jsonl"), "w") as f:
            for step, (loss, nbytes) in enumerate(zip(r["losses"], r["dp_bytes"]), 1):
                f.write(json.dumps({"step": step, "loss": loss, "dp_bytes": nbytes}) + "\n")


def _report(args, results: dict, params: int) -> None:
    base = results["megalite uncompressed"]
    base_bytes = statistics.mean(base["dp_bytes"])
    base_loss, base_val = statistics.mean(base["losses"][-LAST:]), base["val_loss"]
    print(f"# bench_compression: dp={args.dp} model=tiny ({params / 1e6:.2f}M params) steps={args.steps} "
          f"global_batch={args.global_batch} micro_batch={args.micro_batch} powersgd warm-up={args.warmup} steps; "
          f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cpus, gloo")
    print(f"{'system':<34} {'dp bytes/step':>14} {'ratio':>7} {'train loss':>11} {'vs base':>8} {'val loss':>9} "
          f"{'vs base':>8} {'state MB':>9} {'step ms':>8}")
    for name, r in results.items():
        compressed = r["dp_bytes"][args.warmup:] if "rank" in name else r["dp_bytes"]
        nbytes = statistics.mean(compressed)
        loss = statistics.mean(r["losses"][-LAST:])
        print(f"{name:<34} {nbytes:>14,.0f} {base_bytes / nbytes:>7.1f} {loss:>11.4f} "
              f"{100 * (loss - base_loss) / base_loss:>+7.2f}% {r['val_loss']:>9.4f} "
              f"{100 * (r['val_loss'] - base_val) / base_val:>+7.2f}% {r['state_bytes'] / 2 ** 20:>9.2f} "
              f"{1e3 * statistics.median(r['times']):>8.1f}")


@reports_usage_errors
def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=300, help="training steps (the lr schedule spans them)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--warmup", type=int, default=2, help="uncompressed steps first (torch needs >= 2)")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step (the default run's 8)")
    parser.add_argument("--eval-iters", type=int, default=8, help="validation global batches after the last step")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch DDP systems")
    parser.add_argument("--metrics-dir", default=None, help="write one metrics file per system here")
    args = parser.parse_args()
    out = run_distributed(_bench_rank, args.dp, args, timeout_s=3600)[0]
    if args.metrics_dir:
        _write_metrics(args.metrics_dir, out["results"])
    _report(args, out["results"], out["params"])


if __name__ == "__main__":
    main()
