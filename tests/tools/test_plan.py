"""tools/plan.py: the CLI reproduces the ZeRO paper, reports JSON in bytes, names errors."""
from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "tools" / "plan.py"
_spec = importlib.util.spec_from_file_location("plan_tool", _PATH)
plan = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan)

KEYS = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "activation_bytes", "total_bytes")


def run(capsys, *argv):
    code = plan.main(list(argv))
    return code, capsys.readouterr().out


def test_num_params_reproduces_the_zero_paper(capsys):
    for stage, total in ((0, 120e9), (1, 31.40625e9), (2, 16.640625e9), (3, 1.875e9)):
        code, out = run(capsys, "--num-params", "7.5B", "--dp", "64", "--fp16", "--grad-reduce-dtype", "fp16",
                        "--zero", str(stage), "--json")
        result = json.loads(out)
        assert code == 0 and result["total_bytes"] == total
        assert all(isinstance(result[k], int) for k in KEYS)


def test_model_layout_json_and_text(capsys):
    argv = ["--model", "llama-7b", "--tp", "2", "--pp", "2", "--dp", "2", "--bf16", "--sequence-parallel",
            "--global-batch-size", "64", "--micro-batch-size", "1", "--gpu-memory", "80GB"]
    code, out = run(capsys, *argv, "--json")
    result = json.loads(out)
    assert code == 0 and result["errors"] == [] and result["fits"] is True
    # the four terms and one block's transient buffers (plan/buffers.py: the MLP output and its reduce-scatter),
    # and the RoPE tables (fp32 cos and sin [4096, 128])
    assert result["buffer_bytes"] == 2 * 4096 * 4096 * (1 + 1 / 2) + 2 * 4 * 4096 * 128
    assert "buffers" in run(capsys, *argv)[1]
    assert result["total_bytes"] == sum(result[k] for k in KEYS[:4]) + result["buffer_bytes"]
    assert result["config"]["parallel"]["sequence_parallel"] and result["num_microbatches"] == 32
    code, text = run(capsys, *argv)
    assert "activations" in text and "fits in 80.0 GB" in text and "comm tp/all_gather" in text


def test_errors_exit_2_with_the_fix(capsys):
    code, out = run(capsys, "--model", "llama-7b", "--tp", "3", "--dp", "1")
    assert code == 2 and "choose tp in" in out
    code, out = run(capsys, "--model", "llama-7b", "--seq-length", "2048", "--dp", "8", "--bf16",
                    "--global-batch-size", "8", "--micro-batch-size", "1", "--gpu-memory", "80")
    assert code == 2 and "add --zero 1" in out


@pytest.mark.parametrize("argv,needle", [
    (["--gpus", "8", "--nodes", "3"], "--nodes 3 does not divide --gpus 8"),
    (["--suggest", "--gpus", "8"], "--suggest needs --gpu-memory G"),
    (["--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--gpu-memory", "0"], "--gpu-memory must be > 0"),
    (["--gpu-memory", "lots"], "cannot read a memory size from 'lots'"),
    (["--tp", "0"], "--tp must be an integer >= 1, got 0"),
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--hardware", "no-such-gpu"], "no-such-gpu"),
])
def test_planner_mistakes_are_one_line_exit_2(capsys, argv, needle):
    try:
        code = plan.main(argv)
    except SystemExit as exc:  # argparse's own mistakes
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured
    assert needle in captured.err, captured.err


def test_suggest_without_gpus_plans_the_flags_world(capsys):
    code, out = run(capsys, "--model", "gpt2-124m", "--suggest", "--tp", "2", "--gpu-memory", "80",
                    "--bf16", "--global-batch-size", "8", "--top-k", "2", "--json")
    found = json.loads(out)
    worlds = [math.prod(s["config"]["parallel"][k] for k in ("tp", "cp", "pp", "dp")) for s in found]
    assert code == 0 and found and worlds == [2] * len(found), worlds  # --tp 2: a world of 2


def test_suggest_json(capsys):
    code, out = run(capsys, "--model", "gpt2-350m", "--suggest", "--gpus", "8", "--gpu-memory", "80",
                    "--bf16", "--global-batch-size", "64", "--top-k", "3", "--json")
    found = json.loads(out)
    assert code == 0 and 1 <= len(found) <= 3
    assert all(s["total_bytes"] <= 0.9 * 80e9 and s["reason"] for s in found)


def test_memory_and_count_parsing():
    assert plan.parse_bytes("80") == 80e9 and plan.parse_bytes("80GB") == 80e9
    assert plan.parse_bytes("80GiB") == 80 * 2 ** 30 and plan.parse_bytes("85899345920") == 85899345920
    assert plan.parse_count("7.5B") == 7_500_000_000 and plan.parse_count("350M") == 350_000_000
    with pytest.raises(Exception, match="memory size"):
        plan.parse_bytes("lots")


def test_json_has_parameter_counts_and_the_step_time(capsys, tmp_path):
    from megalite.config.model import preset
    from megalite.plan.hardware import BUILTIN

    argv = ["--model", "gpt2-350m", "--tp", "2", "--pp", "2", "--dp", "2", "--bf16", "--global-batch-size", "32",
            "--micro-batch-size", "2", "--json"]
    code, out = run(capsys, *argv, "--hardware", "A100-80GB")
    result = json.loads(out)
    assert code == 0 and result["total_params"] == preset("gpt2-350m").num_params()
    assert 0 < result["params_per_rank"] < result["total_params"] / 2
    parts = result["step_time_breakdown"]
    assert set(parts) == {"compute", "tp", "cp", "pp", "dp", "bubble", "optimizer", "sync", "offload", "total"}
    assert result["step_time_s"] == parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
    assert parts["tp"] > 0 and parts["pp"] > 0 and parts["bubble"] > 0 and result["hardware"] == "A100-80GB"
    profile = tmp_path / "fast.json"
    fast = BUILTIN["A100-80GB"].to_dict()
    fast.update(name="twice the A100", peak_tflops={k: 2 * v for k, v in fast["peak_tflops"].items()})
    profile.write_text(json.dumps(fast))
    code, out = run(capsys, *argv, "--hardware", str(profile))
    faster = json.loads(out)
    assert code == 0 and faster["hardware"] == "twice the A100"
    assert faster["step_time_breakdown"]["compute"] < parts["compute"]
    code, out = run(capsys, "--num-params", "7.5B", "--dp", "64", "--json")
    assert code == 0 and json.loads(out)["total_params"] == 7_500_000_000 and "step_time_s" not in json.loads(out)


def test_a_bad_hardware_profile_exits_2(capsys, tmp_path):
    assert plan.main(["--hardware", "B300"]) == 2
    assert "not a built-in profile" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    broken.write_text("{\"name\": \"x\"}")
    assert plan.main(["--hardware", str(broken)]) == 2
    assert "missing field" in capsys.readouterr().err


def test_suggest_candidates_round_trip_through_config(capsys, tmp_path):
    """Each --suggest --json candidate's config is the whole resolved configuration (the model it was
    asked about, sizes written out): saved and loaded with --config it plans the same run. And
    within 2% of the best predicted step time the lowest ZeRO stage ranks first, saying why."""
    code, out = run(capsys, "--model", "gpt2-1.3b", "--suggest", "--gpus", "8", "--gpu-memory", "40", "--bf16",
                    "--lr", "0.0003", "--top-k", "2", "--json")
    found = json.loads(out)
    assert code == 0 and len(found) == 2
    assert found[0]["config"]["parallel"]["zero"] == 1 and found[1]["config"]["parallel"]["zero"] == 3
    assert found[1]["step_time_s"] < found[0]["step_time_s"] <= 1.02 * found[1]["step_time_s"]
    assert "ranked above ZeRO-3" in found[0]["reason"] and "the lowest ZeRO stage wins" in found[0]["reason"]
    for i, candidate in enumerate(found):
        model = candidate["config"]["model"]
        assert model["model"] == "gpt2-1.3b" and model["num_layers"] == 24 and model["hidden_size"] == 2048
        assert candidate["config"]["optimizer"]["lr"] == 0.0003  # the user's other settings are kept
        saved = tmp_path / f"candidate{i}.json"
        saved.write_text(json.dumps(candidate["config"]))
        code, out = run(capsys, "--config", str(saved), "--gpu-memory", "40", "--json")
        planned = json.loads(out)
        assert code == 0 and planned["errors"] == [] and planned["config"] == candidate["config"]
        for key in KEYS + ("step_time_s", "num_microbatches"):
            assert planned[key] == candidate[key], key



def test_suggest_tries_etp_for_experts_and_its_candidates_round_trip(capsys, tmp_path):
    """For an MoE model under tp, --suggest tries etp 1 (whole experts per tp rank) and etp = tp (experts
    split), each with its own memory (experts /etp per rank) and tp bytes; a saved candidate of either
    etp plans the same run through --config."""
    code, out = run(capsys, "--model", "moe-tiny", "--suggest", "--gpus", "2", "--gpu-memory", "40", "--bf16",
                    "--top-k", "200", "--json")
    found = json.loads(out)
    assert code == 0
    first = {}  # the best candidate of each etp at tp 2, pp 1, ZeRO 0, no recompute, micro batch 8
    for candidate in found:
        p, mb = candidate["config"]["parallel"], candidate["config"]["training"]["micro_batch_size"]
        if (p["tp"], p["pp"], p["zero"], p["recompute"], mb) == (2, 1, 0, "none", 8):
            first.setdefault(p["etp"], candidate)
    assert set(first) == {1, 2}
    whole, split = first[1], first[2]
    assert split["param_bytes"] < whole["param_bytes"]  # each tp rank holds half of every expert
    assert split["comm_bytes"]["tp/all_reduce"] > whole["comm_bytes"]["tp/all_reduce"]  # expert outputs summed
    for etp, candidate in first.items():
        saved = tmp_path / f"etp{etp}.json"
        saved.write_text(json.dumps(candidate["config"]))
        code, out = run(capsys, "--config", str(saved), "--gpu-memory", "40", "--json")
        planned = json.loads(out)
        assert code == 0 and planned["errors"] == [] and planned["config"] == candidate["config"]
        for key in KEYS + ("step_time_s", "num_microbatches", "comm_bytes"):
            assert planned[key] == candidate[key], (etp, key)
    code, out = run(capsys, "--model", "moe-tiny", "--suggest", "--gpus", "2", "--gpus-per-node", "2",
                    "--gpu-memory", "40", "--bf16", "--top-k", "200")
    assert code == 0 and "--tp 2 --pp 1 --dp 1 --etp 1 " in out and "--tp 2 --pp 1 --dp 1 --etp 2 " in out
