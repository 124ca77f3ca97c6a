"""parallelize(module, mesh, plan) at tp 2 in the quick tier, without transformers: a small hand-built
model (a vocabulary-parallel embedding, attention that reshapes by its own head counts with K and V
fused in one Linear, a gated MLP with [gate; up] fused, a gathered head) equals itself at tp 1.

The tp 1 reference is the same module unplanned in the parent process (float32); each rank plans its
own copy and compares the logits, the loss, every gradient (its shard, by the parameter's ShardSpec)
and the logits after one SGD step. tests/tensor_parallel/test_parallelize.py does the same for
transformers' families (slow tier, the [hf] extra).
"""
import torch
import torch.nn.functional as F
from torch import nn

from megalite.distributed import mesh as mesh_lib
from megalite.parameters import params as P
from megalite.tensor_parallel.parallelize import Column, parallelize
from megalite.testing import run_distributed

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LR = 64, 32, 4, 2, 48, 0.5
HEAD_DIM = HIDDEN // HEADS


class _Attention(nn.Module):
    """Causal attention that reshapes by its own head counts (the "heads" style divides them by tp)."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.num_key_value_heads = HEADS, KV_HEADS
        self.q_proj = nn.Linear(HIDDEN, HIDDEN)
        self.kv_proj = nn.Linear(HIDDEN, 2 * KV_HEADS * HEAD_DIM)  # [K; V]
        self.o_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):  # [b, s, h] -> [b, s, h] (under tp: this rank's heads, o_proj sums over tp)
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, HEAD_DIM).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, s, 2, self.num_key_value_heads, HEAD_DIM).unbind(2)
        k, v = (t.transpose(1, 2).repeat_interleave(self.num_heads // self.num_key_value_heads, 1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * HEAD_DIM))


class _TinyDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = _Attention()
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN)  # [gate; up]
        self.down = nn.Linear(FFN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):  # [b, s] -> logits [b, s, V]
        x = self.embed(ids)
        x = x + self.attn(self.norm1(x))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)  # under tp: this rank's halves of each
        return self.head(x + self.down(F.silu(gate) * up))


PLAN = {"embed": "vocab", "attn": "heads", "attn.q_proj": "column", "attn.o_proj": "row",
        "attn.kv_proj": Column(blocks=(KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)),
        "gate_up": Column(blocks=(FFN, FFN)), "down": "row", "head": "column_gather"}


def _model():
    torch.manual_seed(0)
    model = _TinyDecoder()
    with torch.no_grad():  # every parameter off its init (biases and norms are not zeros and ones)
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    return model


def _step(model):
    """(logits, loss, grads by name, logits after one SGD step)."""
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    with torch.no_grad():
        after = model(ids)
    return logits.detach(), loss.detach(), grads, after


def _planned_at_tp2(reference):
    logits, loss, grads, after = reference
    model = parallelize(_model(), mesh_lib.init_mesh(tp=2), PLAN)
    assert (model.attn.num_heads, model.attn.num_key_value_heads) == (HEADS // 2, KV_HEADS // 2)
    got_logits, got_loss, got_grads, got_after = _step(model)
    torch.testing.assert_close(got_logits, logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    sharded = []
    for name, param in model.named_parameters():
        spec = P.shard_spec(param)
        torch.testing.assert_close(got_grads[name], spec.shard(grads[name]) if spec else grads[name], rtol=1e-5,
                                   atol=1e-6, msg=lambda s: f"{name}: {s}")
        if spec is not None and spec.is_tp_sharded:
            sharded.append(name)
    torch.testing.assert_close(got_after, after, rtol=1e-5, atol=1e-6)
    return sorted(sharded)


def test_a_hand_built_model_planned_at_tp2_equals_itself_at_tp1():
    reference = _step(_model())
    sharded = run_distributed(_planned_at_tp2, 2, reference)
    assert sharded[0] == sharded[1] == sorted(
        ["embed.weight", "attn.q_proj.weight", "attn.q_proj.bias", "attn.kv_proj.weight", "attn.kv_proj.bias",
         "attn.o_proj.weight", "gate_up.weight", "gate_up.bias", "down.weight", "head.weight"])
