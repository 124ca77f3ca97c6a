"""The planner under context parallelism: activation bytes measured on cp ranks, division by cp,
--suggest proposing cp for long sequences only, and tools/plan.py --cp.

Activation bytes are measured as in test_estimate.py (megalite's Triton autograd functions with
the launches stubbed, so every tensor is allocated and saved as on a GPU): on each rank of a
cp = 2 world, the storages autograd saves in one forward of its s/cp tokens equal the
estimate's saved part (the estimate minus the transient ring/all-to-all buffers it adds).
The cp group's bytes per step are checked against the ledger in
tests/training/test_train_step_context_parallel.py.
"""
import importlib.util
import json
import pathlib

import torch

from megalite.distributed.mesh import init_mesh
from megalite.model.activation_probe import kernels_without_launch
from megalite.config.model import preset
from megalite.model.gpt import GPTModel
from megalite.plan import activations as A
from megalite.plan import suggest
from megalite.plan.ranking import _context_parallel_choices
from megalite.testing import run_distributed
from test_estimate import SCALAR_SLACK, run, saved_tensor_bytes, tiny

CP_CASES = {  # tp -> [(config, comm type, dtype)]; cp = 2, sequence parallel when tp > 1
    1: [(tiny("gpt2"), "p2p", torch.float32),
        (tiny("llama", num_query_groups=2), "p2p", torch.float32),
        (tiny("llama", num_query_groups=2), "p2p", torch.bfloat16),  # the ring's fp32 running output is not kept
        (tiny("llama", num_query_groups=2), "a2a", torch.float32),
        (tiny("gpt2", hidden_dropout=0.1, attention_dropout=0.1), "a2a", torch.float32)],  # Philox: no masks
    2: [(tiny("gpt2", vocab_size=200), "p2p", torch.float32),
        (tiny("gpt2", vocab_size=200), "a2a", torch.float32)],
}


class _LossSum:
    """The model as saved_tensor_bytes calls it, returning the loss sum (a cp rank's mean is refused)."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, ids, labels):
        return self.model(ids, labels, reduction="sum")


def _measured_on_cp_ranks(batch, tp):
    mesh = init_mesh(tp=tp, cp=2)
    measured = []
    with kernels_without_launch():
        for config, comm_type, dtype in CP_CASES[tp]:
            torch.manual_seed(0)
            model = GPTModel(config, mesh, cp_comm_type=comm_type, dtype=dtype, sequence_parallel=tp > 1)
            measured.append(saved_tensor_bytes(_LossSum(model), batch, config.seq_length // 2)[0])
    return measured


def test_activation_bytes_match_what_cp_ranks_keep():
    batch = 4
    for tp, cases in CP_CASES.items():
        for per_case in run_distributed(_measured_on_cp_ranks, 2 * tp, batch, tp):
            for (config, comm_type, dtype), measured in zip(cases, per_case):
                layout = run(micro_batch_size=batch, cp=2, cp_comm_type=comm_type, tp=tp, sequence_parallel=tp > 1,
                             precision="bf16" if dtype == torch.bfloat16 else "fp32")
                kept = A.activation_bytes(config, layout, 0, attention="triton") \
                    - A.context_parallel_buffer_bytes(config, layout)
                case = f"tp={tp} {config.flavour} nkv={config.num_query_groups} {comm_type} {dtype}: measured " \
                       f"{measured} estimated {kept}"
                assert 0 <= measured - kept <= SCALAR_SLACK, case


def test_per_token_activations_divide_by_cp():
    config = preset("llama-7b", seq_length=32768)
    for extra in (dict(), dict(tp=2, sequence_parallel=True), dict(recompute="selective"), dict(recompute="full")):
        base = run(precision="bf16", **extra)
        one = A.layer_activation_bytes(config, base)
        for cp in (2, 4, 8):
            assert A.layer_activation_bytes(config, base.replace(cp=cp)) * cp == one, (extra, cp)
        ring = base.replace(cp=4)
        assert A.context_parallel_buffer_bytes(config, ring) > 0 == A.context_parallel_buffer_bytes(config, base)


def test_suggest_proposes_cp_only_when_activations_dominate():
    long = preset("llama-7b", seq_length=131072)
    found = suggest(long, gpus=16, gpu_memory=80e9, global_batch_size=16)
    assert found and found[0].cfg.parallel.cp > 1, [s.reason for s in found[:3]]
    assert f"cp={found[0].cfg.parallel.cp}" in found[0].reason
    short = preset("gpt2-350m")  # 1024 tokens: the model states dominate, no cp layout is tried
    assert all(s.cfg.parallel.cp == 1 for s in suggest(short, gpus=8, gpu_memory=80e9, top_k=50))
    assert [cp for cp, _ in _context_parallel_choices(short, run(dp=8))] == [1]


def _plan_tool():
    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "plan.py"
    spec = importlib.util.spec_from_file_location("plan_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plan_tool_takes_cp(capsys):
    plan_tool = _plan_tool()
    argv = ["--model", "llama-7b", "--seq-length", "32768", "--tp", "2", "--bf16", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--json"]
    assert plan_tool.main(argv + ["--cp", "4"]) == 0
    with_cp = json.loads(capsys.readouterr().out)
    assert with_cp["config"]["parallel"]["cp"] == 4 and with_cp["comm_bytes"]["cp/send"] > 0
    assert "dp_cp/all_reduce" in with_cp["comm_bytes"] and "dp/all_reduce" not in with_cp["comm_bytes"]
    assert plan_tool.main(argv) == 0  # the same sequences on one tp pair: each rank holds all 32768 tokens
    without = json.loads(capsys.readouterr().out)
    assert with_cp["activation_bytes"] < without["activation_bytes"] / 3
    assert with_cp["hardware_flops_per_rank"] == without["hardware_flops_per_rank"] / 4
    assert plan_tool.main(argv[:-1] + ["--cp", "4", "--cp-comm-type", "a2a"]) == 0
    assert "cp=4 cp_comm_type=a2a" in capsys.readouterr().out
    assert plan_tool.main(argv + ["--cp", "3"]) == 2  # 32768 tokens do not split into 6 chunks
