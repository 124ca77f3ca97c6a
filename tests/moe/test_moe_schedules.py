"""MoE blocks in every pipeline stage under every schedule equal the single-process model (fp32, dropless).

A 4-layer MoE model (every block MoE) trains STEPS steps at pp 2 in one forked world of 4 ranks:
interleaved 1F1B (2 chunks per stage: every chunk is one MoE block) with ZeRO 1, ZB-H1 (the B pass
defers the dense linears' weight gradients to W; the router's and the experts' are computed in B)
at ep 2 and at ep 1 with ZeRO 1 (the experts then share the dense buckets, which reduce after the
chunk's last W), and GPipe; 1F1B is covered by test_moe_parallel.py. Each run's per-step loss and
grad norm (compared in the parent: torch.testing.assert_close's first call imports DTensor, seconds
in a fresh fork) and every parameter after the last step must match the single process to 1e-5 relative.
"""
import pytest
import torch

from megalite.distributed import mesh
from megalite.parameters import params as P
from megalite.distributed.mesh import single_process_mesh
from megalite.testing import assert_tensor_close, run_distributed
from megalite.training.launch_checks import launch_problems
from moe_helpers import cfg_for, train

LAYERS = 4
SCHEDULES = [  # (ep, settings) at pp 2, dp 2
    (2, dict(pipeline_schedule="interleaved", virtual_stages=2, zero=1)),
    (2, dict(pipeline_schedule="zb-h1")),
    (1, dict(pipeline_schedule="zb-h1", zero=1)),
    (2, dict(pipeline_schedule="gpipe")),
]


@pytest.fixture(scope="module")
def reference():
    m = single_process_mesh("cpu")
    chunks, _, results = train(m, cfg_for(num_layers=LAYERS))
    params = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in chunks[0].logical_parameters()}
    return [r.loss for r in results], [r.grad_norm for r in results], params


def _world(reference):
    ref_params = reference[2]
    seen = []
    for ep, settings in SCHEDULES:
        cfg = cfg_for(1, 2, 2, ep, num_layers=LAYERS, **settings)
        m = mesh.init_mesh(layout=cfg.layout(), replace=True)
        assert launch_problems(cfg.resolved(4), 4) == []
        what = f"ep={ep} {settings}"
        chunks, optimizer, results = train(m, cfg)
        with optimizer.model.gathered():
            for chunk in chunks:
                for logical, p in chunk.logical_parameters():
                    assert_tensor_close(p, P.shard_spec(p).shard(ref_params[logical]), rtol=1e-5,
                                        what=f"{what} {logical}")
        experts = sum(".experts." in n for c in chunks for n, _ in c.logical_parameters())
        seen.append(([r.loss for r in results], [r.grad_norm for r in results], len(chunks), experts,
                     sorted(results[-1].pipeline.compute_s)))
    return seen


def test_moe_blocks_in_every_stage_under_every_schedule(reference):
    ref_losses, ref_norms, _ = reference
    for seen in run_distributed(_world, 4, reference, timeout_s=300):
        for (ep, settings), (losses, norms, chunks, experts, kinds) in zip(SCHEDULES, seen, strict=True):
            torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0, msg=str(settings))
            torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0, msg=str(settings))
            assert chunks == settings.get("virtual_stages", 1)
            assert experts == LAYERS // 2 * 4 // ep * 2  # this stage's MoE blocks: its experts' fc1 and fc2
            zero_bubble = settings["pipeline_schedule"] == "zb-h1"
            assert ("BWD_WEIGHT" in kinds) == zero_bubble and ("BWD" in kinds) != zero_bubble, (settings, kinds)
