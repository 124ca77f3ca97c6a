"""The layout (megalite/layout.py): every rule between the parallel sizes, met with the same line by
the configuration check, init_mesh, the planner's pre-flight and --simulate; a dense model gets no
expert groups."""
import itertools
import re

import pytest

from megalite.distributed import comm
from megalite.commands import main as command_line
from megalite.config import RunConfig
from megalite.layout import Layout, LayoutError
from megalite.distributed.mesh import destroy_mesh, init_mesh
from megalite.plan.validity import preflight
from megalite.simulate.ranks import expected_groups
from megalite.testing import run_distributed

SIZES = dict(tp=(1, 2, 4), cp=(1, 2), dp=(1, 2, 3), pp=(1, 2), vp=(1, 2), ep=(1, 2, 4), etp=(1, 2, 3),
             num_experts=(0, 4, 6))


def _rule(message: str) -> str:
    """A message with its numbers masked: which rule it states."""
    return re.sub(r"\[[^]]*\]|\d+", "N", message)


def _bad_layouts(per_rule: int = 2) -> list[tuple[dict, str]]:
    """(sizes, the layout's line) for the first `per_rule` layouts breaking each rule between the sizes,
    in a fixed order over every combination of SIZES."""
    found: dict[str, list] = {}
    for values in itertools.product(*SIZES.values()):
        sizes = dict(zip(SIZES, values))
        try:
            Layout(**sizes)
        except LayoutError as exc:
            cases = found.setdefault(_rule(str(exc)), [])
            if len(cases) < per_rule:
                cases.append((sizes, str(exc)))
    return [case for cases in found.values() for case in cases]


BAD = _bad_layouts()


def test_the_generator_meets_every_rule_between_the_sizes():
    rules = {_rule(message).split(" ")[0] + " " + _rule(message).split(" ")[2] for _, message in BAD}
    assert len({_rule(m) for _, m in BAD}) == 5, sorted({_rule(m) for _, m in BAD})
    assert {"--virtual-stages needs", "--ep shards", "--ep does", "--num-experts is", "--etp must"} == rules, rules


def _flags(sizes: dict) -> list[str]:
    model = ["--model", "moe-tiny", "--num-experts", str(sizes["num_experts"])] if sizes["num_experts"] else []
    return model + ["--tp", str(sizes["tp"]), "--cp", str(sizes["cp"]), "--dp", str(sizes["dp"]),
                    "--pp", str(sizes["pp"]), "--virtual-stages", str(sizes["vp"]), "--ep", str(sizes["ep"]),
                    "--etp", str(sizes["etp"]), "--seq-length", "64", "--global-batch-size", "96"]


@pytest.mark.parametrize("sizes,line", BAD, ids=[_rule(m)[:24] + str(i) for i, (_, m) in enumerate(BAD)])
def test_every_place_refuses_a_bad_layout_with_the_same_line(sizes, line, monkeypatch, capsys):
    settings = dict(model="moe-tiny" if sizes["num_experts"] else "tiny", seq_length=64, global_batch_size=96,
                    virtual_stages=sizes["vp"], **{k: sizes[k] for k in ("tp", "cp", "dp", "pp", "ep", "etp")})
    cfg = RunConfig.build(**settings, **({"num_experts": sizes["num_experts"]} if sizes["num_experts"] else {}))
    world = sizes["tp"] * sizes["cp"] * sizes["dp"] * sizes["pp"]
    assert line in cfg.validate()  # the configuration check
    assert preflight(cfg.gpt_config(), cfg, world)[0] == line  # the planner
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    if sizes["vp"] == 1:  # (the mesh takes no virtual stages)
        with pytest.raises(LayoutError) as refused:
            init_mesh(**{k: v for k, v in sizes.items() if k != "vp"})
        assert str(refused.value) == line and not comm.is_initialized()
    monkeypatch.delenv("WORLD_SIZE")
    assert command_line(_flags(sizes) + ["--simulate"]) == 2
    assert f"megalite: configuration error: {line}\n" in capsys.readouterr().err


def test_the_world_size_is_refused_alike_by_init_mesh_and_the_planner(monkeypatch):
    cfg = RunConfig.build(tp=2, pp=2, dp=4)
    line = "world size 8 != tp*pp*dp = 2*2*4 = 16; launch 16 processes (torchrun --nproc_per_node ...) or change " \
           "--tp/--pp/--dp"
    assert preflight(cfg.gpt_config(), cfg, 8)[0] == line
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(LayoutError, match=re.escape(line)):
        init_mesh(tp=2, pp=2, dp=4)
    with pytest.raises(LayoutError, match=re.escape(line)):
        init_mesh(layout=cfg.layout())


@pytest.mark.parametrize("sizes,needle", [
    (dict(world=8, tp=3), "world size 8 is not divisible by tp*pp = 3*1 = 3; launch a multiple of 3"),
    (dict(world=8, tp=2, cp=3), "not divisible by tp*cp*pp = 2*3*1 = 6"),
    (dict(world=8, tp=2, cp=2, dp=4), "world size 8 != tp*cp*pp*dp = 2*2*1*4 = 16"),
    (dict(world=8, tp=0), "--tp must be a positive integer, got 0"),
    (dict(cp=0), "--cp must be a positive integer"),
    (dict(dp=4, dp_shard=3), "--dp-shard 3 does not divide dp = 4 (ZeRO shards over dp-shard ranks and replicates "
                             "across dp/dp-shard of them); choose --dp-shard in [1, 2, 4]"),
    (dict(dp=4, ep=4, num_experts=6), "--num-experts 6 is not divisible by --ep 4; choose --ep in [1, 2]"),
])
def test_each_rule_names_the_fix(sizes, needle):
    with pytest.raises(LayoutError, match=re.escape(needle)):
        Layout(**sizes)


def test_the_defaults_are_stated_once():
    layout = Layout(tp=2, pp=2, world=16)
    assert (layout.dp, layout.dp_shard, layout.dp_replicate, layout.etp, layout.num_experts) == (4, 4, 1, 1, 0)
    assert Layout().world == 1 and Layout(tp=8, dp=2, pp=4).world == 64
    assert Layout(dp=8, dp_shard=2).dp_replicate == 4
    dense = Layout(tp=2, world=2)  # etp 1 (the flag's default) means nothing without experts
    assert not dense.experts_whole and not dense.expert_groups_apart and "edp" not in expected_groups(dense)
    moe = Layout(tp=2, world=2, num_experts=4)
    assert moe.experts_whole and moe.expert_dp == 2 and expected_groups(moe)["edp"] == [[0, 1]]


def _groups_of(num_experts):
    mesh = init_mesh(tp=2, num_experts=num_experts)
    try:
        return comm.group_name(mesh.expert_dp_group), comm.group_name(mesh.moe_token_group), mesh.experts_whole
    finally:
        destroy_mesh()


def test_a_dense_model_gets_no_expert_groups():
    """init_mesh(tp=2) used to build the expert-data-parallel and MoE token groups for a dense model."""
    assert run_distributed(_groups_of, 2, 0) == [("dp", "none", False)] * 2
    assert run_distributed(_groups_of, 2, 4) == [("edp", "tp", True)] * 2
