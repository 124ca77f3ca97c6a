"""The planner's activation bytes of a block with multi-head latent attention (megalite/plan/mla.py)
against what megalite's MLA block keeps on CPU (saved-tensor hooks, per layer: a 2-block model minus a
1-block one), fp32 and bf16, with and without a query latent, no recompute and full recompute.
The planner counts the output projection's input as a copy of SDPA's output (CUDA's kernels write
[b, n, s, d_v]); torch's CPU kernel writes q's layout, so the CPU block keeps exactly that copy less."""
import pytest
import torch

from megalite.config.model import GPTConfig
from megalite.model.activation_probe import kernels_without_launch
from megalite.model.gpt import GPTModel
from megalite.plan import activations as A
from megalite.testing import run_distributed
from test_estimate import run, saved_tensor_bytes

MLA = dict(q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=24)
BATCH, SEQ, HEADS = 8, 16, 4


def _config(layers: int, q_lora_rank) -> GPTConfig:
    return GPTConfig(flavour="llama", num_layers=layers, hidden_size=64, num_attention_heads=HEADS, vocab_size=60,
                     seq_length=SEQ, mla={**MLA, "q_lora_rank": q_lora_rank})


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
                cpu_layout_copy = 0 if recompute == "full" else dtype.itemsize * BATCH * SEQ * HEADS * MLA["v_head_dim"]
                assert kept[1] - kept[0] == planned - cpu_layout_copy, (recompute, precision)


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
        assert kept == planned - 4 * BATCH * SEQ * HEADS * MLA["v_head_dim"] // 2, sequence_parallel
