"""Save at (tp, pp, dp) = (2, 2, 2) (ZeRO-1; ZeRO-2 with 2 virtual stages), load at other layouts,
train on: the uninterrupted run's losses.

The reference is the uninterrupted (1, 1, 1) run in this process. Each world checks, right
after loading, that its shards equal the reference parameters after the saved step (the load
itself is exact up to the 1e-7 noise between layouts), then trains two more steps and compares
losses and final parameters with the reference (~1e-5 relative, as the parity tests do).
Under the saving layout itself the resumed trajectory must be bit-identical.
"""
import filecmp
import json

import pytest
import torch

from megalite.parameters import params as P
from megalite.distributed import mesh
from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.distributed.mesh import single_process_mesh
from megalite.testing import assert_tensor_close, run_distributed

from ckpt_helpers import (GLOBAL, build, full_params, load_convert_tool, megalite_logits, model_config, train,
                          train_config)

SAVED_STEP = 2


def _check_params(chunks, reference, what):
    for chunk in chunks:
        for name, p in chunk.logical_parameters():
            assert_tensor_close(p, P.shard_spec(p).shard(reference[name]), rtol=1e-5, what=f"{what}: {name}")


def _save_world(flavour, layout, sync_dir, async_dir, ref_losses):
    tp, pp, dp, extra = layout
    m = mesh.init_mesh(tp=tp, pp=pp, dp=dp)
    model, cfg = model_config(flavour), train_config(tp, pp, dp, **extra)
    chunks, optimizer = build(model, cfg, m)
    losses = train(chunks, optimizer, m, cfg, range(1, SAVED_STEP + 1))
    torch.testing.assert_close(losses, ref_losses[:SAVED_STEP], rtol=1e-5, atol=0)
    quiet = dict(log=lambda *_: None)
    Checkpointer(sync_dir, m, **quiet).save(SAVED_STEP, chunks, optimizer, consumed_samples=SAVED_STEP * GLOBAL,
                                            model_config=model, train_config=cfg)
    background = Checkpointer(async_dir, m, async_save=True, **quiet)
    background.save(SAVED_STEP, chunks, optimizer, consumed_samples=SAVED_STEP * GLOBAL, model_config=model,
                    train_config=cfg)
    uninterrupted = train(chunks, optimizer, m, cfg, [3, 4])  # overlaps the background write
    background.finish()
    # Resume under the same layout: bit-identical losses (same data, LR steps, optimizer state, RNG).
    chunks, optimizer = build(model, cfg, m)
    resumed = load_checkpoint(sync_dir, chunks, optimizer, m, **quiet)
    assert (resumed.step, resumed.consumed_samples, resumed.rng_restored) == (SAVED_STEP, SAVED_STEP * GLOBAL, True)
    assert train(chunks, optimizer, m, cfg, [3, 4]) == uninterrupted


def _load_world(flavour, layout, load_dir, ref_losses, ref_saved, ref_final):
    tp, pp, dp, extra = layout
    m = mesh.init_mesh(tp=tp, pp=pp, dp=dp)
    cfg = train_config(tp, pp, dp, **extra)
    chunks, optimizer = build(model_config(flavour), cfg, m)
    resumed = load_checkpoint(load_dir, chunks, optimizer, m, log=lambda *_: None)
    assert resumed.step == SAVED_STEP and not resumed.rng_restored
    _check_params(chunks, ref_saved, f"after load at {layout}")
    losses = train(chunks, optimizer, m, cfg, [3, 4])
    torch.testing.assert_close(losses, ref_losses[SAVED_STEP:], rtol=1e-5, atol=0)
    _check_params(chunks, ref_final, f"after training at {layout}")


def _reference(flavour):
    m, cfg = single_process_mesh("cpu"), train_config()
    chunks, optimizer = build(model_config(flavour), cfg, m)
    losses = train(chunks, optimizer, m, cfg, range(1, SAVED_STEP + 1))
    saved = full_params(chunks)
    losses += train(chunks, optimizer, m, cfg, [3, 4])
    return losses, saved, full_params(chunks)


SAVE = {"gpt2": (2, 2, 2, {"zero": 1}),
        "llama": (2, 2, 2, {"zero": 2, "virtual_stages": 2, "pipeline_schedule": "interleaved"})}
LOADS = {
    "gpt2": [(4, 1, 2, {"zero": 2, "sequence_parallel": True}), (1, 2, 4, {"zero": 1}),
             (1, 2, 2, {"virtual_stages": 2, "pipeline_schedule": "interleaved"})],
    "llama": [(2, 1, 2, {"zero": 2}), (1, 2, 1, {"virtual_stages": 2, "pipeline_schedule": "interleaved"})],
}


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
@pytest.mark.slow
def test_save_at_222_load_anywhere(flavour, tmp_path):
    ref_losses, ref_saved, ref_final = _reference(flavour)
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    run_distributed(_save_world, 8, flavour, SAVE[flavour], sync_dir, async_dir, ref_losses, timeout_s=240)

    # The background write produced the same bytes as the synchronous one.
    a, b = sync_dir / "step_000002", async_dir / "step_000002"
    shards = sorted(p.name for p in a.glob("shard_r*.bin"))
    assert len(shards) == 8 and shards == sorted(p.name for p in b.glob("shard_r*.bin"))
    assert filecmp.cmpfiles(a, b, shards, shallow=False)[0] == shards
    meta_a, meta_b = (json.loads((d / "metadata.json").read_text()) for d in (a, b))
    meta_a.pop("saved_at_unix"), meta_b.pop("saved_at_unix")
    assert meta_a == meta_b

    # Exported to transformers from the (2, 2, 2) checkpoint: HF's logits are megalite's.
    transformers = pytest.importorskip("transformers")
    assert load_convert_tool().main(["export", "--load", str(sync_dir), "--output", str(tmp_path / "hf")]) == 0
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf_logits = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()(ids).logits
    torch.testing.assert_close(hf_logits, megalite_logits(sync_dir, ids), rtol=1e-5, atol=1e-5)

    # (1, 1, 1) in this process, zero 0, then the other layouts on forked worlds.
    m, cfg = single_process_mesh("cpu"), train_config()
    chunks, optimizer = build(model_config(flavour), cfg, m)
    assert load_checkpoint(async_dir, chunks, optimizer, m, log=lambda *_: None).step == SAVED_STEP
    _check_params(chunks, ref_saved, "after load at (1, 1, 1)")
    torch.testing.assert_close(train(chunks, optimizer, m, cfg, [3, 4]), ref_losses[SAVED_STEP:], rtol=1e-5, atol=0)
    for layout in LOADS[flavour]:
        tp, pp, dp, _ = layout
        run_distributed(_load_world, tp * pp * dp, flavour, layout, sync_dir, ref_losses, ref_saved, ref_final,
                        timeout_s=240)
