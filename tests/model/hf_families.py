"""Small transformers models of every family megalite converts, built from configs (no download),
float32, every parameter (biases and norm weights included) moved off its init so a mapping that
drops or swaps one shows in the logits. Shared by test_hf_families.py's quick and slow tests."""
import torch
import transformers

VOCAB, BATCH, SEQ = 301, 2, 24

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6)
_LLAMA3_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=64)  # head_dim 8: one frequency in each of its 3 regions

_DEEPSEEK = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                 tie_word_embeddings=False)
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
             beta_slow=1, mscale=0.9, mscale_all_dim=0.7)


def _configs():
    return {
        # Llama 3.2 1B/3B's shape of things: llama3 rope scaling, tied embeddings
        "llama3": transformers.LlamaConfig(**_COMMON, rope_parameters={**_LLAMA3_SCALING, "rope_theta": 10000.0},
                                           tie_word_embeddings=True),
        # Llama with attention and MLP biases and a head dim apart from hidden / heads
        "llama-bias": transformers.LlamaConfig(**_COMMON, attention_bias=True, mlp_bias=True, head_dim=12,
                                               tie_word_embeddings=False),
        "mistral": transformers.MistralConfig(**_COMMON, sliding_window=None, tie_word_embeddings=False),
        "qwen2": transformers.Qwen2Config(**_COMMON, tie_word_embeddings=False, use_sliding_window=False),
        "qwen3": transformers.Qwen3Config(**_COMMON, head_dim=12, tie_word_embeddings=False),
        "mixtral": transformers.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2,
                                              router_aux_loss_coef=0.0, tie_word_embeddings=False),
        "qwen3-moe": transformers.Qwen3MoeConfig(**_COMMON, head_dim=12, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=48, norm_topk_prob=False,
                                                 router_aux_loss_coef=0.0, tie_word_embeddings=False),
        # q/k/v biases, softmax over all experts without renormalising, a sigmoid-gated shared expert
        "qwen2-moe": transformers.Qwen2MoeConfig(**_COMMON, num_experts=4, num_experts_per_tok=2,
                                                 moe_intermediate_size=48, shared_expert_intermediate_size=64,
                                                 router_aux_loss_coef=0.0, tie_word_embeddings=False),
        # latent attention (a query latent, YaRN with mscale), a dense first block, sigmoid group routing with
        # the correction bias, scaled weights, a shared expert
        "deepseek-v3": transformers.DeepseekV3Config(**{**_COMMON, "num_key_value_heads": 8}, **_DEEPSEEK,
                                                     q_lora_rank=32, n_group=4, topk_group=2,
                                                     routed_scaling_factor=2.5, rope_parameters=_YARN),
        # V2: no query latent, softmax scores without renormalising, a group scored by its best expert
        "deepseek-v2": transformers.DeepseekV2Config(**{**_COMMON, "num_key_value_heads": 8}, **_DEEPSEEK,
                                                     q_lora_rank=None, n_group=4, topk_group=2,
                                                     topk_method="group_limited_greedy", routed_scaling_factor=1.5),
    }


FAMILIES = tuple(_configs())


def hf_model(family: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_configs()[family]).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():  # biases and norm weights too (they start at 0 / 1)
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
        for name, buffer in model.named_buffers():  # DeepSeek-V3's correction bias (it moves the choice)
            if name.endswith("e_score_correction_bias"):
                buffer.add_(0.05 * torch.randn(buffer.shape, generator=gen))
    return model


def inputs() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))


def megalite_labels(ids: torch.Tensor) -> torch.Tensor:
    """labels[:, i] = ids[:, i + 1]; the last position has no target (-100), as HF's shifted loss."""
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return labels


def reference(family: str, with_grads: bool = False):
    """(hf model, logits [b, s, V], mean loss over b*(s-1) targets, {HF name: grad} or None)."""
    model = hf_model(family)
    ids = inputs()
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    grads = None
    if with_grads:
        loss.backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return model, logits.detach(), loss.detach(), grads
