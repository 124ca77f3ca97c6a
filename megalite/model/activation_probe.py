"""Saved-activation bytes per transformer layer, measured, next to Korthikanti et al. 2022.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", Table 2
(Eqs. 1-6) give the bytes one GPT layer keeps for backward, with 2-byte activations, 1-byte
dropout masks and no flash attention, for six techniques. Here one `TransformerBlock` runs a
training forward under autograd's saved-tensor hooks and every distinct storage it saves is
counted once (views of one storage, e.g. q, k, v of the fused QKV output, count once;
parameters do not count). The block's input counts (its first norm keeps it), its output does
not (the next layer's input). A recompute checkpoint's inputs are saved through autograd and
so counted; the dropout counters it keeps are Python integers (0 tensor bytes).

Backends: "triton" runs megalite's Triton autograd functions with the kernel launches skipped
(every tensor is allocated and saved exactly as on a GPU, only the values are not computed);
"torch" runs the PyTorch paths CPU training uses.

    python -m megalite.model.activation_probe          # the table at s=128, b=2, h=64, a=4, tp=2
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import os
import pkgutil
from dataclasses import dataclass

import torch

import megalite.kernels as kernels_package
from megalite.config.choices import Recompute
from megalite.distributed import comm
from megalite.distributed.layer_groups import LayerGroups
from megalite.distributed.mesh import current_mesh, init_mesh
from megalite.config.model import GPTConfig
from megalite.model.recompute import checkpoint_with_rng
from megalite.model.transformer import TransformerBlock
from megalite.tensor_parallel.random import TensorParallelRNG
from megalite.testing import run_distributed


@dataclass(frozen=True)
class Technique:
    name: str
    tensor_parallel: bool
    sequence_parallel: bool
    recompute: str  # none | selective | full


TECHNIQUES = (  # Korthikanti et al. Table 2, in its order
    Technique("no parallelism", False, False, "none"),
    Technique("tensor parallel (baseline)", True, False, "none"),
    Technique("tensor + sequence parallel", True, True, "none"),
    Technique("tensor parallel + selective recompute", True, False, "selective"),
    Technique("tensor + sequence parallel + selective recompute", True, True, "selective"),
    Technique("full recompute", False, False, "full"),
)


def korthikanti_layer_bytes(technique: Technique, s: int, b: int, h: int, heads: int, t: int) -> float:
    """Bytes per layer by Korthikanti et al. Eqs. 1-6 (t = tp; a = heads)."""
    t = t if technique.tensor_parallel else 1
    attention_scores = 5 * heads * s / h  # the 5as^2b term, in units of sbh
    if technique.recompute == Recompute.FULL:
        per_sbh = 2.0                                               # Eq. 6: the layer input
    elif technique.recompute == Recompute.SELECTIVE:
        per_sbh = 34 / t if technique.sequence_parallel else 10 + 24 / t   # Eq. 5 / Table 2
    elif technique.sequence_parallel:
        per_sbh = (34 + attention_scores) / t                       # Eq. 4
    elif t > 1:
        per_sbh = 10 + (24 + attention_scores) / t                  # Eq. 2
    else:
        per_sbh = 34 + attention_scores                             # Eq. 1
    return per_sbh * s * b * h


@contextlib.contextmanager
def kernels_without_launch(launches: collections.Counter | None = None):
    """megalite's Triton autograd functions on CPU with every kernel launch skipped.

    launches: if given, counts the skipped launches by kernel name (tools/bench_host_overhead.py)."""
    class _NoLaunch:
        def __init__(self, kernel):
            self.name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "?")

        def __getitem__(self, grid):
            if launches is not None:
                launches[self.name] += 1
            return lambda *args, **kwargs: None

    modules = []
    for info in pkgutil.iter_modules(kernels_package.__path__):
        if info.name != "compile_check":
            module = importlib.import_module(f"{kernels_package.__name__}.{info.name}")
            if hasattr(module, "runnable"):
                modules.append((module, module.runnable))
    saved_env = {k: os.environ.get(k) for k in ("MEGALITE_KERNEL_BACKEND", "TRITON_INTERPRET")}
    os.environ.update(MEGALITE_KERNEL_BACKEND="triton", TRITON_INTERPRET="1")
    for module, _ in modules:
        module.runnable = lambda kernel, device: _NoLaunch(kernel)
    try:
        yield
    finally:
        for module, original in modules:
            module.runnable = original
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _backend(name: str):
    if name == "triton":
        with kernels_without_launch():
            yield
        return
    if name != "torch":
        raise ValueError(f"backend must be 'triton' or 'torch', got {name!r}")
    previous = os.environ.get("MEGALITE_KERNEL_BACKEND")
    os.environ["MEGALITE_KERNEL_BACKEND"] = "torch"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MEGALITE_KERNEL_BACKEND")
        else:
            os.environ["MEGALITE_KERNEL_BACKEND"] = previous


def saved_storage_bytes(fn, exclude: set[int]) -> tuple[int, object]:
    """(bytes of the distinct storages autograd saves while fn() runs, fn's result)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return sum(storages.values()), result


def measure_layer_bytes(config: GPTConfig, technique: Technique, tp_group=None, seq: int = 128, batch: int = 2,
                        dtype: torch.dtype = torch.bfloat16, backend: str = "triton") -> int:
    """Bytes one block keeps for backward under `technique`, on this tp rank.

    tp_group: the tensor-parallel group for TP techniques; None (and no current mesh) for the
    others. The block is layer 0 of a model with `config`; rope is not applied (gpt2 flavour).
    """
    tp = comm.group_size(tp_group) if technique.tensor_parallel else 1
    if technique.tensor_parallel == (tp_group is None):
        raise ValueError(f"{technique.name}: pass a tp group exactly for tensor-parallel techniques")
    if tp_group is None and current_mesh() is not None:  # layers would pick the mesh's tp group
        raise RuntimeError(f"{technique.name} runs without tensor parallelism: measure it where no mesh exists")
    if config.flavour != "gpt2":
        raise ValueError("the probe measures gpt2-flavour blocks (Korthikanti's GPT layer)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = TransformerBlock(config, LayerGroups(tp=tp_group if technique.tensor_parallel else None),
                                 sequence_parallel=technique.sequence_parallel, dtype=dtype, layer_number=0).train()
        rows = seq // tp if technique.sequence_parallel else seq
        x = torch.randn(rows, batch, config.hidden_size, dtype=dtype, requires_grad=True)  # [s(/tp), b, h]
    block.recompute_core = technique.recompute == Recompute.SELECTIVE
    rng = TensorParallelRNG(seed=1234)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def forward():
        if technique.recompute == Recompute.FULL:
            return checkpoint_with_rng(block, rng, x, None, rng)
        return block(x, None, rng)

    with _backend(backend):
        kept, _ = saved_storage_bytes(forward, params)
    return kept


@dataclass(frozen=True)
class Row:
    technique: str
    measured_bytes: int
    formula_bytes: float
    sbh: int

    def measured_sbh(self) -> float:
        return self.measured_bytes / self.sbh

    def formula_sbh(self) -> float:
        return self.formula_bytes / self.sbh


def _tensor_parallel_rows(config, seq, batch, tp, dtype, backend) -> list[int]:
    mesh = init_mesh(tp=tp)
    return [measure_layer_bytes(config, t, mesh.tp_group, seq, batch, dtype, backend)
            for t in TECHNIQUES if t.tensor_parallel]


def measure_table(config: GPTConfig, seq: int = 128, batch: int = 2, tp: int = 2, dtype=torch.bfloat16,
                  backend: str = "triton") -> list[Row]:
    """Every technique of Table 2: tp=1 ones in this process, TP ones in a forked gloo world of tp ranks."""
    if current_mesh() is not None:
        raise RuntimeError("measure_table forks its own tp world; call it where no mesh exists")
    local = {t.name: measure_layer_bytes(config, t, None, seq, batch, dtype, backend)
             for t in TECHNIQUES if not t.tensor_parallel}
    per_rank = run_distributed(_tensor_parallel_rows, tp, config, seq, batch, tp, dtype, backend)
    parallel = [max(values) for values in zip(*per_rank)]  # the largest rank (they agree here)
    names = [t.name for t in TECHNIQUES if t.tensor_parallel]
    measured = {**local, **dict(zip(names, parallel))}
    sbh = seq * batch * config.hidden_size
    return [Row(t.name, measured[t.name],
                korthikanti_layer_bytes(t, seq, batch, config.hidden_size, config.num_attention_heads, tp), sbh)
            for t in TECHNIQUES]


def probe_config(hidden_dropout: float = 0.1, attention_dropout: float = 0.1) -> GPTConfig:
    """The issue's shape: h=64, a=4 heads, s=128 (gpt2 flavour)."""
    return GPTConfig("gpt2", num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=128,
                     hidden_dropout=hidden_dropout, attention_dropout=attention_dropout)


def main() -> None:
    config = probe_config()
    print("bytes per layer / (s*b*h), bf16, dropout 0.1, s=128 b=2 h=64 a=4, tp=2 where TP is used")
    print(f"{'technique':52s} {'triton':>8s} {'torch':>8s} {'paper':>8s}")
    rows = {backend: measure_table(config, backend=backend) for backend in ("triton", "torch")}
    for triton_row, torch_row in zip(rows["triton"], rows["torch"]):
        print(f"{triton_row.technique:52s} {triton_row.measured_sbh():8.3f} {torch_row.measured_sbh():8.3f} "
              f"{triton_row.formula_sbh():8.3f}")


if __name__ == "__main__":
    main()
