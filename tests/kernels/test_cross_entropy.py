"""Online-softmax cross entropy kernels vs F.cross_entropy (single device; see
test_vocab_parallel_cross_entropy.py for the tensor-parallel form on real gloo ranks)."""
import os
import subprocess
import sys

import pytest
import torch

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, gpu_only, requires_triton, tolerance
from megalite.kernels import cross_entropy, cross_entropy_reference, vocab_parallel_cross_entropy

pytestmark = requires_triton


def make_targets(shape, vocab, ignore_index=-100):
    targets = torch.randint(0, vocab, shape, device=DEVICE)
    flat = targets.view(-1)
    flat[0], flat[1], flat[2] = ignore_index, 0, vocab - 1  # ignored, first and last column
    return targets


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cross_entropy_matches_reference_across_vocab_chunks(dtype):
    # vocab 1000 = one full 512-column chunk + a partial one in the interpreter; strided logits
    logits = torch.randn(3, 5, 1000, device=DEVICE, dtype=dtype).transpose(0, 1) * 4
    targets = make_targets((5, 3), 1000)
    losses = compare_with_reference(cross_entropy, cross_entropy_reference, [logits, targets],
                                    tolerance(dtype, fp16=1e-3), ref_dtype=torch.float32,
                                    # softmax entries are ~1e-3 here: absolute slack far below them
                                    grad_tol=dict(atol=1e-6 if dtype == torch.float32 else 1e-5,
                                                  rtol=tolerance(dtype)["rtol"]))
    assert losses.dtype == torch.float32
    assert losses.view(-1)[0] == 0  # ignored token


def test_cross_entropy_custom_ignore_index_and_int32_targets():
    logits = torch.randn(11, 37, device=DEVICE)
    targets = make_targets((11,), 37, ignore_index=5).to(torch.int32)
    targets[3] = 5
    losses = compare_with_reference(lambda x, t: cross_entropy(x, t, ignore_index=5),
                                    lambda x, t: cross_entropy_reference(x, t.long(), ignore_index=5),
                                    [logits, targets], tolerance(torch.float32))
    assert losses[0] == 0 and losses[3] == 0


def test_single_process_vocab_parallel_excludes_padding_columns():
    logits = torch.randn(4, 2, 700, device=DEVICE) * 3  # 700 columns, of which the vocabulary is 650
    targets = make_targets((4, 2), 650)
    compare_with_reference(lambda x, t: vocab_parallel_cross_entropy(x, t, 0, None, vocab_size=650),
                           lambda x, t: cross_entropy_reference(x[..., :650], t), [logits, targets],
                           tolerance(torch.float32))


# A target outside the vocabulary, in a fresh process: on a GPU the range check is a device-side assert
# (torch._assert_async), which leaves the CUDA context unusable, so in this process it would turn every
# later kernel test into an error. On the CPU it raises the ValueError at once.
_OUT_OF_RANGE_CHILD = """
import sys, torch
from megalite.kernels import cross_entropy
device = torch.device(sys.argv[1])
cross_entropy(torch.randn(3, 10, device=device), torch.tensor([1, 10, 2], device=device))
if device.type == "cuda":
    torch.cuda.synchronize()  # the device-side assert surfaces here
print("no error")
"""


def _out_of_range_in_fresh_process(device: torch.device) -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGALITE_KERNEL_BACKEND="triton")
    return subprocess.run([sys.executable, "-c", _OUT_OF_RANGE_CHILD, str(device)], env=env, capture_output=True,
                          text=True, timeout=240)


def test_cross_entropy_rejects_out_of_range_targets():
    logits = torch.randn(3, 10, device=DEVICE)
    with pytest.raises(ValueError, match="targets have shape"):  # a host-side check: safe in this process
        cross_entropy(logits, torch.tensor([1, 2], device=DEVICE))
    if DEVICE.type == "cuda":
        result = _out_of_range_in_fresh_process(DEVICE)
        assert result.returncode != 0 and "no error" not in result.stdout, result.stdout + result.stderr[-2000:]
        assert "device-side assert" in result.stderr, result.stderr[-2000:]
        return
    with pytest.raises(ValueError, match="outside \\[0, 10\\)"):
        cross_entropy(logits, torch.tensor([1, 10, 2], device=DEVICE))


@pytest.mark.slow
def test_out_of_range_child_fails_on_cpu_too():
    """The fresh-process check itself, exercised here on the CPU (the GPU runs it for real): the child
    must fail naming the bad target, not print "no error"."""
    result = _out_of_range_in_fresh_process(torch.device("cpu"))
    assert result.returncode != 0 and "no error" not in result.stdout, result.stdout
    assert "outside [0, 10)" in result.stderr, result.stderr[-2000:]


@gpu_only
def test_cross_entropy_large_vocab_bf16():
    logits = torch.randn(2048, 128256, device=DEVICE, dtype=torch.bfloat16) * 2
    targets = make_targets((2048,), 128256)
    compare_with_reference(cross_entropy, cross_entropy_reference, [logits, targets], tolerance(torch.float32, 1e-4),
                           ref_dtype=torch.float32, grad_tol=dict(atol=1e-6, rtol=1.6e-2))
