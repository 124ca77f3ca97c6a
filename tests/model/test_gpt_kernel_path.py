"""The GPT computes the same loss and gradients on the Triton kernel path as on the PyTorch path.

On CPU the Triton kernels run in Triton's interpreter (MEGALITE_KERNEL_BACKEND=triton,
TRITON_INTERPRET=1); on a GPU `auto` picks them. Norms, activations, RoPE, attention and the
cross entropy all switch together (and, for the MoE model, the grouped GEMMs and the token permutes).
"""
import pytest
import torch

from megalite.kernels import HAVE_TRITON
from megalite.model import GPTModel, preset

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")


def _loss_and_grads(name, backend, monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", backend)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    llama = name in ("tiny-llama", "moe-tiny")
    cfg = preset(name, num_layers=1, hidden_size=32, num_attention_heads=2,
                 num_query_groups=1 if llama else None, ffn_hidden_size=48 if llama else None, vocab_size=40,
                 seq_length=8, moe=dict(num_experts=4, topk=2, ffn_hidden_size=16, aux_loss_coeff=1e-2,
                                        z_loss_coeff=1e-3) if name == "moe-tiny" else None)
    model = GPTModel(cfg, seed=5)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (1, 8), generator=gen)
    labels = torch.randint(0, 40, (1, 8), generator=gen)
    labels[0, 0] = -100
    loss = model(ids, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny", "tiny-llama", "moe-tiny"])  # moe-tiny: grouped GEMM, permute
def test_triton_path_matches_torch_path(name, monkeypatch):
    ref_loss, ref_grads = _loss_and_grads(name, "torch", monkeypatch)
    loss, grads = _loss_and_grads(name, "triton", monkeypatch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
