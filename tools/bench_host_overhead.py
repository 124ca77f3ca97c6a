"""Host work of one training step: megalite's GPU path vs a plain transformers GPT-2 loop, on CPU.

On a GPU a small model's step is bound by the host when issuing the work costs more than the
kernels themselves (GPT-2 small on an H200: 46-55 ms of wall time for 17 ms of kernels). This
tool counts what the host issues in one real training step, without a GPU:

- megalite runs its real path (model chunk, DataParallel buffers and hooks, DistributedOptimizer,
  global loss normalisation) with the Triton kernels selected as on a GPU but their launches
  skipped (`activation_probe.kernels_without_launch`): every tensor is allocated and every
  autograd function runs, only the kernels' values are not computed;
- the baseline is tools/bench_train.py's loop over transformers' GPT2LMHeadModel, its AdamW and
  clipping in their GPU default (foreach) form.

Counted in one step (after warm-up steps), forward+backward and optimizer apart:
  aten ops        every op reaching the dispatcher below autograd (TorchDispatchMode)
  launches        kernel launches as on a GPU: Triton launches + aten ops that compute (views,
                  `empty` allocations and metadata ops launch nothing; a foreach op counts once)
  dtype copies    aten._to_copy / copy_ between different dtypes
  memsets         zero_/fill_/zeros-like fills
  autograd nodes  backward nodes run by the engine: Python autograd.Function backwards and
                  AccumulateGrad (torch.profiler events)
and the host CPU seconds per step (median, launches skipped, few tokens so the CPU math is small;
the CPU still computes the aten ops' values, so this is an upper bound of the host's own work).

    python tools/bench_host_overhead.py                         # small gpt2-shaped model, seconds
    python tools/bench_host_overhead.py --model gpt2-124m       # the H200 benchmark's layers and vocab

Prints each count for both and the ratio megalite / baseline. Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import collections
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
# _unsafe_view is a view whose schema does not say so (matmul and reshape return it): no kernel
_METADATA = {"_local_scalar_dense", "is_nonzero", "lift_fresh", "set_", "detach", "alias", "resize_",
             "record_stream", "_has_compatible_shallow_copy_type", "_unsafe_view"}
_FILLS = {"zero_", "fill_", "zeros", "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full",
          "full_like", "new_full"}
from megalite.errors import reports_usage_errors
from megalite.cli import OneLineParser
from megalite.extras import require
from megalite.model import preset
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.training import step as step_module
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer
from megalite.model.activation_probe import kernels_without_launch


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class OpCounter(TorchDispatchMode):
    """Counts aten ops, the ones that launch a kernel on a GPU, dtype copies and fills."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.launches = 0
        self.dtype_copies: collections.Counter = collections.Counter()
        self.memsets = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name not in _ALLOCATIONS and name not in _METADATA and not _is_view(func):
            self.launches += 1
        if name in _FILLS:
            self.memsets += 1
        out = func(*args, **kwargs)
        if name in ("_to_copy", "copy_") and isinstance(out, torch.Tensor):
            source = args[1] if name == "copy_" else args[0]
            if isinstance(source, torch.Tensor) and source.dtype != out.dtype:
                self.dtype_copies[f"{source.dtype}->{out.dtype}".replace("torch.", "")] += 1
        return out


def _autograd_nodes(prof) -> collections.Counter:
    nodes: collections.Counter = collections.Counter()
    prefix = "autograd::engine::evaluate_function: "
    for event in prof.events():
        if event.name.startswith(prefix):
            nodes[event.name[len(prefix):]] += 1
    return nodes


def count(phases, triton_launches: collections.Counter) -> dict:
    """Run each (name, fn) of one step under the counters; one dict of counts per phase."""
    result = {}
    for name, fn in phases:
        getattr(fn, "prepare", lambda: None)()
        triton_launches.clear()
        counter = OpCounter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with counter:
                fn()
        nodes = _autograd_nodes(prof)
        result[name] = {
            "aten ops": sum(counter.ops.values()),
            "launches": counter.launches + sum(triton_launches.values()),
            "triton launches": sum(triton_launches.values()),
            "dtype copies": sum(counter.dtype_copies.values()),
            "memsets": counter.memsets,
            "autograd nodes": sum(nodes.values()),
            "AccumulateGrad": nodes.get("torch::autograd::AccumulateGrad", 0),
            "Function backwards": sum(n for k, n in nodes.items() if k.endswith("Backward") and k.startswith("_")),
            "_detail": {"dtype copies": dict(counter.dtype_copies), "top ops": counter.ops.most_common(12),
                        "nodes": nodes.most_common(10)},
        }
    return result


def host_seconds(phases, steps: int) -> float:
    """Median CPU seconds of this process per step (the phases in order, each phase's `prepare` run
    before it but not timed: megalite's fills the gradients a skipped launch left unset, which is
    not a step's work): on a shared machine, wall time would count the other processes' turns too
    (one intra-op thread: CPU time is the host's work)."""
    times = []
    for _ in range(steps):
        spent = 0.0
        for fn in phases:
            getattr(fn, "prepare", lambda: None)()
            start = time.process_time()
            fn()
            spent += time.process_time() - start
        times.append(spent)
    return statistics.median(times)


def _model_config(args):
    if args.model:
        return preset(args.model, seq_length=args.seq_length)
    # GPT-2 small's structure (12 blocks) at a width and vocabulary the CPU does not notice: the
    # counts per step depend on the blocks, not on the widths
    return preset("gpt2-124m", hidden_size=128, num_attention_heads=4, vocab_size=2048, seq_length=args.seq_length)


def megalite_phases(model_cfg, args, data):
    """(forward_backward, optimizer) of megalite's real step, split where train_step splits it."""
    b = args.micro_batch_size
    batch = [{"input_ids": data[:, :-1], "labels": data[:, 1:]}]
    mesh = single_process_mesh(torch.device("cpu"))
    cfg = RunConfig.build(micro_batch_size=b, global_batch_size=b, precision=args.precision, clip_grad=1.0,
                          weight_decay=0.1)
    chunks = build_model_chunks(model_cfg, cfg, mesh)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, mesh), cfg)
    model = optimizer.model
    state = {}

    def forward_backward():
        tokens = step_module.GlobalTokens(batch, mesh)
        scale = optimizer.loss_scaler.scale if optimizer.loss_scaler is not None else 1.0
        optimizer.zero_grad()
        model.train()
        state["loss"] = step_module._accumulate_microbatches(model, step_module._to_device(batch, mesh.device),
                                                             lambda: tokens.loss_scale(scale),
                                                             step_module._no_timer)

    def optimizer_step():
        optimizer.step(lr=1e-4)

    def finite_grads():  # the skipped launches leave gradients unset: an update must not be skipped
        model.grad_shard.uniform_(-1e-3, 1e-3)

    optimizer_step.prepare = finite_grads
    return forward_backward, optimizer_step


def hf_phases(model_cfg, args, data):
    transformers = require("transformers", "tools/bench_host_overhead.py (the HF baseline)")  # the [hf] extra
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    hf_cfg = transformers.GPT2Config(vocab_size=model_cfg.vocab_size, n_positions=args.seq_length,
                                     n_embd=model_cfg.hidden_size, n_layer=model_cfg.num_layers,
                                     n_head=model_cfg.num_attention_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).to(dtype=dtype).train()
    # foreach: what torch picks by default for CUDA tensors (on CPU it would loop per tensor)
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    ids = data[:, :-1]

    def forward_backward():
        hf(input_ids=ids, labels=ids).loss.backward()

    def optimizer_step():
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward_backward, optimizer_step


def _parse_args(argv):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a gpt2-flavour preset (default: gpt2-124m's 12 blocks "
                                                      "at h=128, vocabulary 2048)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=32, help="few tokens: the CPU math stays small")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--detail", action="store_true", help="also print the dtype copies and top ops")
    return parser.parse_args(argv)


KEYS = ("aten ops", "launches", "triton launches", "dtype copies", "memsets", "autograd nodes", "AccumulateGrad",
        "Function backwards")


@reports_usage_errors
def main(argv=None) -> int:
    args = _parse_args(argv)
    torch.manual_seed(0)
    model_cfg = _model_config(args)
    data = torch.randint(0, model_cfg.vocab_size, (args.micro_batch_size, args.seq_length + 1))
    triton_launches: collections.Counter = collections.Counter()
    with kernels_without_launch(triton_launches):
        ours = megalite_phases(model_cfg, args, data)
        theirs = hf_phases(model_cfg, args, data)
        for fb, opt in (ours, theirs):  # warm-up: allocator, first-step calibration of the buckets
            for _ in range(2):
                fb()
                opt()
        counts = {"megalite": count([("fwd+bwd", ours[0]), ("optimizer", ours[1])], triton_launches),
                  "transformers": count([("fwd+bwd", theirs[0]), ("optimizer", theirs[1])], triton_launches)}
        seconds = {name: host_seconds(phases, args.steps)
                   for name, phases in (("megalite", ours), ("transformers", theirs))}
    _report(model_cfg, args, counts, seconds)
    return 0


def _report(model_cfg, args, counts, seconds) -> None:
    print(f"torch {torch.__version__}, CPU, kernel launches skipped; model gpt2 flavour, {model_cfg.num_layers} "
          f"layers, h={model_cfg.hidden_size}, vocab {model_cfg.vocab_size}; batch {args.micro_batch_size}x"
          f"{args.seq_length}; {args.precision}")
    print(f"{'per step':24s} {'phase':10s} {'megalite':>10s} {'transformers':>13s} {'ratio':>7s}")
    for phase in ("fwd+bwd", "optimizer"):
        for key in KEYS:
            ours, theirs = counts["megalite"][phase][key], counts["transformers"][phase][key]
            ratio = f"{ours / theirs:7.2f}" if theirs else "      -"
            print(f"{key:24s} {phase:10s} {ours:10d} {theirs:13d} {ratio}")
    ours, theirs = seconds["megalite"], seconds["transformers"]
    print(f"{'host CPU ms per step':24s} {'all':10s} {ours * 1e3:10.1f} {theirs * 1e3:13.1f} {ours / theirs:7.2f}")
    if args.detail:
        for name in ("megalite", "transformers"):
            for phase in ("fwd+bwd", "optimizer"):
                print(f"{name} {phase}: {counts[name][phase]['_detail']}")


if __name__ == "__main__":
    raise SystemExit(main())
