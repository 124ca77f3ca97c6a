"""Backend selection, poisoning, and importing megalite.kernels without triton."""
import os
import subprocess
import sys

import pytest
import torch

from kernel_testing import DEVICE, requires_triton
from megalite.kernels import dispatch, rms_norm, rms_norm_reference


def test_backend_env_is_validated(monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "cuda")
    with pytest.raises(ValueError, match="choose one of \\('auto', 'triton', 'torch'\\)"):
        rms_norm(torch.randn(2, 4), torch.ones(4))


def test_auto_uses_the_reference_on_cpu_and_torch_always(monkeypatch):
    x = torch.randn(2, 4, requires_grad=True)
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "auto")
    assert not dispatch.use_triton(x)
    monkeypatch.setenv("MEGALITE_KERNEL_BACKEND", "torch")
    assert not dispatch.use_triton(x.to(DEVICE))
    assert rms_norm(x, torch.ones(4)).grad_fn.name() != "_RMSNormFunctionBackward"


@requires_triton
def test_triton_on_cpu_without_interpreter_says_how_to_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        rms_norm(torch.randn(2, 4), torch.ones(4))


@requires_triton
def test_triton_backend_runs_the_kernel():
    x = torch.randn(3, 6, device=DEVICE, requires_grad=True)
    y = rms_norm(x, torch.ones(6, device=DEVICE))
    assert y.grad_fn.name() == "_RMSNormFunctionBackward"
    torch.testing.assert_close(y, rms_norm_reference(x, torch.ones(6, device=DEVICE)))


def test_poisoned_outputs_start_as_nan(monkeypatch):
    assert torch.isnan(dispatch.new_output((3,), torch.float16, torch.device("cpu"))).all()
    assert (dispatch.new_output((3,), torch.int64, torch.device("cpu")) == -1).all()


def test_import_and_references_work_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
            "import torch, megalite.kernels as k\n"
            "assert not k.HAVE_TRITON\n"
            "x = torch.randn(3, 8, requires_grad=True)\n"
            "k.rms_norm(x, torch.ones(8)).sum().backward()\n"
            "q = torch.randn(1, 2, 5, 8)\n"
            "assert k.attention(q, q, q).shape == q.shape\n"
            "print('ok')\n")
    env = {key: v for key, v in os.environ.items() if key != "MEGALITE_KERNEL_BACKEND"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
