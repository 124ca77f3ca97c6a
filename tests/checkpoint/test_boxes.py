"""Box arithmetic: flat ranges and tp shards map onto the full tensor exactly once."""
import math

import torch

from megalite.checkpoint.boxes import box_slices, flat_range_boxes, shard_boxes
from megalite.parameters.sharding import ShardSpec


def test_flat_range_boxes_cover_the_range_in_order():
    for shape in [(7,), (3, 4), (2, 3, 5)]:
        numel = math.prod(shape)
        flat = torch.arange(numel).view(shape)
        for start in range(numel):
            for end in range(start, numel + 1):
                boxes = flat_range_boxes(shape, start, end)
                got = torch.cat([flat[box_slices(b)].reshape(-1) for b in boxes]) if boxes else torch.zeros(0)
                assert got.tolist() == list(range(start, end)), (shape, start, end, boxes)
                assert len(boxes) <= 2 * len(shape) - 1


def test_shard_boxes_place_every_element_of_fused_padded_shards():
    # [Q; K; V] fused blocks of sizes (8, 4, 4) split over tp=2; a padded vocab dim; a row-parallel dim 1.
    cases = [ShardSpec((16, 3), 0, r, 2, blocks=(8, 4, 4)) for r in range(2)]
    cases += [ShardSpec((10, 3), 0, r, 4, padded_size=12) for r in range(4)]
    cases += [ShardSpec((3, 8), 1, r, 2) for r in range(2)] + [ShardSpec((5,))]
    for spec in cases:
        full = torch.arange(math.prod(spec.full_shape)).view(spec.full_shape)
        local = spec.shard(full)
        numel = local.numel()
        for start, end in [(0, numel), (1, numel - 2), (numel // 3, numel // 3 + 4)]:
            for local_box, full_box in shard_boxes(spec, tuple(local.shape), start, end):
                assert torch.equal(local[box_slices(local_box)], full[box_slices(full_box)]), (spec, local_box)
        # The whole local tensor covers exactly its logical (unpadded) elements.
        covered = sum(math.prod(b - a for a, b in fb) for _, fb in shard_boxes(spec, tuple(local.shape)))
        logical = sum(length for _, _, length in spec.pieces()) * (math.prod(spec.full_shape) //
                                                                   spec.full_shape[spec.dim or 0])
        assert covered == logical
