"""One simulated rank: the real set-up and one real training step, measured.

Inside `fake_rank` and the `MemoryTracker`: `init_mesh` builds the rank's groups, then the same
builders as the training loop (`megalite.training.step`): model chunks, `DataParallel`, the
optimizer; the data position of the first step (`GlobalBatchSampler`) over a dataset of the run's
shape whose tokens are zeros (the values change no byte); then `train_step`, which runs every
microbatch of the verified pipeline schedule, the reductions and the optimizer. The ledger is
reset after the set-up, so its bytes are the step's.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import torch

from megalite.config.choices import Precision
from megalite.distributed import comm
from megalite.config import RunConfig
from megalite.data import GlobalBatchSampler, load_microbatches
from megalite.distributed.mesh import Mesh, init_mesh
from megalite.model.activation_probe import kernels_without_launch
from megalite.moe.dispatcher import RouteCounts, use_route_counts
from megalite.simulate.fake_world import META, fake_rank
from megalite.simulate.memory import MemoryTracker
from megalite.simulate.routing import BalancedRoutes
from megalite.training.guards import NonFiniteGuard
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step


@dataclass
class Measured:
    """One rank's figures from the simulated step (bytes; comm: by group name, ledger convention)."""

    rank: int
    coords: dict[str, int]
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    activation_peak_bytes: int
    peak_bytes: int
    comm_bytes: dict[str, int] = field(default_factory=dict)
    comm_ops: dict[str, int] = field(default_factory=dict)  # 'group/op' -> bytes, for a closer look
    seconds: float = 0.0

    def terms(self) -> dict:
        return {"param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
                "optimizer_state_bytes": self.optimizer_state_bytes,
                "activation_peak_bytes": self.activation_peak_bytes, "peak_bytes": self.peak_bytes,
                "comm_bytes": dict(self.comm_bytes)}


class ZeroTokens:
    """A dataset of `length` samples of `seq_length` zero tokens (GPTDataset's item shape)."""

    def __init__(self, length: int, seq_length: int):
        self.length, self.seq_length = length, seq_length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.zeros(self.seq_length, dtype=torch.long)
        return {"input_ids": tokens, "labels": tokens.clone()}


def coords_of(mesh: Mesh) -> dict[str, int]:
    return {"tp": mesh.tp_rank, "cp": mesh.cp_rank, "dp": mesh.dp_rank, "pp": mesh.pp_rank, "ep": mesh.ep_rank}


def build_mesh(cfg: RunConfig, device: torch.device | None = None) -> Mesh:
    """The mesh as the training loop builds it (`loop.build_job`), its tensors on `device` (default: the
    machine's)."""
    return init_mesh(layout=cfg.layout(), device=device)


def simulate_rank(cfg: RunConfig, rank: int, check_mesh=None) -> Measured:
    """Set up global rank `rank` of `cfg`'s world and run one training step; what it held and sent.
    `check_mesh(mesh)`: problems with the rank's real groups (a list; RuntimeError when not empty).
    The blocks run the Triton kernels' autograd functions with every launch skipped: each tensor is
    allocated and saved as on a GPU (what the planner counts). Under expert parallelism the MoE
    all-to-all is sized by the planner's balanced routing (simulate/routing.py). (The PyTorch path would not do: on
    the meta device SDPA falls back to its math kernel, which keeps what no CPU or GPU run keeps.)"""
    started = time.perf_counter()
    tracker = MemoryTracker()
    # meta the default device too: ZeRO-3 materialises each unit from its seeded stream on the default
    # device, full size (a 70B block on the CPU, initialised: minutes per rank)
    with kernels_without_launch(), fake_rank(rank, cfg.world_size), torch.device(META), tracker.active():
        mesh = build_mesh(cfg, META)
        problems = check_mesh(mesh) if check_mesh is not None else []
        if problems:
            raise RuntimeError("; ".join(problems))
        measured = set_up_and_step(cfg, mesh, tracker, BalancedRoutes())
    measured.seconds = time.perf_counter() - started
    return measured


def set_up_and_step(cfg: RunConfig, mesh: Mesh, tracker: MemoryTracker,
                    route_counts: RouteCounts | None = None) -> Measured:
    """On `mesh` (fake or real), under an active `tracker`: the training loop's builders, the first
    step's data position, one `train_step`; this rank's bytes held and sent in the step.
    route_counts: what the MoE dispatchers size their transfers by (default: the routing's own counts)."""
    torch.manual_seed(cfg.training.seed)
    model_cfg = cfg.gpt_config()
    chunks = build_model_chunks(model_cfg, cfg, mesh)
    if route_counts is not None:
        use_route_counts(chunks, route_counts)
    model = build_data_parallel(chunks, cfg, mesh)
    optimizer = build_optimizer(model, cfg)
    t = cfg.training
    dataset = ZeroTokens(cfg.global_batch_size, model_cfg.seq_length)
    sampler = GlobalBatchSampler(len(dataset), cfg.global_batch_size, t.micro_batch_size, mesh.dp_rank,
                                 mesh.dp_size, seed=t.seed)
    microbatches = load_microbatches(dataset, next(iter(sampler)))
    tracker.exclude_from_activations(p for c in chunks for p in c.parameters())
    tracker.exclude_from_activations(b for c in chunks for b in c.buffers())  # rope tables: not per microbatch
    comm.ledger.reset()
    if cfg.parallel.zero == 3:  # full unit gradients live only during their backward: the peak is sampled
        tracker.sample = model.grads.grad_bytes
    guard = NonFiniteGuard(mesh, cfg.fault_tolerance.on_nonfinite, loss_scaling=cfg.precision.precision == Precision.FP16,
                           log=lambda *args, **kwargs: None)
    train_step(model, optimizer, microbatches, mesh, cfg, cfg.optimizer.lr, guard=guard)
    by_group: dict[str, int] = collections.defaultdict(int)
    for (group, _), n in comm.ledger.bytes.items():
        by_group[group] += n
    states = optimizer.memory_report()
    return Measured(mesh.rank, coords_of(mesh),
                    param_bytes=states["param_bytes"] + states.get("peak_gathered_bytes", 0),
                    grad_bytes=max(states["grad_bytes"], tracker.sampled_peak), optimizer_state_bytes=states["optimizer_state_bytes"],
                    activation_peak_bytes=tracker.saved.peak, peak_bytes=tracker.all.peak,
                    comm_bytes=dict(by_group), comm_ops=comm.ledger.snapshot())


def real_rank(cfg: RunConfig, tracker: MemoryTracker | None = None) -> Measured:
    """This process's rank of a real (torchrun / gloo) world, measured like a simulated one: the
    simulation's grounding (tests/simulate). The same kernels as the simulation (Triton's autograd
    functions, launches skipped), every uninitialised tensor filled with zeros so the step's values
    are finite (a garbage NaN would make the optimizer skip, which changes what is sent).
    tracker: the instrument (default `MemoryTracker(zero_fill=True)`; a given one should zero-fill too)."""
    tracker = tracker if tracker is not None else MemoryTracker(zero_fill=True)
    with kernels_without_launch(), tracker.active():
        mesh = build_mesh(cfg)
        try:
            return set_up_and_step(cfg, mesh, tracker)
        finally:
            comm.ledger.reset()
