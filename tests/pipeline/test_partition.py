import pytest

from megalite.pipeline.partition import chunk_layer_counts, stage_layers


def test_even_split_and_interleaved_assignment():
    # 8 layers, pp=2, v=2: model chunks of 2 layers; rank 0 holds model chunks 0 and 2.
    assert stage_layers(8, 2, 2, 0) == [range(0, 2), range(4, 6)]
    assert stage_layers(8, 2, 2, 1) == [range(2, 4), range(6, 8)]
    assert stage_layers(12, 4, 1, 3) == [range(9, 12)]
    assert stage_layers(5, 1, 1, 0) == [range(0, 5)]


def test_every_layer_exactly_once():
    for num_layers, pp, v, first, last in [(24, 4, 2, None, None), (10, 4, 1, 1, 3), (14, 4, 2, 0, 2),
                                           (9, 3, 1, 1, None), (7, 2, 1, None, 3)]:
        held = [i for r in range(pp) for chunk in stage_layers(num_layers, pp, v, r, first, last) for i in chunk]
        assert sorted(held) == list(range(num_layers))


def test_first_and_last_stage_layers():
    assert chunk_layer_counts(10, 4, 1, first=1, last=3) == [1, 3, 3, 3]
    assert chunk_layer_counts(14, 4, 2, first=0, last=2) == [0, 2, 2, 2, 2, 2, 2, 2]
    assert chunk_layer_counts(7, 2, 1, first=None, last=3) == [4, 3]
    assert chunk_layer_counts(5, 2, 1, first=2, last=3) == [2, 3]
    assert stage_layers(10, 4, 1, 0, first=1, last=3) == [range(0, 1)]
    assert stage_layers(10, 4, 1, 1, first=1, last=3) == [range(1, 4)]


def test_layout_string():
    assert chunk_layer_counts(16, 4, 1, layout="3,5,5,3") == [3, 5, 5, 3]
    assert stage_layers(16, 2, 2, 1, layout=[3, 5, 5, 3]) == [range(3, 8), range(13, 16)]


@pytest.mark.parametrize("args, match", [
    (dict(num_layers=3, pp=4), "cannot fill pp\\*v = 4\\*1 = 4"),
    (dict(num_layers=7, pp=2, v=4, pp_rank=0), "cannot fill"),
    (dict(num_layers=10, pp=4), "not divisible by pp\\*v.*decoder-first-stage-layers"),
    (dict(num_layers=10, pp=4, first=1, last=2), "7 layers remain for 2 pipeline chunks"),
    (dict(num_layers=4, pp=4, first=2, last=2), "remain for 2 pipeline chunks"),
    (dict(num_layers=4, pp=1, first=2), "at least two pipeline chunks"),
    (dict(num_layers=4, pp=2, first=-1), "non-negative"),
    (dict(num_layers=8, pp=2, layout="3,4"), "sums to 7"),
    (dict(num_layers=8, pp=2, layout="2,3,3"), "needs pp\\*v = 2\\*1 = 2"),
    (dict(num_layers=8, pp=2, v=2, layout="4,0,0,4"), "only the first and last"),
    (dict(num_layers=8, pp=2, layout="4,x"), "comma-separated"),
    (dict(num_layers=8, pp=2, layout="4,4", first=1), "either a pipeline layout"),
    (dict(num_layers=8, pp=0), "pp must be a positive integer"),
    (dict(num_layers=8, pp=2, pp_rank=2), "outside a pipeline of 2"),
])
def test_bad_partitions_are_rejected(args, match):
    args = dict(dict(v=1, pp_rank=0), **args)
    with pytest.raises(ValueError, match=match):
        stage_layers(args.pop("num_layers"), args.pop("pp"), args.pop("v"), args.pop("pp_rank"), **args)


def test_check_pipeline_config_names_the_fix():
    from megalite.pipeline import check_pipeline_config

    check_pipeline_config("interleaved", 16, 4, 8, v=2)
    check_pipeline_config("1f1b", 10, 4, 8, first=1, last=3)
    with pytest.raises(ValueError, match="cannot fill"):
        check_pipeline_config("1f1b", 3, 4, 8)
    with pytest.raises(ValueError, match="not divisible by pp\\*v"):
        check_pipeline_config("1f1b", 10, 4, 8)
    with pytest.raises(ValueError, match="multiple of pp"):
        check_pipeline_config("interleaved", 16, 4, 6, v=2)
