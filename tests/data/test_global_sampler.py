"""Global sampling: dp ranks split each global batch, resume at another dp, same samples on every layout."""
import pytest

from data_helpers import random_texts, write_byte_dataset
from megalite.data import EvalSampler, GlobalBatchSampler, build_gpt_datasets, collate, eval_indices, \
    load_microbatches


def _steps(dataset_len, gbs, mbs, dp, consumed, steps, seed=0):
    """Per step, the samples of all dp ranks in rank order, flattened."""
    samplers = [iter(GlobalBatchSampler(dataset_len, gbs, mbs, r, dp, consumed, seed)) for r in range(dp)]
    out = []
    for _ in range(steps):
        per_rank = [next(s) for s in samplers]
        for microbatches in per_rank:
            assert len(microbatches) == gbs // (mbs * dp) and all(len(mb) == mbs for mb in microbatches)
        out.append([i for microbatches in per_rank for mb in microbatches for i in mb])
    return out


def test_global_batches_are_contiguous_and_layout_free():
    reference = _steps(100, 12, 1, 1, 0, 8)
    assert reference[0] == list(range(12)) and reference[7][:4] == [84, 85, 86, 87]
    for dp, mbs in ((2, 3), (3, 2), (4, 1), (6, 2), (12, 1)):
        assert _steps(100, 12, mbs, dp, 0, 8) == reference
    # the second epoch (positions 100..199) is a seeded permutation of the dataset, the same at any dp
    long = [i for step in _steps(100, 12, 2, 2, 0, 17) for i in step]
    assert sorted(long[100:200]) == list(range(100)) and long[100:200] != list(range(100))
    assert long == [i for step in _steps(100, 12, 1, 4, 0, 17) for i in step]
    assert long[100:200] != [i for step in _steps(100, 12, 2, 2, 0, 17, seed=1) for i in step][100:200]


def test_resume_mid_epoch_at_another_dp():
    uninterrupted = _steps(50, 8, 2, 2, 0, 12)
    sampler = GlobalBatchSampler(50, 8, 2, 0, 2)
    it = iter(sampler)
    for _ in range(5):
        next(it)
    state = sampler.state_dict()
    assert state == {"consumed_samples": 40}
    resumed = _steps(50, 8, 1, 4, state["consumed_samples"], 7)  # dp 2 -> 4, mbs 2 -> 1
    assert resumed == uninterrupted[5:]
    restored = GlobalBatchSampler(50, 8, 4, 0, 1)
    restored.load_state_dict(state)
    assert [i for mb in next(iter(restored)) for i in mb] == uninterrupted[5]


def test_sampler_validation_errors():
    with pytest.raises(ValueError, match=r"global_batch_size=10 is not divisible by micro_batch_size\*dp=2\*3=6"):
        GlobalBatchSampler(100, 10, 2, 0, 3)
    with pytest.raises(ValueError, match="dp_rank=3 is outside"):
        GlobalBatchSampler(100, 12, 2, 3, 3)
    with pytest.raises(ValueError, match="micro_batch_size must be a positive integer"):
        GlobalBatchSampler(100, 12, 0, 0, 3)
    with pytest.raises(ValueError, match="dataset is empty"):
        GlobalBatchSampler(0, 12, 2, 0, 3)
    with pytest.raises(ValueError, match="consumed_samples"):
        GlobalBatchSampler(10, 12, 2, 0, 3, consumed_samples=-1)


def test_eval_sampling_is_deterministic():
    assert eval_indices(100, 8, 1, 2) == [4, 5, 6, 7]
    assert eval_indices(6, 8, 2, 3) == [4, 5]  # clipped to the dataset
    with pytest.raises(ValueError, match="divisible by dp=3"):
        eval_indices(100, 8, 0, 3)
    ranks = [EvalSampler(30, 5, 8, 2, r, 2) for r in range(2)]
    assert len(ranks[0]) == 3  # only 3 full global batches of 8 fit in 30 samples
    batches = [list(s) for s in ranks]
    assert batches[0] == [[[0, 1], [2, 3]], [[8, 9], [10, 11]], [[16, 17], [18, 19]]]
    assert batches[1][0] == [[4, 5], [6, 7]] and [list(s) for s in ranks] == batches  # repeatable


def _rank_reads(cache_dir, prefix, tp, pp):
    """One rank: build the datasets (all ranks at once, one cache) and read two steps."""
    from megalite.distributed import mesh as mesh_lib

    mesh = mesh_lib.init_mesh(tp=tp, pp=pp)
    train, _, _ = build_gpt_datasets([prefix], "9,1,0", seq_length=8, seed=5, tokenizer="byte",
                                     cache_dir=cache_dir)
    sampler = iter(GlobalBatchSampler(len(train), 8, 2, mesh.dp_rank, mesh.dp_size, consumed_samples=4))
    steps = [load_microbatches(train, next(sampler)) for _ in range(2)]
    # plain lists, not tensors: torch would pass tensor storage back as a file descriptor that
    # dies with this process, racing the parent's read
    return mesh.dp_rank, mesh.tp_rank, mesh.pp_rank, [[mb["input_ids"].tolist() for mb in step] for step in steps]


def test_ranks_of_any_layout_read_the_same_global_batch(tmp_path):
    from megalite.testing import run_distributed

    prefix = str(tmp_path / "d")
    write_byte_dataset(prefix, random_texts(40, seed=3))
    train, _, _ = build_gpt_datasets([prefix], "9,1,0", seq_length=8, seed=5, tokenizer="byte",
                                     cache_dir=str(tmp_path / "single"))
    expected = [collate([train[i] for i in range(4 + 8 * s, 12 + 8 * s)])["input_ids"] for s in range(2)]
    # one world of 8 ranks, tp=2 x pp=2 x dp=2: every (tp_rank, pp_rank) pair must read, across its
    # two dp ranks, exactly the global batch a single process reads
    results = run_distributed(_rank_reads, 8, str(tmp_path / "cache"), prefix, 2, 2)
    assert sorted((r[0], r[1], r[2]) for r in results) == [(d, t, p) for d in range(2) for t in range(2)
                                                            for p in range(2)]
    for step in range(2):
        for tp_rank in range(2):
            for pp_rank in range(2):
                rows = [r[3][step] for r in sorted(results, key=lambda r: r[0])
                        if (r[1], r[2]) == (tp_rank, pp_rank)]
                got = [row for rank_mbs in rows for mb in rank_mbs for row in mb]
                assert got == expected[step].tolist()
