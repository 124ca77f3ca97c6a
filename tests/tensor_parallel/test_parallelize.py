"""parallelize(module, mesh, plan): transformers' models, unmodified, at tp 2 equal themselves at tp 1.

The tp 1 reference is the plain transformers model in the parent process (float32, every parameter
moved off its init); each rank parallelizes its own copy with the ready plan and compares its logits,
loss, every gradient shard (sliced by the parameter's ShardSpec) and the logits after one SGD step.
Quick tier: the plan matching and refusals (no processes). Slow tier: one 2-rank world checks the
families, with and without sequence parallelism.
"""
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from megalite.distributed import comm, mesh as mesh_lib  # noqa: E402
from megalite.parameters import params as P  # noqa: E402
from megalite.tensor_parallel.parallelize import Column, match_plan, parallelize  # noqa: E402
from megalite.tensor_parallel.plans import hf_plan  # noqa: E402
from megalite.tensor_parallel.sequence_parallel import unmarked_norm_problem  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402

VOCAB, LR = 320, 0.5
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=64, rms_norm_eps=1e-6)


def _model(family):
    config = {"llama": lambda: transformers.LlamaConfig(**_SMALL, attention_bias=True, tie_word_embeddings=True),
              "qwen3": lambda: transformers.Qwen3Config(**_SMALL, head_dim=12, tie_word_embeddings=False),
              "mixtral": lambda: transformers.MixtralConfig(**_SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                            tie_word_embeddings=False),
              "qwen2-moe": lambda: transformers.Qwen2MoeConfig(**_SMALL, num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=48,
                                                               shared_expert_intermediate_size=64,
                                                               tie_word_embeddings=False)}[family]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def _ids():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))


def _step(model, reduce=None):
    """(logits, loss, grads by name, logits after one SGD step)."""
    ids = _ids()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        if reduce is not None and P.is_sequence_parallel_grad(param):
            param.grad = reduce(param.grad)  # what the data-parallel wrapper does with partial gradients
        grads[name] = param.grad.detach().clone()
    torch.optim.SGD(model.parameters(), lr=LR).step()
    with torch.no_grad():
        after = model(input_ids=ids).logits
    return out.logits.detach(), out.loss.detach(), grads, after


def _parallel_families(cases, references, mesh):
    checked = []
    for family, sequence_parallel, *expert_split in cases:
        logits, loss, grads, after = references[family]
        model = parallelize(_model(family), mesh, hf_plan(_model(family), sequence_parallel, *expert_split))
        assert unmarked_norm_problem([model], 2) is None  # every norm declared: DataParallel takes the model
        got_logits, got_loss, got_grads, got_after = _step(model, lambda g: comm.all_reduce(g.clone(), mesh.tp_group))
        where = f"{family} sp={sequence_parallel}" + "".join(f" {split}" for split in expert_split)
        torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-5, msg=lambda s: f"{where} logits: {s}")
        torch.testing.assert_close(got_loss, loss, rtol=1e-5, atol=0, msg=lambda s: f"{where} loss: {s}")
        for name, param in model.named_parameters():
            want = P.shard_spec(param).shard(grads[name]) if P.shard_spec(param) else grads[name]
            torch.testing.assert_close(got_grads[name], want, rtol=1e-5, atol=1e-6, msg=lambda s: f"{where} {name}: {s}")
        torch.testing.assert_close(got_after, after, rtol=1e-5, atol=1e-5, msg=lambda s: f"{where} after step: {s}")
        sharded = sum(P.shard_spec(p).is_tp_sharded for p in model.parameters() if P.shard_spec(p))
        checked.append((where, len(got_grads), sharded))
    return checked


class _OldStyleAttention(nn.Module):
    """Attention that reshapes by its own head counts (as transformers' code before v5 did): under tp its
    num_heads / num_key_value_heads must become this rank's (the "heads" style)."""

    def __init__(self, hidden=32, heads=4, kv_heads=2):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.kv_proj = nn.Linear(hidden, 2 * kv_heads * self.head_dim)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x):  # [b, s, h]
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, s, 2, self.num_key_value_heads, self.head_dim).unbind(2)
        k, v = (t.transpose(1, 2).repeat_interleave(self.num_heads // self.num_key_value_heads, 1) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


_OLD_STYLE_PLAN = {"": "heads", "q_proj": "column", "o_proj": "row",
                   "kv_proj": Column(blocks=(16, 16))}  # [K; V] fused: each block split apart


def _old_style(mesh):
    torch.manual_seed(5)
    model = _OldStyleAttention()
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(6))
    if mesh is not None:
        model = parallelize(model, mesh, _OLD_STYLE_PLAN)
    return model(x).detach(), (model.num_heads, model.num_key_value_heads)


def _parallel(cases, references):
    mesh = mesh_lib.init_mesh(tp=2)
    expected, _ = references["old-style"]
    got, heads = _old_style(mesh)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert heads == (2, 1)
    return _parallel_families(cases, references, mesh)


@pytest.mark.slow
def test_unmodified_transformers_models_at_tp2_equal_tp1():
    """Llama (tied embedding and head, attention biases), Qwen3 (q/k norms see half the heads) and
    Mixtral (experts split along their width, or divided among the ranks whole), Qwen2-MoE (+ q/k/v biases, a gated shared expert): logits,
    loss, gradients and one step; SP for the dense ones."""
    references = {family: _step(_model(family)) for family in ("llama", "qwen3", "mixtral", "qwen2-moe")}
    references["old-style"] = _old_style(None)  # + attention code that reshapes by its head counts
    cases = [("llama", False), ("llama", True), ("qwen3", False), ("qwen3", True), ("mixtral", False),
             ("mixtral", False, "experts"), ("qwen2-moe", False)]
    reports = run_distributed(_parallel, 2, cases, references, timeout_s=300)
    # per layer: llama q,k,v,o + q,k,v biases + gate,up,down (its head tied to the embedding); qwen3 7 weights
    # and the head; mixtral q,k,v,o + stacked experts (2) and the head; + the embedding
    sharded = {"llama": 2 * 10 + 1, "qwen3": 2 * 7 + 2, "mixtral": 2 * 6 + 2, "qwen2-moe": 2 * 12 + 2}
    assert [(where, count) for where, _, count in reports[0]] == [
        (f"{family} sp={sp}" + "".join(f" {split}" for split in rest), sharded[family]) for family, sp, *rest in cases]


def test_the_plan_is_matched_by_glob_and_refusals_are_one_line():
    model = _model("qwen3")
    matched = match_plan(model, hf_plan(model))
    assert matched["model.layers.1.self_attn.q_proj"] == Column()
    assert matched["lm_head"] == Column(gather_output=True)
    assert matched["model.layers.0.self_attn.k_norm"].__class__.__name__ == "PartialGrad"
    assert "model.layers.0.mlp" not in matched  # only what a pattern names
    with pytest.raises(ValueError, match=r"plan patterns \['\*\.wq'\] match no module of Qwen3ForCausalLM"):
        match_plan(model, {"*.wq": "column"})
    with pytest.raises(ValueError, match="unknown style 'colwise'; choose from"):
        match_plan(model, {"*.q_proj": "colwise"})
    with pytest.raises(ValueError, match="sequence parallelism with experts is not planned"):
        hf_plan(_model("mixtral"), sequence_parallel=True)
    with pytest.raises(ValueError, match="replaces an nn.Linear, got Qwen3RMSNorm"):
        parallelize(model, None, {"model.norm": "column"})


def test_tp1_plan_changes_no_number():
    """Without a mesh (tp 1) the planned model is the same function, its layers megalite's."""
    reference = _step(_model("llama"))
    model = parallelize(_model("llama"), None, hf_plan(_model("llama")))
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "PlannedColumn"
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    got = _step(model)
    for expected, actual in zip(reference[:2] + reference[3:], got[:2] + got[3:]):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert isinstance(model.model.embed_tokens, nn.Module)
