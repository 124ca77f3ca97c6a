"""tools/plot_parts.py: the architecture pages' pictures, each drawn from the code's own objects, each a
non-empty image with its panels."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plot_parts", _ROOT / "tools" / "plot_parts.py")
plot_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plot_parts)

PANELS = {  # what each picture's panels say, in order
    "layout": ["tp: 8 groups of 2", "cp: 8 groups of 2", "dp: 8 groups of 2", "pp: 8 groups of 2",
               "dp x cp (gradient reduction): 4 groups of 4", "ep 2 (experts' all-to-all): 8 groups of 2"],
    "tp": ["embedding: vocabulary rows split", "norm weight: whole on every rank", "qkv: column-parallel",
           "proj: row-parallel", "fc1: column-parallel", "fc2: row-parallel", "output layer: vocabulary rows split"],
    "checkpoint": ["saved at tp 2, dp 2, ZeRO 1: 6 boxes", "read at tp 1, dp 3", "read at tp 2, dp 1"],
    "zero": ["ZeRO 0", "ZeRO 1", "ZeRO 2", "ZeRO 3"],
    "cp": ["the sequence in 2*cp = 8 chunks", "causal blocks", "causal work per rank"],
    "moe": ["router: each token's top-2 of 4 experts", "each rank permutes its routes by expert", "all-to-all",
            "received, regrouped expert-major"],
}


def _image_is_drawn(path: pathlib.Path) -> None:
    import matplotlib.image

    pixels = matplotlib.image.imread(str(path))[..., :3].reshape(-1, 3)
    colours = {tuple(p) for p in (pixels * 255).round().astype(int)[::7].tolist()}
    assert path.stat().st_size > 10_000 and len(colours) > 20  # not blank: many colours, boxes and text


@pytest.mark.parametrize("part", plot_parts.PARTS)
def test_each_picture_has_its_panels(part, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / f"{part}.png"
    titles = plot_parts.DRAW[part](str(out))
    assert len(titles) == len(PANELS[part])
    for title, expected in zip(titles, PANELS[part]):
        assert title.startswith(expected), (title, expected)
    _image_is_drawn(out)


def test_the_pictures_are_the_codes_objects():
    from megalite.context_parallel.blocks import causal_work, rank_block_counts

    buckets, units = plot_parts.zero_layouts(dp=4)
    assert len(units.buckets) == 4 and len(buckets.buckets) == 3  # embedding, 2 blocks, head; a third each
    assert buckets.param_numel == units.param_numel  # the same parameters, laid out two ways
    assert all(b.numel % 4 == 0 for b in buckets.buckets + units.buckets)  # padded to dp: rank r owns chunk r
    for ids, row_token, row_expert, sizes in plot_parts.moe_routes():
        assert sum(sizes) == len(row_token) == 12 and row_expert == sorted(row_expert)  # grouped by expert
        assert all(e in ids[t].tolist() for t, e in zip(row_token, row_expert))  # each row one of its routes
    assert {causal_work(rank_block_counts(r, 4)) for r in range(4)} == {8.0}  # the balance the picture shows
    saved, read = plot_parts.optimizer_boxes(2, 2), plot_parts.optimizer_boxes(1, 3)
    for boxes in (saved, read):  # each element of the [64, 32] weight in exactly one box
        cells = [(i, j) for bs in boxes.values() for (rows, cols) in bs for i in range(*rows) for j in range(*cols)]
        assert sorted(cells) == [(i, j) for i in range(64) for j in range(32)]
    assert read[0, 1][0] == ((21, 22), (11, 32))  # reader 1's range (683 of 2049 padded elements) starts mid-row
    qkv = plot_parts.tensor_parallel_specs(tp=2)["layers.0.attention.qkv.weight"]
    assert [spec.pieces() for spec in qkv] == [[(0, 0, 16), (16, 32, 8), (24, 48, 8)],  # Q_0 K_0 V_0
                                                [(0, 16, 16), (16, 40, 8), (24, 56, 8)]]  # Q_1 K_1 V_1


def test_main_writes_every_part_and_the_committed_pictures_stay_small(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert plot_parts.main(["--part", "cp", "--format", "svg", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "cp_zigzag.svg").read_text().lstrip().startswith("<?xml")
    for name in plot_parts.FILES.values():  # what docs/architecture shows
        assert (_ROOT / "docs" / "architecture" / f"{name}.png").stat().st_size < 150_000
