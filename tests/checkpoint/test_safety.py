"""Damaged, partial and missing checkpoints: clear errors naming the file, fallback to the
previous good checkpoint, nothing loaded from a damaged one, retention, crash mid-write."""
import json
import os

import pytest
import torch

from megalite.distributed import mesh
from megalite.checkpoint import CheckpointCorruptError, Checkpointer, load_checkpoint
from megalite.errors import UsageError
from megalite.checkpoint.reader import CheckpointReader
from megalite.checkpoint.save import CRASH_ENV
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.testing import RankFailed, run_distributed

from ckpt_helpers import GLOBAL, build, full_params, model_config, train, train_config


def _save(checkpointer, step, chunks, optimizer, model):
    checkpointer.save(step, chunks, optimizer, consumed_samples=step * GLOBAL, model_config=model)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A directory with checkpoints after steps 1 and 2, and the parameters of each."""
    root = tmp_path_factory.mktemp("ckpt")
    m, cfg, model = single_process_mesh("cpu"), train_config(zero=1), model_config()
    chunks, optimizer = build(model, cfg, m)
    checkpointer, params = Checkpointer(root, m, log=lambda *_: None), {}
    for step in (1, 2):
        train(chunks, optimizer, m, cfg, [step])
        _save(checkpointer, step, chunks, optimizer, model)
        params[step] = full_params(chunks)
    return root, params


def _fresh():
    m, cfg = single_process_mesh("cpu"), train_config(zero=1)
    chunks, optimizer = build(model_config(), cfg, m)
    return m, chunks, optimizer


def _load(root, **kw):
    m, chunks, optimizer = _fresh()
    before = full_params(chunks)
    messages = []
    try:
        result = load_checkpoint(root, chunks, optimizer, m, log=messages.append, **kw)
    except CheckpointCorruptError:
        for name, tensor in full_params(chunks).items():  # nothing was loaded from a damaged checkpoint
            assert torch.equal(tensor, before[name]), name
        raise
    return result, full_params(chunks), "\n".join(messages)


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) - 7]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("victim,how,needle", [
    ("shard_r00000.bin", "flip", "checksum mismatch"),
    ("shard_r00000.bin", "truncate", "the manifest says"),
    ("metadata.json", "flip", "sha256 mismatch"),
])
def test_damage_is_named_and_latest_falls_back(two_checkpoints, tmp_path, victim, how, needle):
    source, params = two_checkpoints
    root = tmp_path / "ckpt"
    os.system(f"cp -r {source} {root}")
    _damage(root / "step_000002" / victim, how)
    result, loaded, log = _load(root)
    assert result.step == 1 and f"step_000002/{victim}" in log and needle in log and "falling back" in log
    for name, tensor in loaded.items():
        assert torch.equal(tensor, params[1][name]), name
    with pytest.raises(CheckpointCorruptError, match=f"step_000002/{victim}.*{needle}"):
        _load(root, step=2)  # an explicitly named step does not fall back
    if victim != "metadata.json":  # the whole-file check (for tools) agrees
        with pytest.raises(CheckpointCorruptError, match=f"{victim}: (sha256 mismatch|.*the manifest says)"):
            CheckpointReader(root / "step_000002").verify_files([victim])
    _damage(root / "step_000001" / "shard_r00000.bin", "flip")
    with pytest.raises(CheckpointCorruptError, match="no intact checkpoint") as error:
        _load(root)
    assert isinstance(error.value, UsageError)  # the person running the job chooses: one line, exit 2


def test_no_checkpoint_yet_starts_from_scratch_and_bad_requests_fail(two_checkpoints, tmp_path):
    result, _, log = _load(tmp_path / "empty")
    assert result is None and "starting from scratch" in log
    assert _load(two_checkpoints[0] / "step_000001")[0].step == 1  # a step directory names its step
    with pytest.raises(FileNotFoundError, match="available steps: \\[1, 2\\]"):
        _load(two_checkpoints[0], step=5)
    m = single_process_mesh("cpu")
    cfg = train_config()
    chunks, optimizer = build(preset("tiny", num_layers=4, hidden_size=32, seq_length=16), cfg, m)
    with pytest.raises(ValueError, match="shape"):  # another model: a user error, not damage
        load_checkpoint(two_checkpoints[0], chunks, optimizer, m, log=lambda *_: None)


def test_keep_last_keeps_milestones_and_latest(tmp_path):
    m, cfg, model = single_process_mesh("cpu"), train_config(), model_config()
    chunks, optimizer = build(model, cfg, m)
    checkpointer = Checkpointer(tmp_path, m, keep_last=2, keep_every=3, async_save=True, log=lambda *_: None)
    for step in range(1, 8):
        _save(checkpointer, step, chunks, optimizer, model)
    checkpointer.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000003", "step_000006", "step_000007"]
    assert json.loads((tmp_path / "latest").read_text()) == {"step_dir": "step_000007"}


def _crash_mid_write(root):
    mesh.init_mesh()
    m, cfg, model = single_process_mesh("cpu"), train_config(), model_config()
    chunks, optimizer = build(model, cfg, m)
    _save(Checkpointer(root, m, log=lambda *_: None), 1, chunks, optimizer, model)
    os.environ[CRASH_ENV] = "1000"  # rank 0 dies after 1000 bytes of its shard file
    background = Checkpointer(root, m, async_save=True, log=lambda *_: None)
    _save(background, 2, chunks, optimizer, model)
    background.wait()


def test_crash_during_a_background_write_never_publishes_it(tmp_path):
    with pytest.raises(RankFailed, match="killed or crashed"):
        run_distributed(_crash_mid_write, 1, tmp_path, timeout_s=60)
    assert (tmp_path / "step_000002.tmp" / "shard_r00000.bin").stat().st_size == 1000
    assert not (tmp_path / "step_000002").exists()
    assert json.loads((tmp_path / "latest").read_text()) == {"step_dir": "step_000001"}
    assert _load(tmp_path)[0].step == 1
    m, cfg, model = single_process_mesh("cpu"), train_config(), model_config()
    chunks, optimizer = build(model, cfg, m)
    _save(Checkpointer(tmp_path, m, log=lambda *_: None), 3, chunks, optimizer, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000003"]  # leftover gone


def test_bf16_weights_and_fp32_state_round_trip_bitwise(tmp_path):
    m, cfg, model = single_process_mesh("cpu"), train_config(precision="bf16", zero=1), model_config()
    chunks, optimizer = build(model, cfg, m)
    train(chunks, optimizer, m, cfg, [1])
    _save(Checkpointer(tmp_path, m, log=lambda *_: None), 1, chunks, optimizer, model)
    fresh, fresh_optimizer = build(model, cfg, m)
    load_checkpoint(tmp_path, fresh, fresh_optimizer, m, log=lambda *_: None)
    for (name, p), (_, q) in zip(chunks[0].logical_parameters(), fresh[0].logical_parameters()):
        assert p.dtype == q.dtype == torch.bfloat16 and torch.equal(p, q), name
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(optimizer, kind), getattr(fresh_optimizer, kind)), kind
    assert fresh_optimizer.step_count == optimizer.step_count == 1


def test_a_rank_checks_exactly_the_boxes_it_reads(two_checkpoints, tmp_path):
    """Damage inside exp_avg: a weights-only load does not read it (and loads step 2); a full
    load reads it, detects it, and falls back to step 1."""
    root = tmp_path / "ckpt"
    os.system(f"cp -r {two_checkpoints[0]} {root}")
    meta = json.loads((root / "step_000002" / "metadata.json").read_text())
    kind, name, box, dtype, file, offset, crc = next(row for row in meta["items"] if row[0] == "exp_avg")
    shard = root / "step_000002" / file
    data = bytearray(shard.read_bytes())
    data[offset + 5] ^= 0x01
    shard.write_bytes(bytes(data))
    result, loaded, log = _load(root, load_optimizer=False)
    assert result.step == 2 and "damaged" not in log
    result, loaded, log = _load(root)
    assert result.step == 1 and f"({kind} of {name!r})" in log
