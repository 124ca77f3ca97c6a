"""Layout-free checkpoints across ZeRO stages: save at ZeRO-3 dp 4, load at ZeRO-1 dp 2, save there,
load at ZeRO-3 (tp 2, dp 2); each continues like the uninterrupted (1, 1, 1) run.

At ZeRO-3 every dp rank writes the parameter pieces its shard holds, so every element is still
stored once and any layout reads it. Resumed under the saving layout the trajectory is
bit-identical; the ZeRO-3 checkpoint also exports to transformers.
"""
import pytest
import torch

from megalite.distributed import mesh
from megalite.parameters import params as P
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.distributed.mesh import single_process_mesh
from megalite.testing import assert_tensor_close, run_distributed

from ckpt_helpers import GLOBAL, build, full_params, load_convert_tool, megalite_logits, model_config, train, \
    train_config

SAVED = 2
QUIET = dict(log=lambda *_: None)


def _check_params(chunks, optimizer, reference, what):
    with optimizer.model.gathered():  # ZeRO-3 holds shards; below it a no-op
        for chunk in chunks:
            for name, p in chunk.logical_parameters():
                assert_tensor_close(p, P.shard_spec(p).shard(reference[name]), rtol=1e-5, what=f"{what}: {name}")


def _save(chunks, optimizer, m, cfg, path):
    Checkpointer(path, m, **QUIET).save(SAVED, chunks, optimizer, consumed_samples=SAVED * GLOBAL,
                                         model_config=model_config(), train_config=cfg)


def _zero3_dp4_world(path, ref_losses):
    m = mesh.init_mesh(dp=4)
    cfg = train_config(dp=4, zero=3)
    chunks, optimizer = build(model_config(), cfg, m)
    torch.testing.assert_close(train(chunks, optimizer, m, cfg, range(1, SAVED + 1)), ref_losses[:SAVED], rtol=1e-5,
                               atol=0)
    _save(chunks, optimizer, m, cfg, path)
    uninterrupted = train(chunks, optimizer, m, cfg, [3, 4])
    torch.testing.assert_close(uninterrupted, ref_losses[SAVED:], rtol=1e-5, atol=0)
    chunks, optimizer = build(model_config(), cfg, m)
    assert load_checkpoint(path, chunks, optimizer, m, **QUIET).rng_restored
    assert train(chunks, optimizer, m, cfg, [3, 4]) == uninterrupted  # same layout: bit-identical


def _load_world(tp, dp, zero, load_from, save_to, ref_losses, ref_saved, ref_final):
    m = mesh.init_mesh(tp=tp, dp=dp)
    cfg = train_config(tp=tp, dp=dp, zero=zero)
    chunks, optimizer = build(model_config(), cfg, m)
    assert load_checkpoint(load_from, chunks, optimizer, m, **QUIET).step == SAVED
    _check_params(chunks, optimizer, ref_saved, f"loaded at tp={tp} dp={dp} zero={zero}")
    if save_to is not None:
        _save(chunks, optimizer, m, cfg, save_to)
    torch.testing.assert_close(train(chunks, optimizer, m, cfg, [3, 4]), ref_losses[SAVED:], rtol=1e-5, atol=0)
    _check_params(chunks, optimizer, ref_final, f"trained at tp={tp} dp={dp} zero={zero}")


def test_zero3_checkpoints_load_at_other_stages_and_layouts(tmp_path):
    m, cfg = single_process_mesh("cpu"), train_config()
    chunks, optimizer = build(model_config(), cfg, m)
    ref_losses = train(chunks, optimizer, m, cfg, range(1, SAVED + 1))
    ref_saved = full_params(chunks)
    ref_losses += train(chunks, optimizer, m, cfg, [3, 4])
    ref_final = full_params(chunks)

    zero3, zero1 = tmp_path / "zero3_dp4", tmp_path / "zero1_dp2"
    run_distributed(_zero3_dp4_world, 4, zero3, ref_losses, timeout_s=240)
    assert len(list((zero3 / "step_000002").glob("shard_r*.bin"))) == 4
    run_distributed(_load_world, 2, 1, 2, 1, zero3, zero1, ref_losses, ref_saved, ref_final, timeout_s=240)
    run_distributed(_load_world, 4, 2, 2, 3, zero1, None, ref_losses, ref_saved, ref_final, timeout_s=240)

    # Exported to transformers from the ZeRO-3 checkpoint: HF's logits are megalite's.
    transformers = pytest.importorskip("transformers")
    assert load_convert_tool().main(["export", "--load", str(zero3), "--output", str(tmp_path / "hf")]) == 0
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf_logits = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    torch.testing.assert_close(hf_logits, megalite_logits(zero3, ids), rtol=1e-5, atol=1e-5)
