"""The planner's activation bytes of a block with multi-head latent attention (megalite/plan/mla.py)
against what megalite's MLA block keeps on CPU (saved-tensor hooks, per layer: a 2-block model minus a
1-block one), fp32 and bf16, with and without a query latent, no recompute and full recompute, to the
byte; and on the meta device (what --simulate runs: CUDA's memory-efficient SDPA kernel, by name), where
the kernel keeps two int64 scalars (its dropout seed and offset) beside."""
import pytest
import torch

from megalite.config.model import GPTConfig
from megalite.model.activation_probe import kernels_without_launch
from megalite.model.gpt import GPTModel
from megalite.plan import activations as A
from megalite.simulate.memory import MemoryTracker
from megalite.testing import run_distributed
from test_estimate import run, saved_tensor_bytes

MLA = dict(q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=24)
BATCH, SEQ, HEADS = 8, 16, 4
META_SEQ = 32  # the memory-efficient kernel's log-sum-exp rows are a multiple of 32


def _config(layers: int, q_lora_rank, seq: int = SEQ) -> GPTConfig:
    return GPTConfig(flavour="llama", num_layers=layers, hidden_size=64, num_attention_heads=HEADS, vocab_size=60,
                     seq_length=seq, mla={**MLA, "q_lora_rank": q_lora_rank})


@pytest.mark.parametrize("q_lora_rank", [48, pytest.param(None, marks=pytest.mark.slow)])
def test_latent_attention_bytes_match_what_the_block_keeps(q_lora_rank):
    with kernels_without_launch():
        for recompute in ("none", "full"):
            for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                kept = []
                for layers in (1, 2):
                    torch.manual_seed(0)
                    model = GPTModel(_config(layers, q_lora_rank), recompute=recompute, dtype=dtype)
                    kept.append(saved_tensor_bytes(model, BATCH, SEQ)[0])
                layout = run(micro_batch_size=BATCH, recompute=recompute, precision=precision)
                planned = A.layer_activation_bytes(_config(2, q_lora_rank), layout, attention="sdpa")
                assert kept[1] - kept[0] == planned, (recompute, precision)


def _tensor_parallel_world(layouts):
    from megalite.distributed.mesh import init_mesh

    mesh = init_mesh(tp=2)
    out = []
    with kernels_without_launch():
        for sequence_parallel in layouts:
            kept = []
            for layers in (1, 2):
                torch.manual_seed(0)
                model = GPTModel(_config(layers, 48), mesh, sequence_parallel=sequence_parallel)
                kept.append(saved_tensor_bytes(model, BATCH, SEQ)[0])
            out.append(kept[1] - kept[0])
    return out


def test_latent_attention_bytes_under_tp_and_sp():
    """At tp 2 the heads' terms halve; under SP the norms', latents' and linear inputs' do too (the
    replicated down-projections see this rank's tokens only), and the RoPE key's gather is not kept."""
    layouts = (False, True)
    ranks = run_distributed(_tensor_parallel_world, 2, layouts)
    assert ranks[0] == ranks[1]
    for sequence_parallel, kept in zip(layouts, ranks[0]):
        layout = run(tp=2, sequence_parallel=sequence_parallel, micro_batch_size=BATCH)
        planned = A.layer_activation_bytes(_config(2, 48), layout, attention="sdpa")
        assert kept == planned, sequence_parallel


def _meta_kept_per_layer(batch: int, dtype: torch.dtype) -> int:
    """Saved bytes of one MLA block on the meta device, as --simulate runs it (a 2-block model minus a 1-block one)."""
    kept = []
    for layers in (1, 2):
        tracker = MemoryTracker()
        with kernels_without_launch(), torch.device("meta"), tracker.active():
            torch.manual_seed(0)
            model = GPTModel(_config(layers, 48, META_SEQ), dtype=dtype).train()
            tracker.exclude_from_activations(list(model.parameters()) + list(model.buffers()))
            ids = torch.zeros(batch, META_SEQ, dtype=torch.long)
            model(ids, ids)
            kept.append(tracker.saved.live)
    return kept[1] - kept[0]


@pytest.mark.parametrize("batch", [1, 2])
def test_latent_attention_bytes_on_the_meta_device(batch):
    """On the meta device latent attention runs CUDA's choice for d_qk != d_v (the memory-efficient kernel,
    ops.latent_attention), never the math path's [b, n, s, s] scores: what it keeps is the planner's count and
    the kernel's two int64 scalars (its dropout seed and offset; on CUDA host tensors). The kernel pads its
    log-sum-exp to a multiple of 32 rows, so the sequence here is one."""
    for dtype, precision in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        planned = A.layer_activation_bytes(_config(2, 48, META_SEQ), run(micro_batch_size=batch, precision=precision))
        assert _meta_kept_per_layer(batch, dtype) == planned + 2 * 8, precision
