"""Checkpoints this model or this code cannot load are usage errors found at load-plan time,
before anything is read, on every rank: another model (a parameter's shape, missing
parameters, more layers), a newer format version, a step that does not exist."""
import hashlib
import json

import pytest

from megalite.distributed import mesh
from megalite.checkpoint import (CheckpointMismatchError, CheckpointNotFoundError, Checkpointer, load_checkpoint,
                                 storage)
from megalite.errors import UsageError
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.testing import run_distributed

from ckpt_helpers import GLOBAL, SEQ, build, full_params, train_config


def _model(**changes):
    return preset("tiny", **{"num_layers": 2, "hidden_size": 32, "seq_length": SEQ, **changes})


def _save(root, model, step=1):
    m, cfg = single_process_mesh("cpu"), train_config(zero=1)
    chunks, optimizer = build(model, cfg, m)
    Checkpointer(root, m, log=lambda *_: None).save(step, chunks, optimizer, consumed_samples=step * GLOBAL,
                                                    model_config=model)


def _load(root, model, **kw):
    """Load into a fresh `model`; the parameters must be untouched when it raises."""
    m, cfg = single_process_mesh("cpu"), train_config(zero=1)
    chunks, optimizer = build(model, cfg, m)
    before = full_params(chunks)
    try:
        return load_checkpoint(root, chunks, optimizer, m, log=lambda *_: None, **kw)
    finally:
        assert all(t.equal(before[n]) for n, t in full_params(chunks).items())


@pytest.mark.parametrize("saved,needles", [
    (_model(hidden_size=64), ["holds 'position_embeddings' with shape [16, 64], the model has [16, 32]",
                              "hidden_size 64 (checkpoint) vs 32 (model)"]),
    (_model(num_layers=1), ["has no parameter 'layers.1.", "num_layers 1 (checkpoint) vs 2 (model)"]),
    (_model(num_layers=4), ["was saved from another model: num_layers 4 (checkpoint) vs 2 (model)"]),  # a prefix fits
    (_model(seq_length=2 * SEQ), ["holds 'position_embeddings' with shape [32, 32], the model has [16, 32]"]),
])
def test_a_checkpoint_of_another_model_is_named_by_parameter(tmp_path, saved, needles):
    _save(tmp_path, saved)
    with pytest.raises(CheckpointMismatchError) as caught:
        _load(tmp_path, _model())
    message = str(caught.value)
    assert isinstance(caught.value, UsageError) and "\n" not in message
    assert all(needle in message for needle in needles) and "same --model and shape flags" in message, message


def test_a_newer_format_is_refused_without_falling_back(tmp_path):
    _save(tmp_path, _model(), step=1)
    _save(tmp_path, _model(), step=2)
    step_dir = tmp_path / "step_000002"
    metadata = json.loads((step_dir / storage.METADATA).read_text())
    metadata["format_version"] = storage.FORMAT_VERSION + 1
    metadata["versions"]["megalite"] = "9.9.0"
    sha = storage.write_json_atomic(step_dir / storage.METADATA, metadata)  # a valid checkpoint of that format
    manifest = json.loads((step_dir / storage.MANIFEST).read_text())
    manifest["files"][storage.METADATA] = {"sha256": sha, "bytes": (step_dir / storage.METADATA).stat().st_size}
    (step_dir / storage.MANIFEST).write_text(json.dumps(manifest))
    assert hashlib.sha256((step_dir / storage.METADATA).read_bytes()).hexdigest() == sha
    with pytest.raises(CheckpointMismatchError, match=f"format version {storage.FORMAT_VERSION + 1}, newer than the "
                                                      f"{storage.FORMAT_VERSION} this megalite reads; upgrade "
                                                      f"megalite \\(it was written by 9.9.0\\)"):
        _load(tmp_path, _model())  # not a silent fall back to step 1: the newer run's progress would be lost
    assert _load(tmp_path, _model(), step=1).step == 1  # --load-step picks the older one explicitly
    with pytest.raises(CheckpointNotFoundError, match="--load-step 7: .* available steps: \\[1, 2\\]"):
        _load(tmp_path, _model(), step=7)


def _load_at_pp2(root):
    m = mesh.init_mesh(pp=2)
    chunks, optimizer = build(_model(), train_config(pp=2, zero=1), m)
    try:
        load_checkpoint(root, chunks, optimizer, m, log=lambda *_: None)
    except UsageError as exc:
        return type(exc).__name__, str(exc)


def test_every_rank_raises_the_same_error_when_one_stage_finds_it(tmp_path):
    _save(tmp_path, _model(seq_length=2 * SEQ))  # only stage 0 holds the position table
    verdicts = run_distributed(_load_at_pp2, 2, tmp_path, timeout_s=120)
    assert verdicts[0] == verdicts[1] and verdicts[0][0] == "CheckpointMismatchError"
    assert "'position_embeddings' with shape [32, 32]" in verdicts[0][1]
