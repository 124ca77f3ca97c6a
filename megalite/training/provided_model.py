"""A user's model as the loop builds it: `ProvidedModel` (the provider and loss, checked against
the flags), its chunks (`ProvidedChunk`) and their config, the default loss.

How to train your own model, and what it gets: megalite/training/provided.py (main, train).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megalite.config.choices import CPSplit, Recompute
from megalite.config import RunConfig
from megalite.data_parallel.units import Unit
from megalite.errors import ConfigError, UsageError
from megalite.distributed.mesh import Mesh
from megalite.pipeline.p2p import is_first_chunk, is_last_chunk
from megalite.pipeline.partition import stage_layers
from megalite.pipeline.schedules import chunk_placement
from megalite.tensor_parallel.random import TensorParallelRNG

ModelProvider = Callable[..., nn.Module]
LossFn = Callable[[object, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ProvidedModelConfig:
    """What the loop knows of a model it did not write (its checkpoints store it as their model_config)."""

    flavour: str  # "provided:<class name>"
    num_layers: int  # blocks found: elements of the module's nn.ModuleLists
    total_params: int  # this rank's model, every element once
    seq_length: int
    tie_embeddings: bool = False  # the checkpoint's rule for GPT's tied copy: a provided model has none
    hidden_size: int = 0  # unknown: no attention term in the FLOP counts
    moe: None = None  # no megalite experts (MoE flags are refused)
    window_size: None = None  # no megalite attention (no attention FLOPs counted)
    mtp_num_layers: int = 0  # no multi-token prediction depths
    vocab_size: int = 0  # the flags' (--mock-data draws ids below it); the module's own may be larger

    def num_params(self, include_embedding: bool = True) -> int:
        return self.total_params

    def flops_per_token(self, seq_length: int | None = None, mean_document_length: float | None = None, *,
                        span: float | None = None) -> float:
        return 6.0 * self.total_params

    def scores_width(self) -> int:
        """The q.k and p.v channels per token (GPTConfig's): 0 while the hidden size is unknown."""
        return 2 * self.hidden_size

    def describe(self) -> str:
        return (f"model: {self.flavour.split(':', 1)[1]} from the model provider, {self.num_layers} blocks, "
                f"{self.total_params / 1e6:.2f}M params, seq {self.seq_length}")


def default_loss(output, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross entropy of logits [b, s, V] (float32) against labels [b, s]; -100 is ignored."""
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output[0] if isinstance(output, (tuple, list)) else output
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def _blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every element of every nn.ModuleList inside `module` (outermost lists only), or
    of `module` itself when it is an nn.Sequential (a stack of layers)."""
    if isinstance(module, nn.Sequential):
        return list(module.named_children())
    found = []
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList):
            found += [(f"{name}.{i}", element) for i, element in enumerate(child)]
        else:
            found += [(f"{name}.{inner}", m) for inner, m in _blocks(child)]
    return found


def _recompute(block: nn.Module) -> None:
    """Run `block`'s forward under torch's non-reentrant checkpoint while training (its activations are
    rebuilt in backward; torch's RNG state is restored, so dropout draws the same masks). The module's
    hooks (ZeRO-3's gathers) stay outside: they run on the call, the recompute runs the forward only."""
    forward = block.forward

    @functools.wraps(forward)
    def recomputed(*args, **kwargs):
        if not (block.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed


class ProvidedChunk(nn.Module):
    """A user's module as a megalite model chunk: called with (input_ids, labels, reduction) like
    GPTModel, named layout-free (the module's own parameter names), with ZeRO-3 units per block."""

    def __init__(self, module: nn.Module, loss_fn: LossFn, config: ProvidedModelConfig, seed: int):
        super().__init__()
        self.module, self.loss_fn, self.config = module, loss_fn, config
        self.rng = TensorParallelRNG(seed)  # checkpoints store each chunk's streams; nothing here draws from them

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, reduction: str = "mean",
                position_ids: torch.Tensor | None = None):
        # packed documents: the module gets the restarting position_ids (transformers' padding-free packing)
        output = self.module(input_ids) if position_ids is None else self.module(input_ids, position_ids=position_ids)
        if labels is None:
            return output
        loss_sum = self.loss_fn(output, labels)
        if reduction == "sum":
            return loss_sum
        if reduction == "mean":
            return loss_sum / (labels != -100).sum().clamp(min=1)
        raise ValueError(f"a provided model's loss is a sum over tokens: reduction must be sum or mean, "
                         f"got {reduction!r}")

    def logical_name(self, local_name: str) -> str:
        return local_name.removeprefix("module.")

    def logical_parameters(self):
        for name, param in self.named_parameters():
            yield self.logical_name(name), param

    def zero3_units(self) -> list[Unit]:
        """One unit per block (gathered when its forward starts); the wrapper adds the rest as one unit."""
        return [Unit(name, [p for p in block.parameters() if p.requires_grad], (block,))
                for name, block in _blocks(self.module)]


def provided_problems(cfg: RunConfig) -> list[str]:
    """What the loop cannot yet do for a provided model, one line each naming the fix."""
    p, t = cfg.parallel, cfg.training
    problems = []
    if p.recompute == Recompute.SELECTIVE:
        problems.append("--recompute selective needs megalite's attention; use --recompute full with a "
                        "model_provider")
    if t.cuda_graph:
        problems.append("--cuda-graph is not built for a model_provider's model; drop --cuda-graph")
    if cfg.gpt_config().moe is not None:
        problems.append("MoE flags (--num-experts ...) describe megalite's experts, not a model_provider's "
                        "model; drop them")
    if p.fused_linear_cross_entropy:
        problems.append("--fused-linear-cross-entropy is GPTModel's head; drop it (loss_fn computes the loss)")
    return problems


@dataclass(frozen=True)
class ProvidedModel:
    """The model provider and loss of a run; the loop calls `build_chunks` where it builds GPTModel."""

    model_provider: ModelProvider
    loss_fn: LossFn = default_loss

    def check(self, cfg: RunConfig, dry_run: bool = False) -> None:
        """ConfigError listing `provided_problems`, and --dry-run's (the planner models GPTModel)."""
        problems = provided_problems(cfg) + (["--dry-run estimates GPTModel, not a model_provider's model; run a "
                                              "few steps with --train-iters to measure it"] if dry_run else [])
        if problems:
            raise ConfigError.listing(problems)

    def build_chunks(self, cfg: RunConfig, mesh: Mesh) -> list[ProvidedChunk]:
        """This rank's chunks: the whole model at pp = 1; else one per local chunk (virtual stage), each
        given the global ids of its blocks (`layer_ids`, from --num-layers as GPTModel's stages)."""
        if mesh.pp_size == 1:
            modules = [self._module(cfg, mesh)]
        else:
            p, gpt = cfg.parallel, cfg.gpt_config()
            placement = chunk_placement(cfg.schedule)  # DualPipeV: model chunks pp_rank and 2pp-1-pp_rank
            ranges = stage_layers(gpt.num_layers, mesh.pp_size, p.virtual_stages, mesh.pp_rank,
                                  p.decoder_first_stage_layers, p.decoder_last_stage_layers, p.pipeline_layout,
                                  placement=placement)
            modules = [self._module(cfg, mesh, is_first_chunk(mesh.pp_size, mesh.pp_rank, c),
                                    is_last_chunk(mesh.pp_size, len(ranges), mesh.pp_rank, c, placement), layer_ids)
                       for c, layer_ids in enumerate(ranges)]
        total = sum(p.numel() for m in modules for p in m.parameters())  # this rank's stages
        # the activations crossing a stage boundary are [s, b, hidden_size]: the flags' hidden size at pp > 1
        hidden = cfg.gpt_config().hidden_size if mesh.pp_size > 1 else 0
        config = ProvidedModelConfig(f"provided:{type(modules[0]).__name__}",
                                     sum(len(_blocks(m)) for m in modules), total, cfg.gpt_config().seq_length,
                                     hidden_size=hidden, vocab_size=cfg.gpt_config().vocab_size)
        return [ProvidedChunk(m, self.loss_fn, config, cfg.training.seed) for m in modules]

    def _module(self, cfg: RunConfig, mesh: Mesh, pre_process: bool = True, post_process: bool = True,
                layer_ids: range | None = None) -> nn.Module:
        stage = {} if layer_ids is None else {"layer_ids": layer_ids}
        module = self.model_provider(mesh, pre_process=pre_process, post_process=post_process, **stage)
        if not isinstance(module, nn.Module):
            raise UsageError(f"model_provider returned {type(module).__name__}, not a torch nn.Module; return the "
                             f"model")
        if mesh.cp_size > 1 and not getattr(module, "context_parallel", False):
            raise UsageError(f"--cp {mesh.cp_size}: {type(module).__name__} does not declare context_parallel = True "
                             f"(it would see zigzag chunks of each sequence as if whole); use --cp 1, or handle them "
                             f"(megalite.context_parallel) and set module.context_parallel = True")
        if mesh.cp_size > 1 and cfg.parallel.cp_split == CPSplit.DOCUMENTS:
            raise UsageError("--cp-split documents is for megalite's own model: a provided model builds its own "
                             "document mask, which ring attention reads as the zigzag split; use --cp-split zigzag")
        module = module.to(device=mesh.device, dtype=cfg.precision.precision.torch_dtype)
        if cfg.parallel.recompute == Recompute.FULL:
            for _, block in _blocks(module)[:cfg.parallel.recompute_num_layers]:
                _recompute(block)
        return module

