"""Streaming DiLoCo (--diloco-fragments F: megalite/config/diloco.py, megalite/data_parallel/diloco.py) against a
reference written here with plain tensors, and its bytes against the planner (megalite/plan/diloco.py).

The reference is two one-process runs, one per replica group, each on its group's half of every batch (what a
group of the distributed run trains on alone, as in tests/data_parallel/test_diloco.py); after each step the
fragment due then (this file's own tables: fragment p of a 4-layer model at F = 2 holds layers 2p, 2p + 1, the
embeddings with fragment 0, the final norm with the last; at H = 4 fragment 0 syncs after steps 2 and 6,
fragment 1 after 4 and 8; at H = 2 one after every step, in turn) takes a Nesterov outer step θ = θ_outer - lr (Δ + μ m), m = μ m + Δ,
Δ = θ_outer - mean of the two groups, on that fragment's parameters alone, written into both runs.

- Two replica groups (dp 2 as 2 x S = 1), F = 2: at outer lr 1 and no momentum every parameter after every
  step equals the reference (right after its sync a fragment is the mean of the groups, and the two groups
  hold it bit for bit equal while the other fragment still differs; quick at H = 2); at lr 0.7, μ 0.9 (each fragment's own
  momentum, kept across its syncs) too; 1e-5 relative.
- The replica link's bytes at every step (the comm ledger) equal the planner's step by step: 4 bytes per
  element of the fragment due, plus the step's 8-byte token count; over H steps F = 2 sends what F = 1
  sends, and its peak is the larger fragment's.
- The pseudo-gradients all-reduced in bf16 (--diloco-reduce-dtype bf16): the reference rounds each group's
  θ_outer - θ to bf16 and sums them in bf16; half the bytes.
- Bad settings: one line each.
"""
import pytest
import torch

from megalite.config import RunConfig
from megalite.distributed import comm, mesh as mesh_lib
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.plan.communication import communication_bytes
from megalite.plan.diloco import fragment_params
from megalite.simulate.planned import scalar_collective_bytes
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

H, STEPS, GLOBAL, SEQ = 4, 8, 8, 8
FRAGMENT_OF_LAYER = {1: (0, 0, 0, 0), 2: (0, 0, 1, 1)}  # F -> the fragment of layers 0-3
DUE = {(4, 1): {4: 0, 8: 0}, (4, 2): {2: 0, 4: 1, 6: 0, 8: 1},  # (H, F) -> {step: fragment synced after it}
       (2, 2): {1: 0, 2: 1, 3: 0, 4: 1}}
MEAN, NESTEROV = (1.0, 0.0), (0.7, 0.9)


def _model():
    return preset("tiny", num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=SEQ)


def _cfg(dp=1, global_batch=GLOBAL, **kw):
    return RunConfig.build(dp=dp, micro_batch_size=2, global_batch_size=global_batch, lr=1e-3, weight_decay=0.1,
                           clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def _outer(outer, fragments, reduce="fp32", inner_steps=H):
    lr, mu = outer
    return dict(diloco_inner_steps=inner_steps, diloco_outer_lr=lr, diloco_outer_momentum=mu, diloco_fragments=fragments,
                diloco_reduce_dtype=reduce)


def _batches(step, part, parts):
    """Step `step`'s microbatches of `part` of `parts` equal slices of the global batch."""
    ids = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(200 + step))
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[step % GLOBAL, :3 + step % 5] = -100
    mine = slice(part * GLOBAL // parts, (part + 1) * GLOBAL // parts)
    return [{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(2), labels[mine].split(2))]


def _fragment(name, fragments):
    if name.startswith("layers."):
        return FRAGMENT_OF_LAYER[fragments][int(name.split(".")[1])]
    return 0 if name.startswith(("word_embeddings", "position_embeddings")) else fragments - 1


def _reference(outer, fragments, reduce="fp32", inner_steps=H, steps=STEPS):
    """Every step's parameters of the two groups, by the plain-tensor outer steps of the module docstring
    (reduce bf16: Δ is the mean of the groups' own pseudo-gradients θ_outer - θ, each rounded to bf16 and
    summed in bf16)."""
    (lr, mu), m, cfg = outer, single_process_mesh("cpu"), _cfg(global_batch=GLOBAL // 2)
    runs = []
    for _ in range(2):
        chunks = build_model_chunks(_model(), cfg, m)
        runs.append((build_optimizer(build_data_parallel(chunks, cfg, m), cfg), dict(chunks[0].logical_parameters())))
    theta = {n: p.detach().clone() for n, p in runs[0][1].items()}
    momentum = {n: torch.zeros_like(p) for n, p in theta.items()}
    history = []
    for step in range(1, steps + 1):
        for part, (optimizer, _) in enumerate(runs):
            train_step(optimizer.model, optimizer, _batches(step, part, 2), m, cfg, lr=1e-3)
        for name in [n for n in theta if _fragment(n, fragments) == DUE[inner_steps, fragments].get(step)]:
            a, b = runs[0][1][name], runs[1][1][name]
            delta = theta[name] - (a.detach() + b.detach()) / 2
            if reduce == "bf16":
                delta = ((theta[name] - a.detach()).bfloat16() + (theta[name] - b.detach()).bfloat16()).float() / 2
            momentum[name] = mu * momentum[name] + delta
            theta[name] = theta[name] - lr * (delta + mu * momentum[name])
            with torch.no_grad():  # fp32, one process: the parameter is the optimizer's master
                a.copy_(theta[name])
                b.copy_(theta[name])
        history.append([{n: p.detach().clone() for n, p in params.items()} for _, params in runs])
    return history


def _run(m, cfg, steps):
    """Every step's parameters of this rank's group, the replica link's bytes and the planner's, step by step."""
    chunks = build_model_chunks(_model(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    history, sent, planned = [], [], []
    parts = m.dp_size
    for step in range(1, steps + 1):
        comm.ledger.reset()
        train_step(optimizer.model, optimizer, _batches(step, m.dp_rank, parts), m, cfg, lr=1e-3)
        sent.append(comm.ledger.bytes.get(("dp_replicate", "all_reduce"), 0))
        planned.append(communication_bytes(_model(), cfg, 0, step=step).get("dp_replicate/all_reduce", 0)
                       + scalar_collective_bytes(cfg)["dp_replicate"])
        with optimizer.model.gathered():
            history.append({n: p.detach().clone() for c in chunks for n, p in c.logical_parameters()})
    return history, sent, planned


def _world(zero, dp_shard, cases, steps=STEPS):
    m = mesh_lib.init_mesh(dp_shard=dp_shard, replace=True)
    group = m.dp_replicate_rank
    return group, {case: _run(m, _cfg(dp=m.dp_size, dp_shard=dp_shard, zero=zero, **_outer(*case)), steps)
                   for case in cases}


def _check(results, references, rtol=1e-5):
    for group, runs in results:
        for case, (history, _, _) in runs.items():
            for step, params in enumerate(history, start=1):
                for name, value in params.items():
                    assert_tensor_close(value, references[case][step - 1][group][name], rtol=rtol,
                                        what=f"{case} step {step} group {group} {name}")


def _check_fragments_after_their_syncs(results, case):
    """Right after its sync a fragment is the same in both groups, bit for bit; the other still differs."""
    (_, first), (_, second) = results[0], results[-1]
    (_, fragments, _, inner_steps), a, b = case, first[case][0], second[case][0]
    for step, fragment in [(s, f) for s, f in DUE[inner_steps, fragments].items() if s <= len(a)]:
        for name in a[step - 1]:
            same = torch.equal(a[step - 1][name], b[step - 1][name])
            assert same == (_fragment(name, fragments) == fragment), (step, name)


def test_two_groups_average_each_fragment_right_after_its_sync():
    """Quick tier: H = 2, F = 2 (a fragment every step), lr 1, no momentum, each fragment's first sync."""
    case = (MEAN, 2, "fp32", 2)
    results = run_distributed(_world, 2, 1, 1, [case], 2, timeout_s=240)
    _check(results, {case: _reference(*case, steps=2)})
    _check_fragments_after_their_syncs(results, case)
    fragments = [4 * n for n in fragment_params(_model(), _cfg(dp=2, dp_shard=1, **_outer(*case)))]
    for _, runs in results:
        _, sent, planned = runs[case]
        assert sent == planned and [n - 8 for n in sent] == fragments, (sent, planned)


@pytest.mark.slow
def test_two_groups_take_each_fragments_outer_step_as_the_plain_tensor_reference():
    """Two periods of H, each fragment's momentum across its syncs, F = 1 beside F = 2, and the pseudo-gradients
    all-reduced in bf16 (--diloco-reduce-dtype bf16: 2 bytes per element, the planner's)."""
    cases = [(MEAN, 2, "fp32", H), (NESTEROV, 2), (NESTEROV, 1), (NESTEROV, 2, "bf16")]
    results = run_distributed(_world, 2, 1, 1, cases, timeout_s=300)
    _check(results, {case: _reference(*case) for case in cases})
    _check_fragments_after_their_syncs(results, (MEAN, 2, "fp32", H))
    fragments = [4 * n for n in fragment_params(_model(), _cfg(dp=2, dp_shard=1, **_outer(MEAN, 2)))]
    for _, runs in results:
        streamed, plain = runs[NESTEROV, 2][1], runs[NESTEROV, 1][1]
        for case, (_, sent, planned) in runs.items():
            assert sent == planned, (case, sent, planned)  # every step, to the byte
        due = DUE[H, 2]
        assert [n - 8 for n in streamed] == [fragments[due[s]] if s in due else 0 for s in range(1, STEPS + 1)]
        assert sum(streamed[:H]) == sum(plain[:H]) and sum(streamed) == sum(plain)  # the same total per H steps
        assert max(streamed) - 8 == max(fragments) < max(plain) - 8 == sum(fragments)
        assert [2 * (n - 8) for n in runs[NESTEROV, 2, "bf16"][1]] == [n - 8 for n in streamed]  # half the bytes


@pytest.mark.slow
@pytest.mark.parametrize("zero, dp_shard, world", [(0, 1, 2), (2, 1, 2), (3, 1, 2), (1, 2, 4), (3, 2, 4)])
def test_streaming_at_every_zero_stage_and_under_hybrid_sharding(zero, dp_shard, world):
    """ZeRO 0, 2 and 3, and 2 replica groups of S = 2 (dp 4) at ZeRO 1 and 3: each group's ranks hold 1/S of every
    fragment; the parameters equal the reference and the replica link's bytes the planner's (padding aside)."""
    cases = [(NESTEROV, 2)]
    results = run_distributed(_world, world, zero, dp_shard, cases, timeout_s=300)
    _check(results, {case: _reference(*case) for case in cases})
    for _, runs in results:
        _, sent, planned = runs[NESTEROV, 2]
        assert all(abs(s - p) <= 1e-3 * p for s, p in zip(sent, planned)), (sent, planned)


@pytest.mark.parametrize("kw, needle", [
    (dict(diloco_inner_steps=4, diloco_fragments=3), "--diloco-fragments 3 does not divide --diloco-inner-steps 4"),
    (dict(diloco_inner_steps=8, diloco_fragments=8), "more fragments than the model's 4 layers"),
    (dict(diloco_fragments=2), "give --diloco-inner-steps H too"),
    (dict(diloco_reduce_dtype="bf16"), "--diloco-reduce-dtype sets up DiLoCo's outer steps"),
    (dict(diloco_inner_steps=4, diloco_reduce_dtype="fp16"), "choose fp32 or bf16"),
])
def test_bad_fragments_are_one_line(kw, needle):
    problems = RunConfig.build(dp=2, dp_shard=1, micro_batch_size=2, global_batch_size=GLOBAL, num_layers=4,
                               hidden_size=32, num_attention_heads=4, **kw).validate()
    assert len(problems) == 1 and needle in problems[0], problems
