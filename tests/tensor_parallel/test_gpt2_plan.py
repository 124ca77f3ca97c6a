"""hf_plan for transformers' GPT-2 (issue 49 item 13): the unmodified GPT2LMHeadModel at tp 2 (Conv1D layers,
[q; k; v] fused, the head tied to the embedding) equals itself at tp 1 in logits, loss, every gradient shard
and the logits after one SGD step."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from megalite.distributed import mesh as mesh_lib  # noqa: E402
from megalite.parameters import params as P  # noqa: E402
from megalite.tensor_parallel.parallelize import parallelize  # noqa: E402
from megalite.tensor_parallel.plans import hf_plan  # noqa: E402
from megalite.testing import run_distributed  # noqa: E402

VOCAB = 96


def _gpt2():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every parameter off its init (biases and norms included)
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def _step(model):
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    with torch.no_grad():
        after = model(input_ids=ids).logits
    return out.logits.detach(), out.loss.detach(), grads, after


def _tp2(reference):
    mesh = mesh_lib.init_mesh(tp=2)
    model = parallelize(_gpt2(), mesh, hf_plan(_gpt2()))
    logits, loss, grads, after = _step(model)
    want_logits, want_loss, want_grads, want_after = reference
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    sharded = []
    for name, param in model.named_parameters():
        spec = P.shard_spec(param)
        want = want_grads[name]
        if "c_attn" in name or ("c_fc" in name or "c_proj" in name) and name.endswith("weight"):
            want = want.t() if want.dim() == 2 else want  # Conv1D's [in, out] -> the layer's [out, in]
        want = spec.shard(want) if spec else want
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=lambda s: f"{name}: {s}")
        if spec and spec.is_tp_sharded:
            sharded.append(name)
    torch.testing.assert_close(after, want_after, rtol=1e-5, atol=1e-5)
    return sharded


def test_gpt2_at_tp2_equals_tp1():
    sharded = run_distributed(_tp2, 2, _step(_gpt2()), timeout_s=120)[0]
    # per block: c_attn weight + bias, c_fc weight + bias, the two c_proj weights; + the tied wte / lm_head
    assert len(sharded) == 2 * 6 + 1 and "transformer.wte.weight" in sharded


def test_gpt2_plan_refusals():
    with pytest.raises(ValueError, match="gpt2: sequence parallelism"):
        hf_plan(_gpt2(), sequence_parallel=True)
    with pytest.raises(ValueError, match="plans exist for gpt2, llama"):
        hf_plan(torch.nn.Linear(2, 2))
