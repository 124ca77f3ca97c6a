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

The tp, zero and checkpoint pictures (what each rank holds of the model's state) are drawn in
tools/plot_parts_state.py. PNG or SVG by the suffix (--format); needs matplotlib (pip install 'megalite[plot]').
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, however this file is loaded
from plot_parts_state import (RANK_COLOURS, colour, draw_checkpoint, draw_tensor_parallel, draw_zero,  # noqa: E402
                              optimizer_boxes, tensor_parallel_specs, zero_layouts)  # noqa: F401  (the tests reach these here)

from megalite import ops  # noqa: E402
from megalite.distributed import topology  # noqa: E402
from megalite.cli import OneLineParser  # noqa: E402
from megalite.context_parallel.blocks import (DIAGONAL, FULL, block_kind, causal_work, rank_block_counts,  # noqa: E402
                                              ring_source)
from megalite.context_parallel.zigzag import chunk_ids  # noqa: E402
from megalite.errors import reports_usage_errors  # noqa: E402
from megalite.extras import pyplot  # noqa: E402
from megalite.moe.router import top_k_deterministic  # noqa: E402

PARTS = ("layout", "tp", "zero", "cp", "moe", "checkpoint")
FILES = {"layout": "layout_groups", "tp": "tp_shards", "zero": "zero_stages", "cp": "cp_zigzag", "moe": "moe_dispatch",
         "checkpoint": "checkpoint_boxes"}


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
            ax.add_patch(plt.Rectangle((column, stage), 0.94, 0.9, color=colour(g)))
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
        seq.add_patch(plt.Rectangle((c, 0), 0.95, 1, color=colour(owner[c])))
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
                        patch = plt.Polygon(corner, color=colour(r)) if corner else \
                            plt.Rectangle((kv, q), 0.96, 0.96, color=colour(r))
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
                 color=[colour(r) for r in range(cp)], alpha=1.0 if layout == "zigzag" else 0.35)
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
                                                color=colour(e) if chosen else "#eeeeee"))
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
        ax.add_patch(Rectangle((i, rank), 0.94, 0.8, color=colour(expert)))
        ax.text(i + 0.47, rank + 0.4, label, ha="center", va="center", color="white", fontsize=5.5)
    ax.text(-0.3, rank + 0.4, f"rank {rank}", ha="right", va="center", fontsize=7)
    ax.set_xlim(-2.2, max(width, len(rows), ax.get_xlim()[1]))


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
