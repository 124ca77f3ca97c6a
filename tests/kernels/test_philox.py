"""The PyTorch Philox that regenerates dropout masks on CPU is Random123's Philox-4x32-10 and
gives exactly Triton's tl.randint words (int64 counters, across the 2^32 boundary)."""
import pytest
import torch

from kernel_testing import DEVICE, requires_triton
from megalite.kernels.dispatch import runnable, tl, triton
from megalite.kernels.philox import drop_threshold, keep_mask, philox4x32, philox_word

# Random123's known-answer vectors (kat_vectors): counter words, key words, output words.
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_philox4x32_10_known_answers(counter, key, expected):
    words = philox4x32(key[0] | key[1] << 32, *(torch.tensor([c]) for c in counter))
    assert [int(w) for w in words] == list(expected)


@triton.jit
def _randint_kernel(OUT, seed, first, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    word = tl.randint(seed, first + offs.to(tl.int64))
    tl.store(OUT + offs, word.to(tl.int64), mask=offs < n)


@requires_triton
@pytest.mark.parametrize("seed,first", [(0, 0), (2 ** 62 + 77, 2 ** 32 - 50), (12345, 5 * 2 ** 33 + 3)])
def test_torch_philox_equals_triton_randint(seed, first):
    n = 100
    out = torch.full((n,), -1, dtype=torch.int64, device=DEVICE)
    runnable(_randint_kernel, out.device)[(triton.cdiv(n, 64),)](out, seed, first, n, BLOCK=64)
    expected = philox_word(seed, torch.arange(first, first + n, device=DEVICE))
    assert torch.equal(out, expected)


def test_drop_threshold_and_keep_fraction():
    assert drop_threshold(0.0) == 0 and drop_threshold(0.5) == 2 ** 31
    assert drop_threshold(0.999999999999) == 2 ** 32 - 1
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match=r"in \[0, 1\)"):
            drop_threshold(bad)
    mask = keep_mask(7, 3, (200, 100), 0.1)
    assert mask.shape == (200, 100)
    assert abs(mask.float().mean().item() - 0.9) < 0.01  # 20000 draws: std of the mean 0.002
    assert torch.equal(mask.flatten()[10:], keep_mask(7, 13, (19990,), 0.1))  # element i = counter offset + i
