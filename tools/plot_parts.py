#!/usr/bin/env python3
"""Draw the pictures of the architecture pages from the code's own objects.

    python tools/plot_parts.py --out-dir docs/architecture            # all of them
    python tools/plot_parts.py --part cp --out-dir /tmp/pictures        # one

- layout (docs/architecture/layout.md): which ranks form each tp, cp, dp, pp, ep and dp x cp group
  of a 16-rank world (tp 2, cp 2, dp 2, pp 2, ep 2), from megalite.distributed.topology's group lists;
- tp (tensor_parallel.md): which rows or columns of each full weight every tp rank holds at tp 2 (fused
  [Q; K; V] and [gate; up] split block by block), from the parameters' declared ShardSpecs;
- zero (data_parallel.md): what each dp rank holds of the parameters, gradients and optimizer state
  at ZeRO 0/1/2/3, from megalite.data_parallel.layout's buckets (ZeRO-3: its units) laid over a
  small GPT's real parameters in the wrapper's order;
- cp (context_parallel.md): the zigzag chunks of a sequence at cp 4 and the causal attention blocks
  each rank computes at each ring step, from megalite.context_parallel.zigzag and blocks;
- moe (moe.md): top-2 routing of two ep ranks' tokens, their rows permuted by expert
  (megalite.ops.permute_tokens), the all-to-all's per-rank counts and what each rank receives;
- checkpoint (checkpoints.md): one weight's optimizer state saved at (tp 2, dp 2, ZeRO 1) as boxes of the
  full tensor (megalite.checkpoint.boxes), and the boxes readers at other layouts need.

PNG or SVG by the suffix (--format); needs matplotlib (pip install 'megalite[plot]').
"""
from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

from megalite import ops
from megalite.distributed import topology
from megalite.checkpoint.boxes import shard_boxes
from megalite.cli import OneLineParser
from megalite.config import RunConfig
from megalite.config.model import GPTConfig
from megalite.context_parallel.blocks import DIAGONAL, FULL, block_kind, causal_work, rank_block_counts, ring_source
from megalite.context_parallel.zigzag import chunk_ids
from megalite.data_parallel.layout import build_layout, build_unit_layout
from megalite.errors import reports_usage_errors
from megalite.extras import pyplot
from megalite.distributed.mesh import single_process_mesh
from megalite.moe.router import top_k_deterministic
from megalite.parameters.params import shard_spec
from megalite.training.step import build_model_chunks

PARTS = ("layout", "tp", "zero", "cp", "moe", "checkpoint")
FILES = {"layout": "layout_groups", "tp": "tp_shards", "zero": "zero_stages", "cp": "cp_zigzag", "moe": "moe_dispatch",
         "checkpoint": "checkpoint_boxes"}
RANK_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def _colour(i: int) -> str:
    return RANK_COLOURS[i % len(RANK_COLOURS)]


# ------------------------------------------------------------------------------------------ layout

def draw_layout(out: str, tp: int = 2, cp: int = 2, dp: int = 2, pp: int = 2, ep: int = 2) -> list[str]:
    """Every group kind as a panel: the world's ranks (rows: pipeline stages), coloured by group."""
    plt = pyplot("tools/plot_parts.py")
    groups = {"tp": topology.tp_group_ranks(tp, pp, dp, cp), "cp": topology.cp_group_ranks(tp, pp, dp, cp),
              "dp": topology.dp_group_ranks(tp, pp, dp, cp), "pp": topology.pp_group_ranks(tp, pp, dp, cp),
              "dp x cp (gradient reduction)": topology.dp_cp_group_ranks(tp, pp, dp, cp),
              f"ep {ep} (experts' all-to-all)": topology.ep_group_ranks(tp, pp, dp, cp, ep)}
    per_stage = tp * cp * dp
    fig, axes = plt.subplots(3, 2, figsize=(10, 5.4))
    titles = []
    for ax, (name, lists) in zip(axes.flat, groups.items()):
        group_of = {rank: g for g, members in enumerate(lists) for rank in members}
        for rank, g in group_of.items():
            stage, column = divmod(rank, per_stage)
            ax.add_patch(plt.Rectangle((column, stage), 0.94, 0.9, color=_colour(g)))
            ax.text(column + 0.47, stage + 0.45, str(rank), ha="center", va="center", color="white", fontsize=9)
        shown = " ".join(str(m).replace(" ", "") for m in lists[:4]) + (" ..." if len(lists) > 4 else "")
        title = f"{name}: {len(lists)} groups of {len(lists[0])}"
        titles.append(title)
        ax.set_title(f"{title}\n{shown}", fontsize=8)
        ax.set_xlim(0, per_stage)
        coords = [topology.rank_to_coords(c, tp, pp, dp, cp) for c in range(per_stage)]  # (tp, dp, pp) ranks
        ax.set_xticks([c + 0.47 for c in range(per_stage)],
                      [f"t{t} c{topology.rank_to_cp_rank(c, tp, cp)} d{d}" for c, (t, d, _) in enumerate(coords)],
                      fontsize=6)
        ax.set_ylim(pp, 0)
        ax.set_yticks([s + 0.45 for s in range(pp)], [f"stage {s}" for s in range(pp)], fontsize=7)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.suptitle(f"rank = tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)); tp {tp}, cp {cp}, dp {dp}, pp {pp}: "
                 f"one colour per group", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return titles


# ------------------------------------------------------------------------------------------ ZeRO

def zero_layouts(dp: int = 4):
    """(buckets' layout for ZeRO 0-2, units' layout for ZeRO 3) of a small GPT's parameters, laid out as
    the wrapper lays them (reverse order of use; ZeRO-3: the model's own units)."""
    config = GPTConfig("llama", num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=128, seq_length=8)
    chunk = build_model_chunks(config, RunConfig.build(micro_batch_size=1), single_process_mesh("cpu"))[0]
    numels = [p.numel() for p in reversed(list(chunk.parameters()))]
    buckets = build_layout(numels, bucket_size=sum(numels) // 3, shard_count=dp)
    units = build_unit_layout([[p.numel() for p in unit.params] for unit in chunk.zero3_units()], dp)
    return buckets, units


def draw_zero(out: str, dp: int = 4) -> list[str]:
    """One panel per ZeRO stage: per dp rank, the parameters / gradients / optimizer state it keeps
    across the flat buffer (dark: kept; pale: not kept; bucket or unit edges as lines)."""
    plt = pyplot("tools/plot_parts.py")
    buckets, units = zero_layouts(dp)
    rows = ("parameters", "gradients", "optimizer state")
    kept = {0: (False, False, False), 1: (False, False, True), 2: (False, True, True), 3: (True, True, True)}
    fig, axes = plt.subplots(4, 1, figsize=(10, 7.2))
    titles = []
    for stage, ax in enumerate(axes):
        layout = units if stage == 3 else buckets
        for r in range(dp):
            for i, (row, sharded) in enumerate(zip(rows, kept[stage])):
                y = r * 4 + i
                ax.barh(y, layout.numel, left=0, height=0.8, color=_colour(i), alpha=0.15 if sharded else 0.9)
                for bucket in layout.buckets if sharded else ():
                    start, end = bucket.owned(r)
                    ax.barh(y, end - start, left=start, height=0.8, color=_colour(i))
        for bucket in layout.buckets:
            ax.axvline(bucket.start, color="black", linewidth=0.6)
        shard = sum(b.chunk_numel for b in layout.buckets)
        held = [shard if s else layout.numel for s in kept[stage]]
        what = "units" if stage == 3 else "buckets"
        owner = "each all-reduced whole" if stage == 0 else "rank r owns chunk r of each"
        title = (f"ZeRO {stage}: each rank keeps {held[0]} / {held[1]} / {held[2]} of {layout.numel} elements "
                 f"(parameters / gradients / optimizer state; {len(layout.buckets)} {what}, {owner})")
        titles.append(f"ZeRO {stage}")
        ax.set_title(title, fontsize=8)
        ax.set_yticks([r * 4 + 1 for r in range(dp)], [f"dp rank {r}" for r in range(dp)], fontsize=7)
        ax.set_ylim(dp * 4 - 0.5, -0.6)
        ax.set_xlim(0, layout.numel)
        ax.tick_params(axis="x", labelsize=7)
    from matplotlib.patches import Patch  # matplotlib is the optional [plot] extra: after pyplot()'s check
    axes[-1].set_xlabel("position in the flat buffer (elements; ZeRO 0-2: parameters in reverse order of use, ZeRO 3: "
                        "its units in forward order)", fontsize=8)
    fig.legend(handles=[Patch(color=_colour(i), label=row) for i, row in enumerate(rows)], loc="lower center",
               ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return titles


# ------------------------------------------------------------------------------------------ context parallel

def draw_context_parallel(out: str, cp: int = 4) -> list[str]:
    """The sequence in 2*cp chunks coloured by owner; the causal blocks each rank computes (ring step
    written in); the causal work per rank, zigzag against contiguous."""
    plt = pyplot("tools/plot_parts.py")
    chunks = 2 * cp
    owner = {c: r for r in range(cp) for c in chunk_ids(r, cp)}
    fig = plt.figure(figsize=(10, 4.6))
    grid = fig.add_gridspec(2, 2, height_ratios=(1, 5), width_ratios=(3, 2))
    seq, blocks, work = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[:, 1])
    for c in range(chunks):
        seq.add_patch(plt.Rectangle((c, 0), 0.95, 1, color=_colour(owner[c])))
        seq.text(c + 0.47, 0.5, f"chunk {c}\nrank {owner[c]}", ha="center", va="center", color="white", fontsize=7)
    seq.set_xlim(0, chunks)
    seq.set_ylim(0, 1)
    seq.axis("off")
    titles = [f"the sequence in 2*cp = {chunks} chunks: rank i keeps chunks i and {chunks - 1}-i"]
    seq.set_title(titles[0], fontsize=9)
    for r in range(cp):  # each rank's queries against the K/V held at each ring step
        for step in range(cp):
            for kv in chunk_ids(ring_source(r, step, cp), cp):
                for q in chunk_ids(r, cp):
                    kind = block_kind(q, kv)
                    if kind == FULL or kind == DIAGONAL:
                        corner = [(kv, q), (kv + 1, q + 1), (kv, q + 1)] if kind == DIAGONAL else None
                        patch = plt.Polygon(corner, color=_colour(r)) if corner else \
                            plt.Rectangle((kv, q), 0.96, 0.96, color=_colour(r))
                        blocks.add_patch(patch)
                        blocks.text(kv + 0.3 if corner else kv + 0.48, q + (0.72 if corner else 0.5), f"s{step}",
                                    ha="center", va="center", color="white", fontsize=7)
    blocks.set_xlim(0, chunks)
    blocks.set_ylim(chunks, 0)
    blocks.set_xticks([c + 0.5 for c in range(chunks)], range(chunks), fontsize=7)
    blocks.set_yticks([c + 0.5 for c in range(chunks)], range(chunks), fontsize=7)
    blocks.set_xlabel("key / value chunk", fontsize=8)
    blocks.set_ylabel("query chunk", fontsize=8)
    titles.append("causal blocks, coloured by the rank computing them (sN: ring step; blank: skipped)")
    blocks.set_title(titles[-1], fontsize=9)
    for offset, layout in ((-0.2, "zigzag"), (0.2, "contiguous")):
        loads = [causal_work(rank_block_counts(r, cp, layout)) for r in range(cp)]
        work.bar([r + offset for r in range(cp)], loads, width=0.38, label=layout,
                 color=[_colour(r) for r in range(cp)], alpha=1.0 if layout == "zigzag" else 0.35)
    work.set_xticks(range(cp), [f"rank {r}" for r in range(cp)], fontsize=7)
    work.set_ylabel("attention work (chunk x chunk blocks, a diagonal 1/2)", fontsize=8)
    work.legend(fontsize=8, frameon=False)
    titles.append("causal work per rank: zigzag (solid) equal,\ncontiguous (pale) not")
    work.set_title(titles[-1], fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return titles


# ------------------------------------------------------------------------------------------ MoE

def moe_routes(ep: int = 2, experts: int = 4, tokens: int = 6, topk: int = 2, seed: int = 3):
    """Per ep rank: its tokens' top-k experts [T, k] and permute_tokens' (token of each row, expert of
    each row, group sizes [E]) for router logits drawn from `seed`."""
    generator, out = torch.Generator().manual_seed(seed), []
    for _ in range(ep):
        ids = top_k_deterministic(torch.randn(tokens, experts, generator=generator), topk)
        token_index = torch.arange(tokens, dtype=torch.float32).unsqueeze(1)  # [T, 1]: each row says its token
        permuted, sorted_index, sizes = ops.permute_tokens(token_index, ids, experts)
        row_expert = ids.reshape(-1)[sorted_index]
        out.append((ids, permuted[:, 0].long().tolist(), row_expert.tolist(), sizes.tolist()))
    return out


def draw_moe(out: str, ep: int = 2, experts: int = 4, tokens: int = 6, topk: int = 2) -> list[str]:
    """Routing, permutation by expert, the all-to-all's counts and each rank's received rows."""
    plt = pyplot("tools/plot_parts.py")
    routes, local = moe_routes(ep, experts, tokens, topk), experts // ep
    fig, axes = plt.subplots(4, 1, figsize=(10, 6.6), gridspec_kw={"height_ratios": (2.2, 1, 1, 1)})
    titles = [f"router: each token's top-{topk} of {experts} experts (ep {ep}: rank r holds experts "
              f"{local}r..{local}r+{local - 1})",
              "each rank permutes its routes by expert: the rows for each ep rank are contiguous",
              "all-to-all: routes sent by each rank to each ep rank (the counts exchanged first)",
              "received, regrouped expert-major: each local expert's rows together for its grouped GEMM"]
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9)
        ax.axis("off")
    for r, (ids, row_token, row_expert, sizes) in enumerate(routes):  # panel 1: token x expert marks
        for t in range(tokens):
            for e in range(experts):
                chosen = e in ids[t].tolist()
                axes[0].add_patch(plt.Rectangle((r * (experts + 1.5) + e, t * 0.3), 0.9, 0.26,
                                                color=_colour(e) if chosen else "#eeeeee"))
        left = r * (experts + 1.5)
        axes[0].text(left + experts / 2, -0.45, f"ep rank {r}'s tokens", ha="center", fontsize=7)
        for e in range(experts):
            axes[0].text(left + e + 0.45, -0.12, f"e{e} (rank {e // local})", ha="center", fontsize=6)
        for t in range(tokens):
            axes[0].text(left - 0.1, t * 0.3 + 0.13, f"t{t}", ha="right", va="center", fontsize=6)
        _rows(axes[1], r, [(f"t{t}→e{e}", e) for t, e in zip(row_token, row_expert)], tokens * topk)
    axes[0].set_xlim(-0.5, ep * (experts + 1.5))
    axes[0].set_ylim(tokens * 0.3 + 0.1, -0.7)
    counts = [[sum(routes[s][3][d * local:(d + 1) * local]) for d in range(ep)] for s in range(ep)]
    for s in range(ep):
        for d in range(ep):
            axes[2].add_patch(plt.Rectangle((s * (ep + 1.5) + d, 0), 0.9, 0.8, color=RANK_COLOURS[-1 - d]))
            axes[2].text(s * (ep + 1.5) + d + 0.45, 0.4, f"{counts[s][d]} to {d}", ha="center", va="center",
                         color="white", fontsize=7)
        axes[2].text(s * (ep + 1.5) + ep / 2, -0.3, f"from rank {s}", ha="center", fontsize=7)
    axes[2].set_xlim(-0.5, ep * (ep + 1.5) * 2)
    axes[2].set_ylim(1, -0.6)
    for d in range(ep):  # panel 4: rows of expert e from every source, in expert-major order
        received = [(f"t{t}→e{e}\nfrom {s}", e) for e in range(d * local, (d + 1) * local) for s in range(ep)
                    for t, row_e in zip(routes[s][1], routes[s][2]) if row_e == e]
        _rows(axes[3], d, received, 2 * tokens * topk)
    for ax in axes[1], axes[3]:
        ax.set_ylim(ep, -0.2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return titles


def _rows(ax, rank: int, rows: list[tuple[str, int]], width: int) -> None:
    """One line of labelled row boxes (colour: the row's expert) for ep rank `rank`."""
    from matplotlib.patches import Rectangle  # matplotlib is the optional [plot] extra: after pyplot()'s check

    for i, (label, expert) in enumerate(rows):
        ax.add_patch(Rectangle((i, rank), 0.94, 0.8, color=_colour(expert)))
        ax.text(i + 0.47, rank + 0.4, label, ha="center", va="center", color="white", fontsize=5.5)
    ax.text(-0.3, rank + 0.4, f"rank {rank}", ha="right", va="center", fontsize=7)
    ax.set_xlim(-2.2, max(width, len(rows), ax.get_xlim()[1]))


# ------------------------------------------------------------------------------------------ tensor parallel

TP_PANELS = {"word_embeddings.weight": "embedding: vocabulary rows split", "layers.0.input_norm.weight":
             "norm weight: whole on every rank", "layers.0.attention.qkv.weight": "qkv: column-parallel, [Q; K; V] "
             "each split", "layers.0.attention.proj.weight": "proj: row-parallel (input columns split)",
             "layers.0.mlp.fc1.weight": "fc1: column-parallel, [gate; up] each split",
             "layers.0.mlp.fc2.weight": "fc2: row-parallel (input columns split)",
             "output_weight": "output layer: vocabulary rows split"}
BLOCK_NAMES = {"layers.0.attention.qkv.weight": ("Q", "K", "V"), "layers.0.mlp.fc1.weight": ("gate", "up")}


def tensor_parallel_specs(tp: int = 2, names=tuple(TP_PANELS)) -> dict:
    """{name: [ShardSpec of each tp rank]} of a small llama's declared parameters (megalite.parameters.params), at `tp`,
    in model order (`names`: which; None: all)."""
    config = GPTConfig("llama", num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       vocab_size=256, seq_length=8)  # (a vocabulary already a multiple of 128 * tp: no padding)
    chunk = build_model_chunks(config, RunConfig.build(micro_batch_size=1), single_process_mesh("cpu"))[0]
    params = dict(chunk.named_parameters())
    return {name: [replace(shard_spec(params[name]), tp_size=tp, tp_rank=r) for r in range(tp)]
            for name in (names or params)}


def draw_tensor_parallel(out: str, tp: int = 2) -> list[str]:
    """Each weight of a block (and the embedding, output layer) as its full tensor, every part coloured by
    the tp rank holding it (its ShardSpec's pieces), fused blocks outlined."""
    plt = pyplot("tools/plot_parts.py")
    specs = tensor_parallel_specs(tp)
    fig, axes = plt.subplots(1, len(specs), figsize=(12, 3.6))
    titles = []
    for ax, (name, ranks) in zip(axes, specs.items()):
        rows, cols = ranks[0].full_shape if len(ranks[0].full_shape) == 2 else (1, ranks[0].full_shape[0])
        dim = ranks[0].dim if len(ranks[0].full_shape) == 2 else (None if ranks[0].dim is None else 1)
        if dim is None:
            ax.add_patch(plt.Rectangle((0, 0), cols, rows, facecolor="#bbbbbb", hatch="//", edgecolor="white"))
        for r, spec in enumerate(ranks if dim is not None else ()):
            for _, start, length in spec.pieces():
                box = (0, start, cols, length) if dim == 0 else (start, 0, length, rows)
                ax.add_patch(plt.Rectangle(box[:2], box[2], box[3], color=_colour(r)))
        start = 0
        for block, label in zip(ranks[0].blocks or (), BLOCK_NAMES.get(name, ())):
            ax.add_patch(plt.Rectangle((0, start), cols, block, fill=False, edgecolor="black", linewidth=1.2))
            ax.text(cols / 2, start + block / 2, label, ha="center", va="center", color="white", fontsize=9)
            start += block
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_xlabel(f"[{', '.join(map(str, ranks[0].full_shape))}]", fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])
        titles.append(TP_PANELS[name])
        ax.set_title(titles[-1].replace(": ", ":\n").replace(", [", ",\n["), fontsize=7)
    from matplotlib.patches import Patch  # matplotlib is the optional [plot] extra: after pyplot()'s check
    fig.legend(handles=[Patch(color=_colour(r), label=f"tp rank {r}") for r in range(tp)]
               + [Patch(facecolor="#bbbbbb", hatch="//", label="every tp rank")], loc="lower center", ncol=tp + 1,
               fontsize=8, frameon=False)
    fig.suptitle(f"the full (layout-free) tensors at tp {tp}, each part coloured by the rank holding it", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return titles


# ------------------------------------------------------------------------------------------ checkpoints

CKPT_PARAM = "layers.0.attention.qkv.weight"


def optimizer_boxes(tp: int, dp: int, name: str = CKPT_PARAM) -> dict[tuple[int, int], list]:
    """{(tp rank, dp rank): the full-tensor boxes of `name` whose optimizer state that rank holds} at ZeRO 1:
    the wrapper's buckets over the tp shard's parameters (reverse order of use; one parameter each, as a large
    model's are), each rank's owned flat range
    of the parameter cut into boxes (megalite.checkpoint.boxes.shard_boxes)."""
    specs = tensor_parallel_specs(tp, names=None)
    names = list(reversed(list(specs)))
    out = {}
    for t in range(tp):
        local = [specs[n][t].local_shape() for n in names]
        # buckets of one parameter each (as for every parameter above --ddp-bucket-size): ZeRO splits it over dp
        layout = build_layout([math.prod(shape) for shape in local], 1, dp)
        for r in range(dp):
            pieces = [p for p in layout.owned_pieces(r) if p.param == names.index(name)]
            out[t, r] = [full for p in pieces for _, full in shard_boxes(specs[name][t], local[names.index(name)],
                                                                         p.local_start, p.local_end)]
    return out


def draw_checkpoint(out: str) -> list[str]:
    """The optimizer state of one weight saved at (tp 2, dp 2, ZeRO 1) as boxes of its full tensor, each
    coloured by its writer, and the boxes readers at (tp 1, dp 3) and (tp 2, dp 1) need, outlined."""
    plt = pyplot("tools/plot_parts.py")
    saved = optimizer_boxes(2, 2)
    shape = tensor_parallel_specs(1, names=(CKPT_PARAM,))[CKPT_PARAM][0].full_shape
    fig, axes = plt.subplots(1, 3, figsize=(10, 4.2))
    titles = [f"saved at tp 2, dp 2, ZeRO 1: {sum(map(len, saved.values()))} boxes, one colour per writer",
              "read at tp 1, dp 3: each reader's boxes (outlined)", "read at tp 2, dp 1: each reader's boxes"]
    for ax, title, readers in zip(axes, titles, (None, optimizer_boxes(1, 3), optimizer_boxes(2, 1))):
        for (t, r), boxes in saved.items():
            for (rows, cols) in boxes:
                ax.add_patch(plt.Rectangle((cols[0], rows[0]), cols[1] - cols[0], rows[1] - rows[0],
                                           color=_colour(t + 2 * r), alpha=1.0 if readers is None else 0.35))
        for i, ((t, r), boxes) in enumerate((readers or {}).items()):
            for (rows, cols) in boxes:
                ax.add_patch(plt.Rectangle((cols[0], rows[0]), cols[1] - cols[0], rows[1] - rows[0], fill=False,
                                           edgecolor="black", linewidth=1.4, linestyle=("-", "--", ":")[i % 3]))
                ax.text((cols[0] + cols[1]) / 2, (rows[0] + rows[1]) / 2, f"t{t}d{r}", ha="center", va="center",
                        fontsize=6)
        ax.set_xlim(0, shape[1])
        ax.set_ylim(shape[0], 0)
        ax.set_title(title.replace(": ", ":\n"), fontsize=8)
        ax.set_xlabel(f"qkv weight [{shape[0]}, {shape[1]}]: columns", fontsize=7)
        ax.tick_params(labelsize=6)
    from matplotlib.patches import Patch  # matplotlib is the optional [plot] extra: after pyplot()'s check
    fig.legend(handles=[Patch(color=_colour(t + 2 * r), label=f"written by tp {t}, dp {r}") for t in range(2)
                        for r in range(2)], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return titles


DRAW = {"layout": draw_layout, "tp": draw_tensor_parallel, "checkpoint": draw_checkpoint, "zero": draw_zero,
        "cp": draw_context_parallel, "moe": draw_moe}


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=PARTS + ("all",), default="all")
    parser.add_argument("--out-dir", default=".", help="where the pictures go (docs/architecture for the pages)")
    parser.add_argument("--format", choices=("png", "svg"), default="png")
    args = parser.parse_args(argv)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    for part in PARTS if args.part == "all" else (args.part,):
        out = Path(args.out_dir) / f"{FILES[part]}.{args.format}"
        panels = DRAW[part](str(out))
        print(f"wrote {out}: {len(panels)} panels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
