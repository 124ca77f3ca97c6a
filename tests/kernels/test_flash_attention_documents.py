"""Packed documents and sliding windows in the flash-attention kernels (varlen), forward and backward,
against the PyTorch path (SDPA once per document), which is itself checked against a dense mask."""
import pytest
import torch
import torch.nn.functional as F

from kernel_testing import DEVICE, FLOAT_DTYPES, compare_with_reference, requires_triton, tolerance
from megalite.kernels import attention, attention_tiles
from megalite.kernels.attention_documents import DocumentMask, attention_documents_reference
from megalite.kernels.attention_dispatch import repeat_kv_heads
from megalite.kernels.attention_torch import attention_keep_mask

pytestmark = requires_triton

HALF_TOL = dict(fp16=1e-2, bf16=4e-2)


def positions(*samples: list[int]) -> torch.Tensor:
    """Restarting position ids [b, s] from each sample's document lengths."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in samples]).to(DEVICE)


def qkv(batch, heads, kv_heads, seq, dim, dtype):
    q = torch.randn(batch, seq, heads, dim, device=DEVICE, dtype=dtype).transpose(1, 2)  # strided, as the model's
    k = torch.randn(batch, kv_heads, seq, dim, device=DEVICE, dtype=dtype)
    v = torch.randn(batch, kv_heads, seq, dim, device=DEVICE, dtype=dtype)
    return q, k, v


def dense_reference(q, k, v, position_ids, window=None):
    """The mask written out as [b, s, s] (the tests only: the code never builds it)."""
    s = q.shape[2]
    rows = torch.arange(s, device=q.device)
    start = rows - position_ids
    if window is not None:
        start = torch.maximum(start, rows - window + 1)
    keep = (rows[None, None, :] <= rows[None, :, None]) & (rows[None, None, :] >= start[:, :, None])
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv_heads(k, group), repeat_kv_heads(v, group),
                                          attn_mask=keep[:, None])


# seq 37 (not a multiple of the interpreter's 16-row blocks): documents of 1 token, odd lengths, one
# crossing several blocks, and a sample that is one document filling the whole sequence
DOCUMENTS = ([1, 9, 16, 1, 10], [37])


@pytest.mark.parametrize("window", [None, 5])
def test_the_per_document_reference_equals_a_dense_mask(window):
    q, k, v = qkv(2, 4, 2, 37, 16, torch.float32)
    ids = positions(*DOCUMENTS)
    mask = DocumentMask.from_position_ids(ids, window)
    torch.testing.assert_close(attention_documents_reference(q, k, v, mask), dense_reference(q, k, v, ids, window),
                               atol=1e-6, rtol=1e-6)


SLOW = pytest.mark.slow  # the interpreter takes 3-8 s a case: one case stays in the quick tier


CASES = [(torch.float32, 7)] + [pytest.param(dtype, window, marks=SLOW) for dtype, window in
                                ((torch.float32, None), *((d, w) for d in FLOAT_DTYPES[1:] for w in (None, 7)))]


@pytest.mark.parametrize("dtype, window", CASES)
def test_varlen_kernels_match_the_reference(dtype, window):
    q, k, v = qkv(2, 4, 2, 37, 32, dtype)
    mask = DocumentMask.from_position_ids(positions(*DOCUMENTS), window)
    compare_with_reference(lambda *t: attention(*t, documents=mask),
                           lambda *t: attention_documents_reference(*t, mask), [q, k, v],
                           tolerance(dtype, fp32=2e-5, **HALF_TOL), ref_dtype=torch.float32)


@SLOW
def test_dropout_within_documents_and_a_forced_fused_backward(monkeypatch):
    """Dropout draws the Philox mask of the whole [s, s] scores and keeps it where the documents are;
    a forced fused backward runs split with documents (fused spilled at d=128)."""
    monkeypatch.setenv(attention_tiles.BACKWARD_ENV, "fused")
    q, k, v = qkv(2, 4, 2, 37, 16, torch.float16)
    mask = DocumentMask.from_position_ids(positions(*DOCUMENTS), window=11)
    extra = dict(dropout_p=0.2, dropout_seed=77, dropout_offset=5)
    rows = torch.arange(37, device=DEVICE)
    start = rows - mask.position_ids
    start = torch.maximum(start, rows - 10)
    keep = (rows[None, None, :] <= rows[None, :, None]) & (rows[None, None, :] >= start[:, :, None])  # [b, s, s]

    def dense_dropout(q, k, v):  # the dropout reference with the documents' mask added to its scores
        scores = (q @ repeat_kv_heads(k, 2).transpose(-1, -2)) / 4.0  # head dim 16
        scores = scores.masked_fill(~keep[:, None], float("-inf"))
        drop = attention_keep_mask(77, 5, 2, 4, 37, 0.2, DEVICE)
        return (scores.softmax(-1) * drop / 0.8) @ repeat_kv_heads(v, 2)

    compare_with_reference(lambda *t: attention(*t, documents=mask, **extra), dense_dropout, [q, k, v],
                           tolerance(torch.float16, **HALF_TOL), ref_dtype=torch.float32)


@SLOW
def test_sliding_window_without_documents_and_a_document_longer_than_a_block():
    q, k, v = qkv(1, 2, 1, 45, 16, torch.float32)
    window = DocumentMask.sliding_window(1, 45, 19, device=DEVICE)
    compare_with_reference(lambda *t: attention(*t, documents=window),
                           lambda *t: dense_reference(*t, window.position_ids, 19), [q, k, v],
                           tolerance(torch.float32, fp32=2e-5))
    long_documents = DocumentMask.from_position_ids(positions([3, 40, 2]))
    compare_with_reference(lambda *t: attention(*t, documents=long_documents),
                           lambda *t: attention_documents_reference(*t, long_documents), [q, k, v],
                           tolerance(torch.float32, fp32=2e-5))


def test_mask_tables_from_position_ids():
    mask = DocumentMask.from_position_ids(positions([2, 1, 3]), window=2)
    assert mask.key_start.tolist() == [[0, 0, 2, 3, 3, 4]]
    assert mask.query_end.tolist() == [[2, 2, 3, 5, 6, 6]]
    assert mask.document_lengths() == [[2, 1, 3]]
    assert int(mask.visible_pairs()) == 1 + 2 + 1 + 1 + 2 + 2


def test_a_mask_of_the_wrong_shape_is_refused():
    q, k, v = qkv(1, 2, 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="document mask is \\[1, 9\\]"):
        attention(q, k, v, documents=DocumentMask.from_position_ids(positions([9])))
    with pytest.raises(ValueError, match="need causal attention"):
        attention(q, k, v, causal=False, documents=DocumentMask.from_position_ids(positions([8])))
