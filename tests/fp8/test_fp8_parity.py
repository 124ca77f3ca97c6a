"""FP8 training is layout-free: each cast at tp 2 (with and without SP) gives the bits of the single
process, and layouts that compute every GEMM whole (pp, dp, ZeRO-3 with and without the FP8
parameter gather) train to the FP8 single process's losses and weights (float32, 1e-5, 2 steps).

Why tp layouts are compared cast by cast and on one microbatch, not over whole steps: a
row-parallel GEMM's partial sums are added in another order than the single process's (and a
CPU GEMM's blocking changes with N), which moves an fp32 output by an ulp; fp32 training shrugs
that off, but an FP8 cast is a step function, so a later cast of a value that sits within an ulp
of a rounding boundary flips to the neighbouring FP8 number (1/16 of the value). Over the
microbatches of a step a few such flips are certain and the weights then differ by ~1e-3
(docs/fp8.md). The tp tests below therefore check what tp owns: the same casts (amax over the
whole logical tensor) and the same gradients for a microbatch where no flip occurs.

The reference runs in the parent process (one thread, like the ranks); each layout's ranks
compare against it.
"""
import pytest
import torch

from megalite.distributed import comm, mesh
from megalite.parameters import params as P
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.model import preset
from megalite.testing import assert_tensor_close, run_distributed
from megalite.fp8 import Fp8Recipe
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

STEPS, MICRO, GLOBAL, SEQ = 2, 2, 8, 16


def _model(name="tiny-llama"):
    if name == "moe-tiny":
        return preset(name, seq_length=SEQ)
    return preset("tiny-llama", num_layers=2, num_attention_heads=4, num_query_groups=2, seq_length=SEQ)


def _batches(vocab, dp, dp_rank):
    out = []
    for step in range(STEPS):
        ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
        per_rank = GLOBAL // dp
        mine = ids[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        out.append([{"input_ids": i[:, :-1], "labels": i[:, 1:]} for i in mine.split(MICRO)])
    return out


def _cfg(tp=1, pp=1, dp=1, **kw):
    return RunConfig.build(tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3,
                           weight_decay=0.1, clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def _run(m, cfg, name="tiny-llama"):
    model = _model(name)
    chunks = build_model_chunks(model, cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    comm.ledger.reset()
    losses = [train_step(optimizer.model, optimizer, mbs, m, cfg, lr=1e-3).loss
              for mbs in _batches(model.vocab_size, m.dp_size, m.dp_rank)]
    return losses, chunks, optimizer.model


def _reference(recipe, name="tiny-llama"):
    torch.set_num_threads(1)
    losses, chunks, _ = _run(single_process_mesh("cpu"), _cfg(fp8_format="hybrid", fp8_recipe=recipe), name)
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    return losses, params


def _parallel(tp, pp, dp, extra, ref_losses, ref_params, name="tiny-llama"):
    cfg = _cfg(tp, pp, dp, fp8_format="hybrid", **extra)
    m = mesh.init_mesh(layout=cfg.layout(model=_model(name)))
    losses, chunks, dp_model = _run(m, cfg, name)
    ledger = dict(comm.ledger.bytes)
    if dp_model.zero_stage == 3:  # bytes of one gather of every unit, from the run's own layout
        units = dp_model.param_buffer
        ledger["one gather of every unit"] = sum(
            full.numel() * full.element_size() if fp8 is None else fp8.n * fp8.wire_bytes
            for full, fp8 in zip(units.full, units.fp8_gathers))
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    with dp_model.gathered():  # ZeRO-3 holds only its shard between steps
        for chunk in chunks:
            for name, p in chunk.logical_parameters():
                assert_tensor_close(p, P.shard_spec(p).shard(ref_params[name]), rtol=1e-5, what=name)
    return ledger


@pytest.fixture(scope="module")
def tensorwise():
    return _reference("tensorwise")


@pytest.mark.slow  # the module's tensorwise reference: 8 s
def test_fp8_differs_from_fp32_but_trains(tensorwise):
    fp32_losses, _, _ = _run(single_process_mesh("cpu"), _cfg())
    assert tensorwise[0] != fp32_losses  # the GEMMs did run in FP8
    torch.testing.assert_close(tensorwise[0], fp32_losses, rtol=0.02, atol=0)


SKEW = 2.0 ** -16  # one half of each sharded tensor against the other (see _skewed_inputs)


def _skew(weight: torch.Tensor, dim: int, half: int) -> None:
    """Scale half `half` (0 or 1) of the logical `weight` along `dim` (its tp-sharded dim) by SKEW,
    whatever shard of it this rank holds."""
    spec = P.shard_spec(weight)
    full = torch.ones(spec.full_shape)
    n = spec.full_shape[dim] // 2
    full.narrow(dim, half * n, n).mul_(SKEW)
    with torch.no_grad():
        weight.mul_(spec.shard(full))


def _mlp(tp_group, sp, recipe, x, g):
    """Column -> GeLU -> Row at tp = size(tp_group): output and gradients, in this rank's shards.

    Skewed across the tp halves of the hidden units (f): fc1's first half, so tp rank 0's
    activations are SKEW of rank 1's, and fc2's second half, so rank 1's output gradients are SKEW
    of rank 0's. Crossed, every product of a small and a large half still adds O(1) to the output
    and the gradients: each depends on a cast whose amax lies on the other rank."""
    torch.manual_seed(0)
    fc1 = ColumnParallelLinear(32, 64, tp_group=tp_group, sequence_parallel=sp)
    fc2 = RowParallelLinear(64, 32, tp_group=tp_group, sequence_parallel=sp)
    _skew(fc1.weight, 0, half=0)  # [64/tp, 32]
    _skew(fc2.weight, 1, half=1)  # [32, 64/tp]
    fc1.fp8 = fc2.fp8 = recipe
    n, r = comm.group_size(tp_group), comm.group_rank(tp_group)
    x = (x.chunk(n, 0)[r] if sp else x).clone().requires_grad_()
    y = fc2(torch.nn.functional.gelu(fc1(x)))
    y.backward(g.chunk(n, 0)[r] if sp else g)
    return [y.detach(), x.grad, fc1.weight.grad, fc1.bias.grad, fc2.weight.grad, fc2.bias.grad]


def _skewed_inputs():
    """x, g [s, b, h], their first half of the sequence (tp rank 0's under SP) SKEW of the second."""
    torch.manual_seed(5)
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    x[:4] *= SKEW
    g[:4] *= SKEW
    return x, g


def _mlp_at_tp2(cases):
    m = mesh.init_mesh(tp=2)
    for sp, recipe, x, g, ref in cases:
        got = _mlp(m.tp_group, sp, recipe, x, g)
        if sp:  # the row bias sees a sequence shard: its gradient is partial per rank (the DP wrapper sums it)
            got[5] = comm.all_reduce(got[5].clone(), m.tp_group)
        r = m.tp_rank
        shard_of = [lambda t: t.chunk(2, 0)[r] if sp else t] * 2 + [lambda t: t.chunk(2, 0)[r]] * 2 + \
                   [lambda t: t.chunk(2, 1)[r], lambda t: t]
        for what, a, b, shard in zip(("y", "dx", "dW1", "db1", "dW2", "db2"), got, ref, shard_of):
            assert_tensor_close(a, shard(b), rtol=1e-6, what=f"{recipe} sp={sp} {what}")
    return comm.ledger.bytes.get(("tp", "all_gather"), 0)


@pytest.mark.parametrize("recipe", [Fp8Recipe("hybrid", "tensorwise"), Fp8Recipe("e4m3", "rowwise")],
                         ids=["tensorwise", "rowwise"])
def test_tp2_casts_what_the_single_process_casts(recipe):
    """Tensorwise and rowwise, with and without SP (whose all-gather sends FP8 bytes and the rowwise
    scales): the MLP's output and all gradients equal one process's to 1e-6.

    What makes the casts equal is the amax's MAX all-reduce over tp (fp8/scaling.py), and the data
    is chosen so that leaving it out fails: with power-of-two scales a shard's own amax casts every
    FP8-normal number of it exactly as the whole tensor's amax does (another power of two moves
    the exponent, not the mantissa), so only values that the whole tensor's scale puts among FP8's
    subnormals tell the two apart. The tp halves of every sharded tensor are therefore 2^16 apart
    (SKEW, crossed between the two linears: _mlp); without the all-reduce every case here fails
    (the output and the input gradient of each recipe, with and without SP)."""
    x, g = _skewed_inputs()
    ref = _mlp(None, False, recipe, x, g)
    cases = [(sp, recipe, x, g, ref) for sp in (False, True)]
    gathered = run_distributed(_mlp_at_tp2, 2, cases)[0]
    # SP all-gathers over tp, bytes of the gathered [s, b, 32] = 512 elements: tensorwise x_q forward
    # and again for the weight gradient (1 byte each); rowwise x_q and its scales [s, b, 1] fp32
    # forward, x in fp32 for the weight gradient (its scales run along the tokens, across the shards);
    # both: fc2's output gradient in fp32 (the backward of its reduce-scatter).
    tokens = 16
    if recipe.rowwise:
        expected = tokens * 32 + tokens * 4 + tokens * 32 * 4
    else:
        expected = 2 * tokens * 32
    assert gathered == expected + tokens * 32 * 4, gathered


def _grads_of_one_microbatch(ref):
    m = mesh.init_mesh(tp=2)
    chunk = build_model_chunks(_model(), _cfg(2, fp8_format="hybrid", sequence_parallel=True), m)[0]
    mb = _batches(chunk.config.vocab_size, 1, 0)[0][0]
    loss = chunk(mb["input_ids"], mb["labels"])
    loss.backward()
    torch.testing.assert_close(loss.item(), ref[0], rtol=1e-6, atol=0)
    for name, p in chunk.logical_parameters():
        grad = p.grad
        if P.is_sequence_parallel_grad(p):  # a norm on a sequence shard: partial per rank (the DP wrapper sums it)
            grad = comm.all_reduce(grad.clone(), m.tp_group)
        assert_tensor_close(grad, P.shard_spec(p).shard(ref[1][name]), rtol=1e-5, what=name)


@pytest.mark.slow
def test_tp2_sequence_parallel_model_gradients_match_on_one_microbatch():
    torch.set_num_threads(1)
    chunk = build_model_chunks(_model(), _cfg(fp8_format="hybrid"), single_process_mesh("cpu"))[0]
    mb = _batches(chunk.config.vocab_size, 1, 0)[0][0]
    loss = chunk(mb["input_ids"], mb["labels"])
    loss.backward()
    grads = {n: P.shard_spec(p).assemble([p.grad]) for n, p in chunk.logical_parameters()}
    run_distributed(_grads_of_one_microbatch, 2, (loss.item(), grads))


@pytest.mark.parametrize("recipe", [pytest.param("tensorwise", marks=pytest.mark.slow), "rowwise"])  # 12 s
def test_tp2_sequence_parallel_whole_steps_match_the_fp8_single_process(recipe):
    """Power-of-two scales (the default): the row-parallel GEMMs' other summation order moves amaxes
    by an ulp, which leaves the scales, and so the casts, unchanged. A single element within an ulp
    of an FP8 rounding boundary can still flip (docs/fp8.md: 2 of 8 other data seeds do within these
    2 steps at tensorwise, 0 of 8 at rowwise; with exact scales 3 and 6 of 8); this data meets none."""
    ref = _reference(recipe)
    run_distributed(_parallel, 2, 2, 1, 1, {"fp8_recipe": recipe, "sequence_parallel": True}, *ref, timeout_s=300)


@pytest.mark.slow  # 12 s; tests/fp8/test_fp8_context_parallel.py checks every cast at cp 2 in the quick tier
def test_cp2_whole_steps_match_the_fp8_single_process():
    """Context parallelism, tensorwise: x's and g's amaxes span cp (tests/fp8/test_fp8_context_parallel.py
    checks every cast of both recipes). Rowwise is not compared over whole steps here: on this data
    one element of its step-1 casts sits within ring attention's fp32 noise of a rounding boundary
    and flips (step 2's loss then differs by 7.6e-5); over 8 other data seeds 1 run of rowwise and 2
    of tensorwise meet such a flip (docs/fp8.md)."""
    ref = _reference("tensorwise")
    run_distributed(_parallel, 2, 1, 1, 1, {"cp": 2}, *ref, timeout_s=300)


@pytest.mark.slow
def test_tp2_cp2_and_moe_at_cp2_match_the_fp8_single_process():
    """(tp 2, SP, cp 2): the linears' amaxes over tp and cp; moe-tiny at cp 2: the experts' amaxes
    over the MoE layer's token group (cp). Tensorwise (see the test above for rowwise)."""
    ref = _reference("tensorwise")
    run_distributed(_parallel, 4, 2, 1, 1, {"cp": 2, "sequence_parallel": True}, *ref, timeout_s=300)
    ref = _reference("tensorwise", "moe-tiny")
    run_distributed(_parallel, 2, 1, 1, 1, {"cp": 2}, *ref, "moe-tiny", timeout_s=300)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tp2_pp2_dp2_matches_the_fp8_single_process(recipe):
    ref = _reference(recipe)
    run_distributed(_parallel, 8, 2, 2, 2, {"fp8_recipe": recipe, "zero": 1, "sequence_parallel": True}, *ref,
                    timeout_s=600)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_pp2_dp2_matches_the_fp8_single_process(recipe):
    ref = _reference(recipe)
    run_distributed(_parallel, 4, 1, 2, 2, {"fp8_recipe": recipe, "zero": 1}, *ref, timeout_s=300)


@pytest.mark.slow
def test_zero3_with_and_without_the_fp8_param_gather_matches(tensorwise):
    """Both equal the FP8 single process; the FP8 gather moves the blocks' linear weights in 1 byte
    (of 4 here: fp32 training) and the planner counts exactly the bytes the ledger saw."""
    from megalite.plan.communication import communication_bytes

    for extra in ({"zero": 3}, {"zero": 3, "fp8_param_gather": True}):
        ledger = run_distributed(_parallel, 2, 1, 1, 2, extra, *tensorwise, timeout_s=240)[0]
        # reshard after forward: every unit gathered for forward and backward of each microbatch
        gathers = STEPS * 2 * (GLOBAL // MICRO // 2)
        assert ledger[("dp", "all_gather")] == gathers * ledger["one gather of every unit"], (extra, ledger)
        # the planner: the same but the FP8 wire's padding: rank 0's chunk of a block holds both norms
        # (2h fp32 elements, which rank 1 pads) and so 2h FP8 bytes fewer than rank 1 (which it pads)
        planned = STEPS * communication_bytes(_model(), _cfg(1, 1, 2, fp8_format="hybrid", **extra), 0)["dp/all_gather"]
        h, blocks = _model().hidden_size, _model().num_layers
        padding = gathers * blocks * 2 * h * (4 + 1) if "fp8_param_gather" in extra else 0
        assert ledger[("dp", "all_gather")] == planned + padding, (extra, ledger, planned)
        if "fp8_param_gather" in extra:
            assert ledger[("dp", "all_gather")] < 0.5 * plain, (ledger, plain)
        else:
            plain = ledger[("dp", "all_gather")]


@pytest.mark.slow
def test_moe_experts_at_dp2_zero3_match_the_fp8_single_process():
    """The experts' grouped FP8 GEMMs at dp 2 with ZeRO-3 and the FP8 parameter gather (expert units
    gather over their own group): the single process's losses and weights."""
    ref = _reference("tensorwise", "moe-tiny")
    fp32_losses = _run(single_process_mesh("cpu"), _cfg(), "moe-tiny")[0]
    assert ref[0] != fp32_losses  # the experts did run in FP8 (and trained: the loss is finite)
    run_distributed(_parallel, 2, 1, 1, 2, {"zero": 3, "fp8_param_gather": True}, *ref, "moe-tiny", timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_moe_at_ep2_matches_the_fp8_single_process(recipe):
    """ep 2, dp 2: an expert's GEMM takes both dp ranks' microbatches at once, so its amaxes are those
    of another batch than the single process's; a power-of-two scale casts normal numbers alike
    whatever binade the amax lies in, so the casts (and losses) agree all the same (with exact
    scales they do not: 1.5e-4 at step 2, docs/fp8.md)."""
    ref = _reference(recipe, "moe-tiny")
    run_distributed(_parallel, 2, 1, 1, 2, {"ep": 2, "fp8_recipe": recipe}, *ref, "moe-tiny", timeout_s=240)
