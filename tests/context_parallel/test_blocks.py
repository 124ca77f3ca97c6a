"""The ring's block plan and the causal work per rank: equal under zigzag, not under a plain split."""
import pytest

from megalite.context_parallel.blocks import (DIAGONAL, FULL, SKIP, BlockCall, block_kind, causal_work,
                                              rank_block_counts, ring_plan, step_calls)


def test_block_kinds():
    assert (block_kind(3, 1), block_kind(2, 2), block_kind(1, 3)) == (FULL, DIAGONAL, SKIP)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_balances_causal_work_and_a_plain_split_does_not(cp):
    zigzag = [rank_block_counts(r, cp) for r in range(cp)]
    # every rank: 2 diagonal blocks and 2cp - 1 full ones, out of 4cp pairs
    assert zigzag == [{FULL: 2 * cp - 1, DIAGONAL: 2, SKIP: 2 * cp - 1}] * cp
    plain = [causal_work(rank_block_counts(r, cp, "contiguous")) for r in range(cp)]
    assert plain == [4 * r + 2 for r in range(cp)], "rank r of a contiguous split does 4r + 2 units"
    assert max(plain) / min(plain) == 2 * cp - 1
    total = (2 * cp) ** 2 / 2  # the causal triangle of 2cp x 2cp chunks
    assert sum(causal_work(c) for c in zigzag) == sum(plain) == total


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_plan_computes_exactly_the_counted_blocks(cp, layout):
    for rank in range(cp):
        plan = ring_plan(rank, cp, layout)
        assert len(plan) == cp and plan[0] == [BlockCall(0, 2, 0, 2, causal=True)], "step 0: own K/V, diagonal"
        assert sum(call.work() for step in plan for call in step) == causal_work(rank_block_counts(rank, cp, layout))
        assert not any(call.causal for step in plan[1:] for call in step), "only a rank's own K/V has a diagonal"


def test_step_calls_merge_query_chunks_that_see_the_same_keys():
    # zigzag cp=2, rank 1 (chunks 1, 2) holding rank 0's K/V (chunks 0, 3): both see chunk 0 only
    assert step_calls((1, 2), (0, 3)) == [BlockCall(0, 2, 0, 1, False)]
    # rank 0 (chunks 0, 3) holding rank 1's (1, 2): chunk 3 sees both, chunk 0 neither
    assert step_calls((0, 3), (1, 2)) == [BlockCall(1, 2, 0, 2, False)]
    assert step_calls((0, 1), (2, 3)) == []
    with pytest.raises(ValueError, match="only a rank's own, increasing chunks"):
        step_calls((3, 0), (3, 0))
