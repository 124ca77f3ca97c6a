"""Bucket layout arithmetic: bucket boundaries, padding, and owned pieces that tile every parameter."""
import pytest

from megalite.data_parallel.layout import build_layout


@pytest.mark.parametrize("shard_count", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_size", [1, 7, 50, 10 ** 9])
def test_owned_pieces_tile_every_parameter_once(shard_count, bucket_size):
    numels = [5, 12, 1, 30, 7, 7, 2]
    layout = build_layout(numels, bucket_size, shard_count, alone=frozenset({3}))
    assert layout.param_numel == sum(numels)
    assert layout.numel % shard_count == 0 and layout.shard_numel * shard_count == layout.numel
    for bucket in layout.buckets:
        assert bucket.numel % shard_count == 0
        used = sum(numels[i] for i in bucket.params)
        assert bucket.numel - used < shard_count, "padding is at most shard_count - 1 per bucket"
        if 3 in bucket.params:
            assert bucket.params == (3,), "a param marked alone has its own bucket"
        # a bucket closes as soon as it reaches bucket_size (only its last param may overflow it)
        assert sum(numels[i] for i in bucket.params[:-1]) < bucket_size or 3 in bucket.params
    covered = {i: [] for i in range(len(numels))}
    shard_positions = {}
    for rank in range(shard_count):
        pieces = layout.owned_pieces(rank)
        position = [p.shard_start for p in pieces]
        assert position == sorted(position) and all(p.shard_end <= layout.shard_numel for p in pieces)
        for p in pieces:
            covered[p.param].append((p.local_start, p.local_end))
            shard_positions.setdefault(rank, []).append((p.shard_start, p.shard_end))
    for i, ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == numels[i]
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (i, ranges)
    for spans in shard_positions.values():
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "pieces never overlap in a shard"


def test_bucket_contents_follow_the_given_order():
    layout = build_layout([4, 4, 4, 4, 100], bucket_size=8, shard_count=2)
    assert [b.params for b in layout.buckets] == [(0, 1), (2, 3), (4,)]
    assert [s.start for s in layout.slots] == [0, 4, 8, 12, 16]
    assert layout.buckets[1].owned(1) == (12, 16)


def test_bad_bucket_size_is_rejected():
    with pytest.raises(ValueError, match="bucket_size"):
        build_layout([3], bucket_size=0, shard_count=1)
