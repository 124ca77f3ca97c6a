"""Your own transformer on megalite's whole toolbox: tensor, sequence, context, pipeline and data parallelism.

    python examples/custom_transformer.py                                          # one process, CPU ok
    torchrun --nproc_per_node 8 examples/custom_transformer.py --tp 2 --pp 2 --dp 2 --sequence-parallel --zero 1
    torchrun --nproc_per_node 4 examples/custom_transformer.py --tp 2 --cp 2             # long sequences
    torchrun --nproc_per_node 4 examples/custom_transformer.py --dp 4 --zero 3           # parameters sharded
    torchrun --nproc_per_node 2 examples/custom_transformer.py --pp 2 --schedule interleaved --virtual-stages 2
    torchrun --nproc_per_node 4 examples/custom_transformer.py --in-loop --tp 2 --dp 2 --zero 3 --train-iters 20
    torchrun --nproc_per_node 4 examples/custom_transformer.py --in-loop --tp 2 --pp 2 --train-iters 20

--in-loop hands the same model to megalite's training loop instead of the loop written below
(megalite.training.provided: a `model_provider` and a `loss_fn`; the flags are then megalite's own, as
examples/pretrain_gpt.py takes them): the corpus and tokenizer, checkpoints, resume, metrics and
evaluation come with it (docs/own_model.md).

The model is a plain nn.Sequential written here: an embedding, pre-norm blocks (Megatron's
pattern: column-parallel in, row-parallel out, one tp reduction per half-block) and a head whose
logits stay split over the vocabulary. What each megalite piece does for it:

- tensor parallelism (--tp): Column/RowParallelLinear and VocabParallelEmbedding hold 1/tp of each
  weight; the vocab-parallel cross entropy never gathers the logits;
- sequence parallelism (--sequence-parallel): between the row- and the next column-parallel layer
  each tp rank keeps 1/tp of the tokens; the norms there are megalite's LayerNorm with
  sequence_parallel=True, which declares their partial gradients (DataParallel refuses a plain
  nn.LayerNorm there, naming this fix);
- context parallelism (--cp): each cp rank holds 2 of the 2*cp zigzag chunks of every sequence
  (split_sequence, position_ids) and the attention core is context_parallel_attention, the ring
  (or Ulysses, --cp-comm-type a2a) that GPTModel uses;
- pipeline parallelism (--pp): split_layers cuts the Sequential into pp*v stages and Pipeline runs
  them under any schedule (gpipe, 1f1b, interleaved, zb-h1), verified before the first step;
- data parallelism (--dp) and ZeRO (--zero): DataParallel owns the gradients (and at ZeRO-3 the
  parameters, unit by unit: here one unit per block, listed explicitly).

The global batch is fixed and split over dp, the sequence over cp, the rows into microbatches, and
the loss is divided by the global token count once, so every layout prints the losses of one
process (float32, to ~1e-6).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from megalite.distributed import comm
from megalite.context_parallel import context_parallel_attention, position_ids, split_sequence
from megalite.data_parallel import DataParallel
from megalite.distributed.mesh import destroy_mesh, init_mesh
from megalite.optim import DistributedOptimizer
from megalite.pipeline import Pipeline, split_layers
from megalite.tensor_parallel import (ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding,
                                      scatter_to_sequence_parallel_region, vocab_parallel_cross_entropy)
from megalite.training.advice import Advisor

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, GLOBAL_BATCH, LR = 100, 64, 4, 4, 32, 8, 3e-3


class Embedding(nn.Module):
    """Token ids [b, s/cp] -> hidden states [s/cp, b, h] (sequence first), or under sequence
    parallelism this tp rank's shard [s/cp/tp, b, h]."""

    def __init__(self, mesh, sequence_parallel: bool, vocab: int = VOCAB):
        super().__init__()
        self.tokens = VocabParallelEmbedding(vocab, HIDDEN, init_method=lambda w: nn.init.normal_(w, std=0.02))
        self.positions = nn.Embedding(SEQ, HIDDEN)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.register_buffer("position_ids", position_ids(SEQ, mesh.cp_rank, mesh.cp_size), persistent=False)
        self.sequence_parallel = sequence_parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = (self.tokens(ids) + self.positions(self.position_ids)).transpose(0, 1).contiguous()  # [s/cp, b, h]
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tokens.tp_group)  # [s/cp/tp, b, h]
        return x


class Block(nn.Module):
    """Pre-norm transformer block on [s, b, h] (s: this rank's tokens; /tp more under SP)."""

    def __init__(self, mesh, sequence_parallel: bool, cp_comm_type: str):
        super().__init__()
        self.local_heads, self.head_dim = HEADS // mesh.tp_size, HIDDEN // HEADS
        self.cp_group, self.cp_comm_type = mesh.cp_group, cp_comm_type
        sp = dict(sequence_parallel=sequence_parallel)
        self.norm1, self.norm2 = LayerNorm(HIDDEN, **sp), LayerNorm(HIDDEN, **sp)
        self.qkv = ColumnParallelLinear(HIDDEN, 3 * HIDDEN, fused_blocks=(HIDDEN, HIDDEN, HIDDEN), **sp)  # [Q;K;V]/tp
        self.out = RowParallelLinear(HIDDEN, HIDDEN, **sp)
        self.up = ColumnParallelLinear(HIDDEN, 4 * HIDDEN, **sp)
        self.down = RowParallelLinear(4 * HIDDEN, HIDDEN, **sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.norm1(x))  # [s, b, 3h/tp]: the whole local sequence (SP gathers it here)
        s, b, _ = qkv.shape
        q, k, v = qkv.view(s, b, 3, self.local_heads, self.head_dim).permute(2, 1, 3, 0, 4)  # 3 x [b, h/tp, s, d]
        attn = context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type)  # causal over all cp ranks
        x = x + self.out(attn.permute(2, 0, 1, 3).reshape(s, b, -1))  # this rank's heads, summed over tp
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Head(nn.Module):
    """Final norm and output projection: [s, b, h] -> logits split over the vocabulary [s, b, V/tp]."""

    def __init__(self, sequence_parallel: bool, vocab: int = VOCAB):
        super().__init__()
        self.norm = LayerNorm(HIDDEN, sequence_parallel=sequence_parallel)
        self.proj = ColumnParallelLinear(HIDDEN, vocab, bias=False, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def loss_sum(logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss SUM over a microbatch's tokens: logits [s, b, V/tp], labels [b, s]."""
    return vocab_parallel_cross_entropy(logits_shard, labels.t(), vocab_size=VOCAB).sum()


def build_model(mesh, args, vocab: int = VOCAB) -> nn.Sequential:
    """The whole model, built the same on every rank (same seed, full master weights sliced per tp
    rank); each pipeline rank keeps its own stages of it."""
    torch.manual_seed(0)
    return nn.Sequential(Embedding(mesh, args.sequence_parallel, vocab),
                         *[Block(mesh, args.sequence_parallel, args.cp_comm_type) for _ in range(LAYERS)],
                         Head(args.sequence_parallel, vocab))


def counting_sequences(steps: int) -> torch.Tensor:
    """[steps, GLOBAL_BATCH, SEQ + 1] token ids counting from a random start by a random stride:
    learnable (the next token follows from the last two), so the loss falls visibly."""
    gen = torch.Generator().manual_seed(1)
    start = torch.randint(0, VOCAB, (steps, GLOBAL_BATCH, 1), generator=gen)
    stride = torch.randint(1, 4, (steps, GLOBAL_BATCH, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    for name, help_text in (("tp", "tensor-parallel size"), ("pp", "pipeline-parallel size"),
                            ("cp", "context-parallel size (splits every sequence)"),
                            ("dp", "data-parallel size (splits the fixed global batch)")):
        parser.add_argument(f"--{name}", type=int, default=1, help=help_text)
    parser.add_argument("--sequence-parallel", action="store_true", help="shard norms' activations over tp")
    parser.add_argument("--cp-comm-type", default="p2p", choices=["p2p", "a2a"], help="ring or Ulysses")
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"])
    parser.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                        help="0: torch.optim.AdamW on the reduced grads; 1/2/3: megalite's sharded AdamW "
                             "(3: parameters sharded too)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--metrics-file", default=None, help="JSON lines with step and loss (rank 0)")
    return parser.parse_args(argv)


def check_layout(args) -> None:
    """Refuse a layout that cannot run, on every rank, before any process group exists."""
    world, rows = int(os.environ.get("WORLD_SIZE", "1")), GLOBAL_BATCH // max(args.dp, 1)
    problems = []
    if args.tp * args.cp * args.dp * args.pp != world:
        problems.append(f"world = tp x cp x dp x pp = {args.tp * args.cp * args.dp * args.pp} but {world} "
                        f"processes; launch with torchrun --nproc_per_node {args.tp * args.cp * args.dp * args.pp}")
    if GLOBAL_BATCH % (args.dp * args.micro_batch_size):
        problems.append(f"dp x micro batch ({args.dp} x {args.micro_batch_size}) must divide {GLOBAL_BATCH}")
    if HEADS % args.tp or VOCAB % args.tp:
        problems.append(f"tp must divide the {HEADS} heads and the {VOCAB} vocabulary")
    if (SEQ // args.cp) % (args.tp if args.sequence_parallel else 1) or SEQ % (2 * args.cp):
        problems.append(f"the sequence ({SEQ}) must split into 2*cp chunks, and s/cp over tp under SP")
    if args.pp > 1 and rows // args.micro_batch_size < args.pp:
        problems.append(f"{rows // args.micro_batch_size} microbatches per step cannot fill pp={args.pp} stages")
    if problems:
        print("custom_transformer: " + "; ".join(problems), file=sys.stderr)
        sys.exit(2)


def build_optimizer(model: DataParallel, zero: int):
    if zero == 0:  # any torch optimizer: decay on matrices only, as megalite's default rule
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=LR, betas=(0.9, 0.95))
    return DistributedOptimizer(model, betas=(0.9, 0.95), weight_decay=0.1)


def main(argv: list[str] | None = None) -> list[float]:
    args = parse(argv)
    check_layout(args)
    mesh = init_mesh(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp)  # rank order: tp, cp, dp, pp
    sequence = SEQ // mesh.cp_size // (mesh.tp_size if args.sequence_parallel else 1)  # between stages
    stages = split_layers(build_model(mesh, args), mesh.pp_size * args.virtual_stages)
    pipe = Pipeline(stages, mesh, loss_sum, schedule=args.schedule, virtual_stages=args.virtual_stages,
                    num_microbatches=GLOBAL_BATCH // mesh.dp_size // args.micro_batch_size,
                    activation_shape=(sequence, args.micro_batch_size, HIDDEN))
    units = [m for chunk in pipe.chunks for m in chunk.module]  # ZeRO-3: one unit per layer of my stages
    model = DataParallel(pipe.chunks, mesh, zero_stage=args.zero, bucket_size=20_000,
                         units=units if args.zero == 3 else None, dp_reduction="sum")
    optimizer = build_optimizer(model, args.zero)
    advisor = Advisor(print_fn=print if mesh.rank == 0 else None)
    data = counting_sequences(args.steps)
    rows = slice(mesh.dp_rank * GLOBAL_BATCH // mesh.dp_size, (mesh.dp_rank + 1) * GLOBAL_BATCH // mesh.dp_size)
    metrics = open(args.metrics_file, "w") if args.metrics_file and mesh.rank == 0 else None
    losses = []
    for step in range(args.steps):
        start = time.perf_counter()
        model.zero_grad()
        inputs = split_sequence(data[step, rows, :-1], mesh.cp_rank, mesh.cp_size)  # [b/dp, s/cp], zigzag
        labels = split_sequence(data[step, rows, 1:], mesh.cp_rank, mesh.cp_size)
        microbatches = list(zip(inputs.split(args.micro_batch_size), labels.split(args.micro_batch_size)))
        stats: dict = {}
        local = pipe.step(microbatches, loss_scale=1 / (GLOBAL_BATCH * SEQ), grad_sync=model, stats=stats,
                          measure_bubble=True)
        if args.zero == 0:
            model.finish_grad_sync()  # every param.grad is now the gradient of the whole global batch
            optimizer.step()
        else:
            optimizer.step(lr=LR)
        total = comm.all_reduce(torch.tensor(local, dtype=torch.float64), mesh.dp_cp_group)  # last stage: all tokens
        losses.append(float(comm.all_reduce(total, mesh.pp_group)) / (GLOBAL_BATCH * SEQ))  # other stages add 0
        advisor.observe(step_s=time.perf_counter() - start, pipeline_bubble=stats["bubble_fraction"],
                        exposed_dp_comm_s=sum(model.exposed_comm_seconds().values()), pp=mesh.pp_size,
                        dp=mesh.dp_size * mesh.cp_size)
        if mesh.rank == 0:
            print(f"step {step}: loss {losses[-1]:.6f} (tp={mesh.tp_size} cp={mesh.cp_size} pp={mesh.pp_size} "
                  f"dp={mesh.dp_size} sp={args.sequence_parallel} zero={args.zero})")
        if metrics is not None:
            metrics.write(json.dumps({"step": step, "loss": losses[-1]}) + "\n")
    if metrics is not None:
        metrics.close()
    destroy_mesh()  # optional: init_mesh also registers this for interpreter exit
    return losses


# ---------------------------------------------------------------------------------------------
# --in-loop: the same model in megalite's training loop
# ---------------------------------------------------------------------------------------------

LOOP_VOCAB = 384  # the loop's byte tokenizer has 257 ids; 384 splits evenly over tp in {1, 2, 3, 4, 6, 8}


def model_provider(mesh, *, pre_process: bool, post_process: bool, layer_ids: range | None = None) -> nn.Module:
    """The model for megalite's loop: the whole of it, or at --pp > 1 one pipeline chunk, the blocks
    `layer_ids` (plus the embedding first, the head last). The other positions hold nn.Identity, so
    every parameter keeps its whole-model name (`3.qkv.weight`): checkpoints are layout-free."""
    model = build_model(mesh, argparse.Namespace(sequence_parallel=False, cp_comm_type="p2p"), LOOP_VOCAB)
    model.context_parallel = True  # zigzag chunks: position_ids and context_parallel_attention handle them
    if layer_ids is None:
        return model
    keep = {1 + i for i in layer_ids} | ({0} if pre_process else set()) | ({LAYERS + 1} if post_process else set())
    for index in range(len(model)):
        if index not in keep:
            model[index] = nn.Identity()
    return model


def loop_loss(logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss SUM of a microbatch: logits [s, b, V/tp], labels [b, s] (-100: not a target)."""
    return vocab_parallel_cross_entropy(logits_shard, labels.t(), vocab_size=LOOP_VOCAB).sum()


def in_loop(argv: list[str]) -> int:
    from megalite.training.provided import main as provided_main

    shape = ["--seq-length", str(SEQ), "--num-layers", str(LAYERS), "--hidden-size", str(HIDDEN),
             "--num-attention-heads", str(HEADS)]  # the stages' split and activations [s, b, h] follow these
    return provided_main(shape + argv, model_provider=model_provider, loss_fn=loop_loss)


if __name__ == "__main__":
    if "--in-loop" in sys.argv[1:]:
        sys.exit(in_loop([a for a in sys.argv[1:] if a != "--in-loop"]))
    main()
