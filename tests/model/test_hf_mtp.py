"""DeepSeek-V3's MTP weights through transformers: a checkpoint's extra layers (model.layers.{L}.* for L >=
num_hidden_layers) map to megalite's depths and back (megalite/model/hf_deepseek.py), and the imported depths
give the per-depth losses of transformers' own MTP module (`MtpModel`, built beside a small DeepSeek-V3 with
random weights; no download), run the report's way: depth k on the T-k positions that have both tokens."""
import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
modeling_layers = pytest.importorskip("transformers.modeling_layers")

sys.path.insert(0, os.path.dirname(__file__))
import hf_families as H  # noqa: E402

from megalite.model.hf import from_hf, hf_mtp_state, to_hf  # noqa: E402
from megalite.testing import assert_tensor_close  # noqa: E402


def _with_mtp(depths: int):
    """transformers' DeepSeek-V3 and its MTP module (random weights, a random correction bias), and the MTP
    tensors under the checkpoint's names."""
    hf = H.hf_model("deepseek-v3")
    hf.config.num_nextn_predict_layers = depths
    mtp = modeling_layers.MtpModel(hf, depths).float().eval()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():  # every tensor of the depths drawn here (a constructed MtpModel leaves some as allocated)
        for name, tensor in mtp.state_dict().items():
            if not name.startswith("layers."):
                continue  # the main model's embedding and head
            if name.endswith("norm.weight"):  # norms near 1
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=gen))
            else:  # weights, and a correction bias that reorders the experts
                tensor.copy_(0.05 * torch.randn(tensor.shape, generator=gen))
    mtp.tie_with_main_model(hf)
    n = hf.config.num_hidden_layers
    state = {}
    for name, tensor in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue  # the shared embedding and head
        _, k, rest = name.split(".", 2)
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        state[f"model.layers.{n + int(k)}.{rest}"] = tensor.detach().clone()
    return hf, mtp, state


def _transformers_depth_losses(hf, mtp, ids, labels):
    """Each depth's summed cross entropy, by transformers' MTP layers on the T-k positions of depth k."""
    captured = {}
    hook = hf.model.norm.register_forward_pre_hook(lambda _m, args: captured.update(hidden=args[0]))
    with torch.no_grad():
        hf(ids)
    hook.remove()
    hidden, t, losses = captured["hidden"], ids.shape[1], []  # [b, t, h], before the final norm
    for k in range(1, len(mtp.layers) + 1):
        n = t - k
        positions = torch.arange(n).unsqueeze(0).expand(ids.shape[0], n)
        # the next depth reads this one's block output before its final norm (megalite's chain; transformers'
        # own MtpModel.forward hands on the normed output, which differs from depth 2 on)
        hook = mtp.layers[k - 1].post_norm.register_forward_pre_hook(lambda _m, args: captured.update(hidden=args[0]))
        normed = mtp.forward_layer(k - 1, hidden[:, :n], positions, None, input_ids=ids[:, k:])
        logits = mtp._project_to_logits(normed)  # [b, n, V]
        hook.remove()
        hidden = captured["hidden"]
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, k:].reshape(-1),
                                      ignore_index=-100, reduction="sum"))
    return torch.stack(losses)


# megalite's depth k <-> transformers' MTP layer k: the pieces around the block and two of the block's weights
_COMPARED = {"eh_proj.weight": "eh_proj.weight", "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
             "final_norm.weight": "post_norm.weight",
             "block.attention.proj.weight": "mtp_block.self_attn.o_proj.weight",
             "block.mlp.router.weight": "mtp_block.mlp.gate.weight"}


def _megalite_depths(model, ids, labels):
    """(each depth's summed loss, {megalite name: gradient} of the compared weights) of a training forward."""
    model.train()  # the depths record their sums in training forwards
    model.zero_grad()
    model(ids, labels, reduction="sum").backward()
    grads = {f"mtp.depths.{k}.{name}": p.grad.clone() for k, depth in enumerate(model.mtp.depths)
             for name, p in depth.named_parameters() if name in _COMPARED}
    return torch.tensor(model.mtp.take_step_sums(), dtype=torch.float64), grads


@pytest.mark.parametrize("depths", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_imported_mtp_depths_give_transformers_mtp_losses(depths):
    hf, mtp, state = _with_mtp(depths)
    model = from_hf(hf, mtp_state=state)
    assert model.config.mtp_num_layers == depths
    ids = H.inputs()
    labels = H.megalite_labels(ids)
    expected = _transformers_depth_losses(hf, mtp, ids, labels)
    (expected.sum() * (model.config.mtp_loss_scaling_factor / depths)).backward()  # the MTP term's gradient
    hf_grads = {f"mtp.depths.{k}.{ours}": layer.get_parameter(theirs).grad for k, layer in enumerate(mtp.layers)
                for ours, theirs in _COMPARED.items()}
    losses, grads = _megalite_depths(model, ids, labels)
    torch.testing.assert_close(losses, expected.detach().double(), rtol=1e-5, atol=0)
    for name, grad in grads.items():
        assert_tensor_close(grad, hf_grads[name], rtol=1e-5, what=name)
    # the check can fail: a depth's embedding and hidden halves of M_k swapped
    with torch.no_grad():
        weight = model.mtp.depths[0].eh_proj.weight
        weight.copy_(torch.cat(weight.chunk(2, dim=1)[::-1], dim=1))
    with pytest.raises(AssertionError):
        assert_tensor_close(_megalite_depths(model, ids, labels)[1]["mtp.depths.0.enorm.weight"],
                            hf_grads["mtp.depths.0.enorm.weight"], rtol=1e-3)


def test_mtp_weights_round_trip_and_without_them_no_depths():
    hf, _, state = _with_mtp(1)
    model = from_hf(hf, mtp_state=state)
    back = hf_mtp_state(model)
    n = hf.config.num_hidden_layers
    shared = {f"model.layers.{n}.embed_tokens.weight": hf.state_dict()["model.embed_tokens.weight"],
              f"model.layers.{n}.shared_head.head.weight": hf.state_dict()["lm_head.weight"]}
    assert set(back) == set(state) | set(shared)  # the checkpoint's layout: the shared copies written too
    for name, tensor in {**state, **shared}.items():
        assert torch.equal(back[name], tensor), name
    exported = to_hf(model)  # transformers' model holds no MTP layers; its config counts them
    assert exported.config.num_nextn_predict_layers == 1
    for name, tensor in hf.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    assert from_hf(hf).config.mtp_num_layers == 0  # transformers' model alone: no MTP weights, no depths


def test_convert_checkpoint_carries_the_mtp_layers(tmp_path):
    """tools/convert_checkpoint.py import then export: the MTP layers of the files come back as they were."""
    safetensors = pytest.importorskip("safetensors.torch")
    path = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "convert_checkpoint.py")
    spec = importlib.util.spec_from_file_location("convert_checkpoint_47m", path)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    hf, _, state = _with_mtp(1)
    hf.save_pretrained(tmp_path / "hf")  # its config counts the layer; its model file lacks it, as V3's does not
    safetensors.save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "hf" / "mtp.safetensors"))
    assert convert.main(["import", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")]) == 0
    assert convert.main(["export", "--load", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]) == 0
    exported = safetensors.load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name
    assert torch.equal(exported[f"model.layers.{hf.config.num_hidden_layers}.embed_tokens.weight"],
                       hf.state_dict()["model.embed_tokens.weight"])
