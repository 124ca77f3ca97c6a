"""Sliding-window attention (--window-size; Mistral's sliding_window): an imported Mistral with a window
shorter than the sequence equals transformers' logits and loss, as do Qwen2 and Qwen3 with every layer
windowed; the window composes with packed
documents (each document alone, windowed); the planner's and the meter's attention span count it."""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
import hf_families as H  # noqa: E402

from megalite.config.model import attention_span  # noqa: E402
from megalite.model import GPTModel, preset  # noqa: E402
from megalite.model.hf import from_hf, to_hf  # noqa: E402

WINDOW = 7  # H.SEQ = 24 tokens: most queries lose keys


def _mistral(window):
    torch.manual_seed(0)
    config = transformers.MistralConfig(**H._COMMON, sliding_window=window, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    model = transformers.MistralForCausalLM(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(1)))
    return model


def test_mistral_with_a_window_equals_transformers():
    hf = _mistral(WINDOW)
    ids = H.inputs()
    with torch.no_grad():
        out = hf(ids, labels=ids)
        model = from_hf(hf).eval()
        assert model.config.window_size == WINDOW
        torch.testing.assert_close(model(ids)[..., :H.VOCAB], out.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(model(ids, H.megalite_labels(ids)), out.loss, rtol=1e-4, atol=0)
        unwindowed = GPTModel(model.config.replace(window_size=None)).eval()
        unwindowed.load_state_dict(model.state_dict())
        assert not torch.allclose(unwindowed(ids)[..., :H.VOCAB], out.logits, atol=1e-2)  # the window matters
    back = to_hf(model)  # exported as Mistral with its window, the same tensors
    assert type(back) is transformers.MistralForCausalLM and back.config.sliding_window == WINDOW
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def _qwen(family, max_window_layers):
    """Qwen2 or Qwen3 with use_sliding_window: transformers slides the layers from max_window_layers on."""
    config_class = transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config
    extra = {} if family == "qwen2" else dict(head_dim=12)
    torch.manual_seed(0)
    config = config_class(**H._COMMON, **extra, tie_word_embeddings=False, use_sliding_window=True,
                          sliding_window=WINDOW, max_window_layers=max_window_layers)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


@pytest.mark.parametrize("family", ["qwen2", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_qwen_with_every_layer_windowed_equals_transformers(family):
    """Every layer slides (max_window_layers 0): the window imports, equals transformers' logits, and
    exports back; no layer sliding (max_window_layers = the layers): no window; some layers: one line."""
    hf = _qwen(family, 0)
    ids = H.inputs()
    with torch.no_grad():
        model = from_hf(hf).eval()
        assert model.config.window_size == WINDOW
        torch.testing.assert_close(model(ids)[..., :H.VOCAB], hf(ids).logits, rtol=1e-4, atol=1e-4)
        unwindowed = GPTModel(model.config.replace(window_size=None)).eval()
        unwindowed.load_state_dict(model.state_dict())
        assert not torch.allclose(unwindowed(ids)[..., :H.VOCAB], hf(ids).logits, atol=1e-2)  # the window matters
    back = to_hf(model)
    assert back.config.layer_types == ["sliding_attention"] * H._COMMON["num_hidden_layers"]
    assert back.config.sliding_window == WINDOW
    assert from_hf(_qwen(family, H._COMMON["num_hidden_layers"])).config.window_size is None
    with pytest.raises(ValueError, match="a window on some layers only"):
        from_hf(_qwen(family, 1))


def test_window_within_packed_documents_equals_each_document_alone():
    cfg = preset("tiny-llama", num_layers=2, seq_length=16, window_size=4)
    model = GPTModel(cfg, seed=2).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    lengths = [3, 9, 4]  # shorter than, longer than and equal to the window
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=positions)
        start = 0
        for n in lengths:
            alone = model(ids[:, start:start + n])
            torch.testing.assert_close(packed[:, start:start + n], alone, rtol=1e-5, atol=1e-5)
            start += n


def test_attention_span_counts_documents_and_windows():
    assert attention_span(1024) == 1024  # PaLM's causal convention unchanged
    assert attention_span(1024, mean_document_length=256) == 256  # Σ len^2 / s
    # a window of 4 over 16 tokens: pairs 1 + 2 + 3 + 4 * 13 = 58 per 16 tokens
    assert attention_span(16, window=4) == pytest.approx(2 * 58 / 16 - 1)
    base = preset("tiny-llama")
    assert base.replace(window_size=32).flops_per_token() < base.flops_per_token()
    assert base.flops_per_token(mean_document_length=base.seq_length) == base.flops_per_token()
