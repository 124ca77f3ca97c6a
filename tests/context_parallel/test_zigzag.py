"""The load-balanced split: chunks, positions, split/gather round trip, and its errors."""
import pytest
import torch

from megalite.context_parallel import (chunk_ids, context_parallel_problems, gather_sequence, position_ids,
                                       split_sequence)


def test_zigzag_chunks_pair_an_early_and_a_late_chunk():
    assert [chunk_ids(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert [chunk_ids(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(r, 2, "contiguous") for r in range(2)] == [(0, 1), (2, 3)]


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_split_positions_and_gather_round_trip(cp, layout):
    b, s = 3, 8 * cp
    ids = torch.arange(b * s).reshape(b, s)  # ids[:, t] - ids[:, 0] == t: the tokens carry their position
    shards = [split_sequence(ids, r, cp, layout=layout) for r in range(cp)]
    for r, shard in enumerate(shards):
        assert shard.shape == (b, s // cp)
        assert torch.equal(shard[0], position_ids(s, r, cp, layout))  # positions are the global ones
        assert torch.all(shard[:, 1:] > shard[:, :-1]), "positions increase along a local sequence"
    assert torch.equal(torch.sort(torch.cat(shards, dim=1)).values, ids), "the shards partition the sequence"
    assert torch.equal(gather_sequence(shards, layout=layout), ids)
    hidden = torch.randn(s, b, 5)  # [s, b, h] split along dim 0
    assert torch.equal(gather_sequence([split_sequence(hidden, r, cp, dim=0, layout=layout) for r in range(cp)],
                                       dim=0, layout=layout), hidden)


def test_zigzag_example_from_the_docstring():
    ids = torch.arange(8).unsqueeze(0)
    assert split_sequence(ids, 0, 2).tolist() == [[0, 1, 6, 7]]
    assert split_sequence(ids, 1, 2).tolist() == [[2, 3, 4, 5]]


def test_bad_lengths_and_layouts_name_the_fix():
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by 2\\*cp = 8"):
        split_sequence(torch.zeros(1, 12), 0, 4)
    with pytest.raises(ValueError, match="unknown context-parallel layout 'stripes'"):
        chunk_ids(0, 2, "stripes")
    with pytest.raises(ValueError, match="cp_rank 2 outside"):
        chunk_ids(2, 2)


def test_preflight_problems_name_the_fix():
    ok = dict(num_attention_heads=8, num_query_groups=4)
    assert context_parallel_problems(64, 1, "nonsense", **ok) == [], "cp = 1 needs nothing"
    assert context_parallel_problems(64, 4, "p2p", tp=2, sequence_parallel=True, **ok) == []
    [msg] = context_parallel_problems(60, 4, "p2p", **ok)
    assert "seq_length=60 is not divisible by 2*cp = 8" in msg and "multiple of 8" in msg
    [msg] = context_parallel_problems(20, 2, "p2p", tp=4, sequence_parallel=True, **ok)
    assert "10 tokens (seq_length/cp) are not divisible by tp=4" in msg and "multiple of 8" in msg
    [msg] = context_parallel_problems(64, 2, "a2a", num_attention_heads=8, num_query_groups=2, tp=2)
    assert "num_query_groups/tp = 2/2 = 1 is not divisible by cp=2" in msg and "--cp-comm-type p2p" in msg
    [msg] = context_parallel_problems(64, 4, "a2a", num_attention_heads=6, num_query_groups=6)
    assert "num_attention_heads/tp = 6/1 = 6 is not divisible by cp=4; choose cp in [1, 2, 3, 6]" in msg
    [msg] = context_parallel_problems(64, 2, "p2p", attention_dropout=0.1, **ok)
    assert "attention_dropout=0.1 is not supported by ring attention" in msg
    assert context_parallel_problems(64, 2, "a2a", attention_dropout=0.1, **ok) == []
    [msg] = context_parallel_problems(64, 2, "ring", **ok)
    assert "--cp-comm-type 'ring' is not one of ('p2p', 'a2a')" in msg


def test_logical_row_offsets_map_local_rows_to_the_whole_sequence():
    from megalite.context_parallel.zigzag import logical_row_offsets

    s, cp, row = 16, 2, 10  # chunks of 4 rows; rank 1 holds chunks 1 and 2 = rows 4..11
    assert logical_row_offsets(8, row, 0, 1, 0, 1) == 0                             # cp = 1, no SP
    assert logical_row_offsets(4, row, 1, 2, 0, 1) == 4 * row                       # cp = 1, SP shard 1
    assert logical_row_offsets(8, row, 0, 1, 1, cp) == [(0, 4 * row, 4), (4, 8 * row, 4)]  # both chunks
    assert logical_row_offsets(4, row, 0, 2, 0, cp) == 0                            # SP shard 0: chunk 0
    assert logical_row_offsets(4, row, 1, 2, 0, cp) == 12 * row                     # SP shard 1: chunk 3
    assert logical_row_offsets(2, row, 1, 4, 0, cp) == 2 * row                      # shard inside chunk 0
    rows = [[r for start, off, n in (offs if isinstance(offs, list) else [(0, offs, 8)]) for r in
             range(off // row, off // row + n)] for offs in (logical_row_offsets(8, row, 0, 1, k, cp) for k in range(cp))]
    assert sorted(rows[0] + rows[1]) == list(range(s))  # together the ranks cover every row once
