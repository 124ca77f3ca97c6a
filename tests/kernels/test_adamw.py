"""Fused AdamW step vs torch.optim.AdamW over several steps."""
import pytest
import torch

from kernel_testing import DEVICE, requires_triton
from megalite.kernels import adamw_step


@requires_triton
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_adamw_step_matches_torch_adamw(grad_dtype):
    n = 5000  # not a multiple of the 2048-element block
    hyper = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    param = torch.randn(n, device=DEVICE)
    exp_avg, exp_avg_sq = torch.zeros(n, device=DEVICE), torch.zeros(n, device=DEVICE)
    torch_param = param.clone().requires_grad_()
    optimizer = torch.optim.AdamW([torch_param], foreach=False, **hyper)
    for step in range(1, 4):
        grad = torch.randn(n, device=DEVICE).to(grad_dtype)
        torch_param.grad = grad.float()
        optimizer.step()
        adamw_step(param, grad, exp_avg, exp_avg_sq, hyper["lr"], *hyper["betas"], hyper["eps"],
                   hyper["weight_decay"], step)
        state = optimizer.state[torch_param]
        torch.testing.assert_close(exp_avg, state["exp_avg"], atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], atol=1e-7, rtol=1e-6)
        torch.testing.assert_close(param, torch_param.detach(), atol=1e-7, rtol=1e-6)
    assert not torch.equal(param, torch_param.detach() * 0)  # it moved


def test_adamw_step_rejects_bad_buffers():
    p = torch.zeros(10, device=DEVICE)
    with pytest.raises(TypeError, match="contiguous float32"):
        adamw_step(p.half(), p, p.clone(), p.clone(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(ValueError, match="steps count from 1"):
        adamw_step(p, p.clone(), p.clone(), p.clone(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 0)
    with pytest.raises(ValueError, match="exp_avg has 9 elements"):
        adamw_step(p, p.clone(), torch.zeros(9, device=DEVICE), p.clone(), 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
