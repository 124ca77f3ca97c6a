"""The planner's decisions: pre-flight errors with their fixes, layout suggestions, the reason line."""
import re

from megalite import plan as P
from megalite.config import RunConfig
from megalite.config.model import preset


def run(num_microbatches: int | None = None, **settings) -> RunConfig:
    """A run's configuration with micro batch 1 unless given; num_microbatches sets the global batch."""
    settings.setdefault("micro_batch_size", 1)
    if num_microbatches is not None:
        settings["global_batch_size"] = settings["micro_batch_size"] * settings.get("dp", 1) * num_microbatches
    return RunConfig.build(**settings)


def test_preflight_names_every_problem_and_its_fix():
    config = preset("llama-7b")
    assert P.preflight(config, run(tp=2, pp=2, dp=2, global_batch_size=16, precision="bf16"), 8) == []
    errors = P.preflight(config, run(tp=3, pp=5, dp=2, global_batch_size=13, sequence_parallel=True), 8)
    text = "\n".join(errors)
    for needle in ("world size 8 != tp*pp*dp", "choose tp in", "not divisible by pp*v", "choose a multiple of 2",
                   "seq_length=4096 is not divisible by tp=3"):
        assert needle in text, (needle, text)
    few = P.preflight(config, run(pp=4, dp=2, global_batch_size=4), 8)
    assert few and "2 microbatches < pp=4" in few[0] and "--global-batch-size >= " in few[0]
    sp_alone = P.preflight(config, run(sequence_parallel=True), 1)
    assert sp_alone and "--tp > 1" in sp_alone[0]
    interleaved = P.preflight(config, run(pp=2, dp=1, virtual_stages=2, num_microbatches=3), 2)
    assert any("multiple of pp" in e for e in interleaved)


def test_preflight_memory_error_names_a_fix_that_works():
    config = preset("llama-7b")
    config, layout = config.replace(seq_length=2048), run(dp=8, precision="bf16", global_batch_size=8)
    errors = P.preflight(config, layout, 8, gpu_memory=80e9)
    assert len(errors) == 1 and "does not fit 80.0 GB" in errors[0]
    assert errors[0].endswith("add --zero 1")
    assert P.preflight(config, layout.replace(zero=1), 8, gpu_memory=80e9) == []


def test_suggest_ranks_layouts_that_fit():
    small = P.suggest(preset("gpt2-124m"), gpus=8, gpu_memory=80e9, top_k=5)
    assert small and (small[0].cfg.parallel.tp, small[0].cfg.parallel.pp) == (1, 1)  # data parallel first
    best = min(s.step_time_s for s in small)  # within 2% of it: lowest ZeRO stage first, then fastest
    order = [(s.step_time_s > 1.02 * best, s.cfg.parallel.zero if s.step_time_s <= 1.02 * best else 0,
              round(s.step_time_s, 4))
             for s in small]
    assert order == sorted(order)
    big = P.suggest(preset("llama-13b"), gpus=8, gpu_memory=40e9, global_batch_size=64, top_k=5)
    assert big
    for s in big:
        assert s.estimate.fits(40e9) and P.preflight(preset("llama-13b"), s.cfg, 8) == []
        assert s.cfg.parallel.zero > 0 or s.cfg.parallel.tp * s.cfg.parallel.pp > 1
        assert "s/step" in s.reason and "/40 GB" in s.reason
    assert P.suggest(preset("llama-70b"), gpus=1, gpu_memory=80e9) == []


def test_justify_is_one_line_naming_the_choices():
    line = P.justify(preset("llama-7b"), run(tp=2, pp=2, dp=2, zero=1, recompute="selective",
                                                 precision="bf16", global_batch_size=16), gpu_memory=80e9,
                     gpus_per_node=8)
    assert "\n" not in line and line.startswith("~") and "s/step on H100-SXM:" in line
    a100 = P.justify(preset("llama-7b"), run(tp=2, pp=2, dp=2, zero=1, recompute="selective", precision="bf16",
                                             global_batch_size=16), gpus_per_node=8, hardware="A100-80GB")
    assert "s/step on A100-80GB:" in a100 and float(a100[1:a100.index(" ")]) > float(line[1:line.index(" ")])
    for part in ("tp=2 on NVLink", "pp=2 bubble", "ZeRO-1", "selective recompute", "/80 GB"):
        assert part in line, (part, line)


def test_out_of_memory_follows_zero_2_then_3_then_offload_with_the_reason():
    config = preset("llama-7b").replace(seq_length=2048)
    layout = run(dp=8, precision="bf16", global_batch_size=8)
    zero3 = P.preflight(config, layout, 8, gpu_memory=40e9)
    assert len(zero3) == 1 and zero3[0].endswith(" GB)") and "add --zero 3 (--zero 2 would still need" in zero3[0]
    assert P.preflight(config, layout.replace(zero=3), 8, gpu_memory=40e9) == []
    offload = P.preflight(config, layout, 8, gpu_memory=16e9)[0]
    assert "--zero 3" in offload and "--offload-optimizer (without --offload-optimizer: " in offload, offload
    line = P.justify(config, layout.replace(zero=3), gpu_memory=40e9, gpus_per_node=8)
    assert "ZeRO-3 shards all states over dp=8 (ZeRO-2 would need" in line, line
    line = P.justify(config, layout.replace(zero=3, offload_optimizer=True), gpu_memory=16e9, gpus_per_node=8)
    assert "optimizer offloaded to host (ZeRO-3 on the GPU would need" in line, line


def test_suggest_takes_zero_3_where_stage_2_does_not_fit():
    found = P.suggest(preset("llama-7b"), gpus=8, gpu_memory=24e9, gpus_per_node=1, top_k=50)
    zero3 = [s for s in found if s.cfg.parallel.zero == 3]
    assert zero3, [s.reason for s in found]
    for s in zero3:
        assert s.estimate.fits(24e9) and "(ZeRO-2 would need" in s.reason
        assert not s.cfg.replace(zero=2).parallel.offload_optimizer
        assert not P.estimate(preset("llama-7b"), s.cfg.replace(zero=2)).fits(24e9)


def test_a_small_moe_layout_line_counts_its_parameters_at_their_scale():
    """Issue 40: moe-tiny's layout line said "0.00B parameters per rank"."""
    from megalite.config import RunConfig
    from megalite.plan import justify

    cfg = RunConfig.build(model="moe-tiny", dp=2, ep=2).resolved(2, 257)
    line = justify(cfg.gpt_config(), cfg, gpus_per_node=2)
    assert "ep=2 shards the experts: " in line and "0.00B" not in line, line
    assert re.search(r"shards the experts: \d+\.\d\d[MK] parameters per rank", line), line
