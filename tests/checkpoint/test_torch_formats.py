"""Checkpoints to and from torch's formats (tools/convert_checkpoint.py --to dcp | safetensors, --from dcp).

The oracle is the model and optimizer the checkpoint was saved from: torch's own dcp.load and
safetensors' load_file read back exactly their full tensors (the optimizer's through its
torch-shaped state_dict), and a checkpoint made from the DCP directory loads them back.
"""
import pytest
import torch

from megalite.checkpoint import Checkpointer, load_checkpoint
from megalite.distributed.mesh import single_process_mesh

from ckpt_helpers import build, full_params, load_convert_tool, model_config, train, train_config

convert = load_convert_tool()


def _trained_checkpoint(tmp_path):
    m, cfg, config = single_process_mesh("cpu"), train_config(zero=1, precision="bf16"), model_config("llama")
    torch.manual_seed(3)
    chunks, optimizer = build(config, cfg, m)
    train(chunks, optimizer, m, cfg, [1, 2])
    Checkpointer(tmp_path / "ckpt", m, log=lambda *_: None).save(2, chunks, optimizer, consumed_samples=16,
                                                                   model_config=config)
    return m, cfg, config, chunks, optimizer


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # torch's, for our one-process dcp.load
def test_dcp_and_safetensors_round_trip(tmp_path):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    m, cfg, config, chunks, optimizer = _trained_checkpoint(tmp_path)
    weights, opt_state = full_params(chunks), optimizer.state_dict()
    assert convert.main(["--to", "dcp", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "dcp")]) == 0
    plain = {"model": {n: torch.empty_like(t) for n, t in weights.items()},
             "optimizer": {"state": {n: {k: torch.empty_like(v) for k, v in e.items() if k != "step"}
                                     for n, e in opt_state["state"].items()}}}
    dcp.load(plain, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # torch's own reader, a plain dict
    for name, value in weights.items():
        assert torch.equal(plain["model"][name], value), name
        for kind in ("exp_avg", "exp_avg_sq", "master"):  # bf16 training: the optimizer keeps an fp32 master
            assert torch.equal(plain["optimizer"]["state"][name][kind], opt_state["state"][name][kind]), (name, kind)

    assert convert.main(["--to", "safetensors", "--load", str(tmp_path / "ckpt"),
                         "--output", str(tmp_path / "w.safetensors")]) == 0
    flat = load_file(str(tmp_path / "w.safetensors"))
    assert flat.keys() == weights.keys() and all(torch.equal(flat[n], v) for n, v in weights.items())

    assert convert.main(["--from", "dcp", "--load", str(tmp_path / "dcp"), "--output", str(tmp_path / "back")]) == 0
    torch.manual_seed(4)  # other initial weights: everything must come from the checkpoint
    fresh_chunks, fresh = build(config, cfg, m)
    resumed = load_checkpoint(tmp_path / "back", fresh_chunks, fresh, m, log=lambda *_: None)
    assert (resumed.step, resumed.consumed_samples, fresh.step_count) == (2, 16, 2)
    assert all(torch.equal(full_params(fresh_chunks)[n], v) for n, v in weights.items())
    again = fresh.state_dict()
    for name, entry in opt_state["state"].items():
        for kind, value in entry.items():
            assert torch.equal(again["state"][name][kind], value), (name, kind)


def test_a_directory_that_is_not_dcp_is_one_line(tmp_path, capsys):
    assert convert.main(["--from", "dcp", "--load", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convert_checkpoint: error:") and len(err.strip().splitlines()) == 1
