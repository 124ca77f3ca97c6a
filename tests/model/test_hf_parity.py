"""megalite loaded with a transformers model's weights gives the same logits (and loss).

The HF models are built from a config (nothing downloaded), in float32.
"""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megalite.distributed import comm, mesh  # noqa: E402
from megalite.model import from_hf  # noqa: E402
from megalite.model.hf import config_from_hf, full_state_to_hf, hf_to_full_state  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402


def _hf_model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=301, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "mixtral":  # 4 experts, top-2; every block a mixture of experts
        cfg = transformers.MixtralConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                         rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=2,
                                         tie_word_embeddings=False)
        model = transformers.MixtralForCausalLM(cfg)
    else:  # "llama3": the llama3-1b preset's differences, a tied head and rope theta 500000
        llama3 = kind == "llama3"
        cfg = transformers.LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                       rms_norm_eps=1e-6, rope_theta=500000.0 if llama3 else 10000.0,
                                       tie_word_embeddings=llama3)
        model = transformers.LlamaForCausalLM(cfg)
    return model.float().eval()


def _inputs():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 301, (2, 24), generator=gen)
    return ids


def _reference(kind):
    hf = _hf_model(kind)
    ids = _inputs()
    with torch.no_grad():
        out = hf(input_ids=ids)
    logits = out.logits  # [b, s, V]
    labels = ids[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 301), labels.reshape(-1))
    return hf, logits, loss


def _megalite_logits(kind, tp, hf, ref_logits, ref_loss, ep=1, etps=(1,)):
    for etp in etps:  # whole experts on each tp rank (1) or split over tp (tp); no experts: no difference
        experts = getattr(hf.config, "num_local_experts", None) or getattr(hf.config, "num_experts", None) or 0
        m = mesh.init_mesh(tp=tp, ep=ep, etp=etp, num_experts=experts, replace=True)
        model = from_hf(hf, m).eval()
        ids = _inputs()
        with torch.no_grad():
            shard = model(ids)  # [b, s, V_pad/tp]
            full = comm.all_gather(shard.contiguous(), m.tp_group, dim=-1)[..., :301]
            labels = torch.full_like(ids, -100)
            labels[:, :-1] = ids[:, 1:]
            loss = model(ids, labels)
        torch.testing.assert_close(full, ref_logits, rtol=1e-5, atol=2e-5, msg=f"etp={etp}")
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0, msg=f"etp={etp}")
    return True


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama3"])
def test_from_hf_logits_match_transformers(kind):
    hf, logits, loss = _reference(kind)
    for tp in (1, 2):
        assert all(run_distributed(_megalite_logits, tp, kind, tp, hf, logits, loss))


def test_from_hf_mixtral_logits_match_transformers_at_tp1_and_tp2_ep2():
    """tp 1, and (tp 2, ep 2) with whole experts on each tp rank (etp 1) and with experts split over tp (etp 2)."""
    hf, logits, loss = _reference("mixtral")
    assert all(run_distributed(_megalite_logits, 1, "mixtral", 1, hf, logits, loss))
    assert all(run_distributed(_megalite_logits, 4, "mixtral", 2, hf, logits, loss, ep=2, etps=(1, 2)))  # dp 2


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama3", "mixtral"])
def test_state_dict_round_trip(kind):
    hf = _hf_model(kind)
    config = config_from_hf(hf.config)
    hf_state = hf.state_dict()
    back = full_state_to_hf(hf_to_full_state(hf_state, config), config)
    for name, tensor in hf_state.items():
        if name.endswith(".attn.bias") or name.endswith("masked_bias"):  # GPT-2's causal-mask buffers
            continue
        assert torch.equal(back[name], tensor), name


def test_config_from_hf_carries_the_dropout_probabilities():
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.15, embd_pdrop=0.15, attn_pdrop=0.05)
    config = config_from_hf(gpt2)
    assert (config.hidden_dropout, config.attention_dropout) == (0.15, 0.05)
    assert config_from_hf(transformers.GPT2Config()).hidden_dropout == 0.1  # GPT-2's defaults: 0.1 everywhere
    with pytest.raises(ValueError, match="embd_pdrop=0.2 differs from resid_pdrop=0.1.*set both"):
        config_from_hf(transformers.GPT2Config(embd_pdrop=0.2))
    llama = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                     num_attention_heads=8, num_key_value_heads=4, attention_dropout=0.25)
    config = config_from_hf(llama)
    assert (config.hidden_dropout, config.attention_dropout) == (0.0, 0.25)
    hf = _hf_model("gpt2")
    hf.config.attn_pdrop = 0.3
    model = from_hf(hf)
    assert model.config.attention_dropout == 0.3 and model.config.hidden_dropout == 0.0
