"""--overlap-param-gather: no parameter is read before its all-gather completes, whatever path reads it.

The gathers of step k are still running when step k+1's forward starts. GPT-2 reads its word
embedding through `local_lookup` (not the embedding module's call) and its tied head through
`head_weight()`; Llama reads RoPE tables and norms; pipeline chunks read their own slices.
The wrapper's read guard must make each of those reads wait for its own bucket.

Worst case made deterministic: under `gathers_land_at_wait` a gather's output is NaN until its
handle is waited for, so any read before the wait poisons the loss. Many small buckets, the
forward issued right after step(), both model flavours, ZeRO 1 and 2, and a pipeline; then
repeated runs on the real gloo transport. Every run must equal the same training without
overlap bit for bit (the gathered values are the same; only the timing differs).
"""
import pytest
import torch

from megalite.distributed import mesh as mesh_lib
from megalite.data_parallel import DataParallel
from megalite.model import GPTModel, preset
from megalite.optim.distributed_optimizer import DistributedOptimizer
from megalite.testing import gathers_land_at_wait, run_distributed

STEPS, SEQ, MICRO = 3, 16, 2


def _config(flavour):
    name = "tiny" if flavour == "gpt2" else "tiny-llama"
    return preset(name, num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=SEQ, vocab_size=67)


def _batch(step, dp_rank, vocab):
    ids = torch.randint(0, vocab, (2 * MICRO, SEQ + 1), generator=torch.Generator().manual_seed(step))
    rows = ids[dp_rank * MICRO:(dp_rank + 1) * MICRO]
    return rows[:, :-1], rows[:, 1:]


def _train(m, flavour, zero, overlap):
    config = _config(flavour)
    model = DataParallel(GPTModel(config, m, seed=3), m, zero_stage=zero, bucket_size=300,
                         overlap_param_gather=overlap, dp_reduction="sum")
    optimizer = DistributedOptimizer(model, weight_decay=0.1, clip_grad=1.0)
    losses, in_flight = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        ids, labels = _batch(step, m.dp_rank, config.vocab_size)
        loss = model(ids, labels, reduction="sum") / (2 * MICRO * SEQ)  # right after the last step()
        loss.backward()
        optimizer.step(lr=1e-2)
        in_flight.append(len(model.param_buffer.pending))
        losses.append(float(loss))
    model.wait_for_params()
    return losses, in_flight, len(model.layout.buckets), [p.detach().clone() for p in model.params]


def _world(poisoned: bool):
    m = mesh_lib.init_mesh()
    out = {}
    for flavour in ("gpt2", "llama"):
        for zero in (1, 2):
            ref_losses, _, _, ref_params = _train(m, flavour, zero, overlap=False)
            if poisoned:
                with gathers_land_at_wait():
                    losses, in_flight, buckets, params = _train(m, flavour, zero, overlap=True)
            else:
                losses, in_flight, buckets, params = _train(m, flavour, zero, overlap=True)
            same = all(torch.equal(a, b) for a, b in zip(params, ref_params))
            out[(flavour, zero)] = dict(losses=losses, ref_losses=ref_losses, same_params=same,
                                        in_flight=in_flight, buckets=buckets)
    return out


@pytest.mark.parametrize("poisoned", [True, False], ids=["gathers-land-at-wait", "gloo"])
def test_forward_right_after_step_reads_only_gathered_parameters(poisoned):
    repeats = 1 if poisoned else 3
    for _ in range(repeats):
        for rank_out in run_distributed(_world, 2, poisoned, timeout_s=180):
            for (flavour, zero), r in rank_out.items():
                what = f"{flavour} zero {zero}"
                assert r["buckets"] >= 8, f"{what}: the test needs many buckets, got {r['buckets']}"
                assert min(r["in_flight"]) > 0, f"{what}: step() left no gather in flight: {r['in_flight']}"
                assert r["losses"] == r["ref_losses"], f"{what}: {r['losses']} != {r['ref_losses']}"
                assert r["same_params"], f"{what}: final parameters differ from the run without overlap"


def _pipeline_world():
    from megalite.pipeline import PipelineSpec, run_pipeline, stage_layers

    m = mesh_lib.init_mesh(pp=2)  # dp = 2
    config = _config("gpt2").replace(num_layers=4)
    spec = PipelineSpec("interleaved", 4, (SEQ, MICRO, config.hidden_size), torch.float32, virtual_stages=2)
    results = {}
    for overlap in (False, True):
        chunks = [GPTModel(config, m, seed=3, layer_ids=ids, pre_process=m.pp_rank == 0 and c == 0,
                           post_process=m.pp_rank == 1 and c == 1)
                  for c, ids in enumerate(stage_layers(config.num_layers, 2, 2, m.pp_rank))]
        model = DataParallel(chunks, m, zero_stage=1, bucket_size=300, overlap_param_gather=overlap,
                             dp_reduction="sum")
        optimizer = DistributedOptimizer(model)
        losses = []
        with gathers_land_at_wait():
            for step in range(STEPS):
                optimizer.zero_grad()
                model.set_last_microbatch(False)
                ids, labels = _batch(step, m.dp_rank, config.vocab_size)
                microbatches = [{"input_ids": ids, "labels": labels}] * 4
                losses.append(run_pipeline(spec, list(model.chunks), microbatches, m, 1.0 / (8 * MICRO * SEQ),
                                           grad_sync=model))
                optimizer.step(lr=1e-2)
                in_flight = len(model.param_buffer.pending)
        model.wait_for_params()
        results[overlap] = (losses, [p.detach().clone() for p in model.params], in_flight)
    same_params = all(torch.equal(a, b) for a, b in zip(results[False][1], results[True][1]))
    return results[False][0] == results[True][0], same_params, results[True][2]


def test_interleaved_pipeline_chunks_wait_for_their_own_gathers():
    # pp=2 x dp=2, two chunks per stage: the executor calls the chunks, the tied embedding is
    # reduced over the embedding group, and every chunk's reads wait for their own buckets.
    for same_losses, same_params, in_flight in run_distributed(_pipeline_world, 4, timeout_s=180):
        assert in_flight > 0, "step() left no gather in flight"
        assert same_losses and same_params
