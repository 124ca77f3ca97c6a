"""Greedy generation over the KV cache equals transformers' `generate`, token for token.

Llama (3.x: llama3 rope scaling, tied embeddings), Qwen3 (q/k norms, head_dim apart from hidden /
heads), Mixtral (experts), DeepSeek-V3 and V2 (latent attention: each head's key and value cached, d_qk
!= d_v, YaRN's softmax scale; group-limited routing) and Mistral with a sliding window, each built from a small config (tests/model/hf_families.py, nothing
downloaded, matrices scaled so that the continuation varies) and imported with from_hf; two prompts of
different lengths in one batch (left padding), at tp 1 and at tp 2 in a 2-rank gloo world. The check
can fail: a padded slot attended to changes the tokens (test_the_check_can_fail_...).
"""
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "model"))
import hf_families as H  # noqa: E402

from megalite.distributed import mesh as mesh_lib  # noqa: E402
from megalite.generation import SamplingParams, generate  # noqa: E402
from megalite.generation.generate import left_padded  # noqa: E402
from megalite.model.hf import from_hf  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402

FAMILIES = ("llama3", "qwen3", "mixtral", "deepseek-v3", "deepseek-v2")
QUICK_TP1 = ("llama3", "qwen3", "mixtral")  # DeepSeek's in the quick tier at tp 2
QUICK_TP2 = ("qwen3", "deepseek-v3")  # one 2-rank world of fused and one of latent attention
PROMPTS = [[5, 17, 200, 3, 99, 42, 7], [250, 1, 64]]
NEW = 12


def sharpened(hf):
    """`hf` with its matrices x8: random weights at their init scale repeat one token, and a check over a
    constant continuation would prove little."""
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() >= 2:
                param.mul_(8.0)
    return hf


def hf_model(family):
    """hf_families' model, sharpened."""
    return sharpened(H.hf_model(family))


def transformers_tokens(hf, prompts, new=NEW):
    """transformers' greedy continuation of each (left-padded) prompt."""
    ids, valid = left_padded(prompts, 0, "cpu")
    hf.generation_config.eos_token_id = None  # exactly `new` tokens, as megalite below
    out = hf.generate(input_ids=ids, attention_mask=valid.long(), max_new_tokens=new, min_new_tokens=new,
                      do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in QUICK_TP1 else pytest.mark.slow)
                                    for f in FAMILIES])
def test_greedy_equals_transformers_generate_at_tp1(family):
    hf = hf_model(family)
    expected = transformers_tokens(hf, PROMPTS)
    assert all(len(set(row)) > NEW // 2 for row in expected)  # a varied continuation, not one token repeated
    model = from_hf(hf)
    assert generate(model, PROMPTS, max_new_tokens=NEW) == expected
    alone = generate(model, PROMPTS[1:], max_new_tokens=NEW)  # no padding: the same tokens as in the batch
    assert alone == expected[1:]


def _tp2(family):
    mesh_lib.init_mesh(tp=2, etp=2)  # experts split over tp like the dense MLP: every rank routes every token
    hf = hf_model(family)
    streamed = []
    tokens = generate(from_hf(hf), PROMPTS, max_new_tokens=NEW,
                      on_tokens=lambda step, t, live: streamed.append(t.tolist()))
    return tokens, transformers_tokens(hf, PROMPTS), [list(r) for r in zip(*streamed)]


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in QUICK_TP2 else pytest.mark.slow)
                                    for f in FAMILIES])
def test_greedy_equals_transformers_generate_at_tp2(family):
    for tokens, expected, streamed in run_distributed(_tp2, 2, family):
        assert tokens == expected == streamed


def test_greedy_with_a_sliding_window_equals_transformers_generate():
    """Mistral's window of 4 over prompts of 7 and 3 tokens and 12 new ones: the prefill's queries and every
    decoded token lose keys; without the window the tokens differ (the check can fail)."""
    config = transformers.MistralConfig(**H._COMMON, sliding_window=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = sharpened(transformers.MistralForCausalLM(config).float().eval())
    expected = transformers_tokens(hf, PROMPTS)
    model = from_hf(hf)
    assert model.config.window_size == 4
    assert generate(model, PROMPTS, max_new_tokens=NEW) == expected
    assert generate(model, PROMPTS[1:], max_new_tokens=NEW) == expected[1:]
    model.config.window_size = None
    assert generate(model, PROMPTS, max_new_tokens=NEW) != expected


def test_the_check_can_fail_when_padding_is_attended_to():
    """The padded row with its padding read as tokens (what a cache ignoring `valid` computes) differs."""
    hf = hf_model("llama3")
    expected = transformers_tokens(hf, PROMPTS)
    pads = len(PROMPTS[0]) - len(PROMPTS[1])
    attended = generate(from_hf(hf), [PROMPTS[0], [0] * pads + PROMPTS[1]], max_new_tokens=NEW)
    assert attended[0] == expected[0] and attended[1] != expected[1]


def test_eos_ends_a_row_and_sampling_is_seeded():
    model = from_hf(hf_model("qwen3"))
    greedy = generate(model, PROMPTS, max_new_tokens=NEW)
    eos = greedy[1][3]
    stopped = generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=eos)
    assert stopped[1] == greedy[1][:greedy[1].index(eos) + 1]
    sampled = [generate(model, PROMPTS, max_new_tokens=NEW, params=SamplingParams(temperature=1.0, top_k=20, top_p=0.9,
                                                                                  seed=s)) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]
    assert generate(model, PROMPTS, max_new_tokens=NEW, params=SamplingParams(temperature=1.0, top_k=1)) == greedy


def test_gpt2_positions_start_at_each_rows_first_token():
    """GPT-2's learned position table is absolute: the padded row reads rows 0.. of it from its first real
    token, as transformers' generate does with an attention mask."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=301, n_positions=64, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=None, bos_token_id=None)
    hf = sharpened(transformers.GPT2LMHeadModel(config).eval())
    expected = transformers_tokens(hf, PROMPTS)
    model = from_hf(hf)
    assert generate(model, PROMPTS, max_new_tokens=NEW) == expected
    assert generate(model, PROMPTS[1:], max_new_tokens=NEW) == expected[1:]
