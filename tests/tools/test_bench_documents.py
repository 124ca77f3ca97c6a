"""tools/bench_documents.py's arithmetic: the documents it draws fill the sequence, and the share of
causal tiles the varlen kernels visit is 1 for one document and falls with shorter ones."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import bench_documents  # noqa: E402


def test_documents_fill_the_sequence_and_the_visited_tiles_shrink():
    lengths = bench_documents.document_lengths(8192, 512, seed=0)
    assert sum(lengths) == 8192 and min(lengths) >= 1 and len(lengths) > 4
    one = bench_documents.visited_tile_share([0] * 8192, 128, 64)
    assert one == 1.0
    key_start = []
    for n in lengths:
        key_start += [len(key_start)] * n
    share = bench_documents.visited_tile_share(key_start, 128, 64)
    squares = sum(n * n for n in lengths) / 8192 ** 2
    assert squares < share < 0.5  # the kernels do about Σ len^2 work, plus the edge tiles
