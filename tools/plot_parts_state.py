"""The pictures of tools/plot_parts.py that show what each rank holds of the model's state, drawn from the code's
own objects: tp (the rows or columns of each full weight every tp rank holds, from the parameters' declared
ShardSpecs), zero (what each dp rank keeps at ZeRO 0-3, from megalite.data_parallel.layout's buckets and
units) and checkpoint (one weight's optimizer state saved as boxes of the full tensor, and the boxes
readers at other layouts need); and the rank colours every picture shares. Run them from tools/plot_parts.py.
"""
from __future__ import annotations

import math
from dataclasses import replace

from megalite.checkpoint.boxes import shard_boxes
from megalite.config import RunConfig
from megalite.config.model import GPTConfig
from megalite.data_parallel.layout import build_layout, build_unit_layout
from megalite.distributed.mesh import single_process_mesh
from megalite.extras import pyplot
from megalite.parameters.params import shard_spec
from megalite.training.step import build_model_chunks

RANK_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def colour(i: int) -> str:
    return RANK_COLOURS[i % len(RANK_COLOURS)]


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
                ax.barh(y, layout.numel, left=0, height=0.8, color=colour(i), alpha=0.15 if sharded else 0.9)
                for bucket in layout.buckets if sharded else ():
                    start, end = bucket.owned(r)
                    ax.barh(y, end - start, left=start, height=0.8, color=colour(i))
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
    fig.legend(handles=[Patch(color=colour(i), label=row) for i, row in enumerate(rows)], loc="lower center",
               ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return titles


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
                ax.add_patch(plt.Rectangle(box[:2], box[2], box[3], color=colour(r)))
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
    fig.legend(handles=[Patch(color=colour(r), label=f"tp rank {r}") for r in range(tp)]
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
                                           color=colour(t + 2 * r), alpha=1.0 if readers is None else 0.35))
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
    fig.legend(handles=[Patch(color=colour(t + 2 * r), label=f"written by tp {t}, dp {r}") for t in range(2)
                        for r in range(2)], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return titles
