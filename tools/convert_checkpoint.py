"""Convert between megalite checkpoints (any layout) and HuggingFace `transformers` directories.

    # megalite -> HF: config.json + model.safetensors (pytorch_model.bin without safetensors)
    python tools/convert_checkpoint.py export --load runs/ckpt [--step 1200] --output hf_out [--dtype bf16]
    # HF -> megalite: a checkpoint holding weights only; train from it with --load DIR (the optimizer
    # starts from these weights at step 0)
    python tools/convert_checkpoint.py import --hf hf_dir --output runs/from_hf

GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM) and Mixtral (MixtralForCausalLM: a llama-flavour
model whose every block is a softmax top-k mixture of experts) flavours; tensor names and layouts are
mapped by megalite.model.hf. A checkpoint saved at any (tp, pp, dp, zero) exports the same
files: the full tensors are assembled from its layout-free boxes, every file read verified.
Nothing is downloaded: `--hf` is a local directory.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from megalite.checkpoint import CheckpointCorruptError, read_full_state, write_full_state
from megalite.cli import OneLineParser
from megalite.errors import UsageError, one_line, reports_usage_errors
from megalite.model.config import GPTConfig
from megalite.model.hf import config_from_hf, full_state_to_hf, hf_to_full_state
from megalite.paths import output_dir_problem

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def hf_config_for(config: GPTConfig, dtype: torch.dtype):
    """The transformers config of the same model (checked by converting it back)."""
    import transformers

    if config.flavour == "gpt2":
        if not config.tie_embeddings or not config.add_bias:
            raise ValueError("GPT2LMHeadModel needs tied embeddings and biases; this gpt2-flavour model has "
                             f"tie_embeddings={config.tie_embeddings}, add_bias={config.add_bias}")
        hf = transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.seq_length,
                                     n_embd=config.hidden_size, n_layer=config.num_layers,
                                     n_head=config.num_attention_heads, n_inner=config.ffn_hidden_size,
                                     activation_function="gelu_new", layer_norm_epsilon=config.norm_eps,
                                     resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
                                     attn_pdrop=config.attention_dropout, tie_word_embeddings=True)
    elif config.moe is not None:
        hf = _mixtral_config(config)
    else:
        if config.add_bias:
            raise ValueError("megalite's Llama export covers bias-free models only (add_bias=False)")
        hf = transformers.LlamaConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                      intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
                                      num_attention_heads=config.num_attention_heads,
                                      num_key_value_heads=config.num_query_groups,
                                      max_position_embeddings=config.seq_length, rms_norm_eps=config.norm_eps,
                                      tie_word_embeddings=config.tie_embeddings, attention_bias=False, mlp_bias=False,
                                      rope_theta=config.rope_theta, attention_dropout=config.attention_dropout)
    if config.flavour == "llama" and getattr(hf, "rope_parameters", None) is not None:  # transformers 5: theta here
        hf.rope_parameters = {**hf.rope_parameters, "rope_type": "default", "rope_theta": config.rope_theta}
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):  # transformers' defaults are GPT-2's / Llama's ids
        if isinstance(getattr(hf, name, None), int) and getattr(hf, name) >= config.vocab_size:
            setattr(hf, name, config.vocab_size - 1)  # megalite's end-of-document id is the last one it adds
    hf.architectures = ["GPT2LMHeadModel" if config.flavour == "gpt2" else
                        "MixtralForCausalLM" if config.moe is not None else "LlamaForCausalLM"]
    hf.torch_dtype = str(dtype).removeprefix("torch.")
    back = config_from_hf(hf)
    fields = ["flavour", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "vocab_size",
              "seq_length", "norm_eps", "rope_theta", "tie_embeddings"]
    if config.moe is None:
        fields.append("ffn_hidden_size")
    elif (back.moe.num_experts, back.moe.topk, back.moe.expert_ffn(back.ffn_hidden_size)) != \
            (config.moe.num_experts, config.moe.topk, config.moe.expert_ffn(config.ffn_hidden_size)):
        raise ValueError(f"the transformers config does not reproduce the experts: {back.moe} != {config.moe}")
    for field in fields:
        if getattr(back, field) != getattr(config, field):
            raise ValueError(f"the transformers config does not reproduce {field}: {getattr(back, field)} != "
                             f"{getattr(config, field)}")
    return hf


def _mixtral_config(config: GPTConfig):
    """MixtralConfig of a llama-flavour MoE model; refuses what Mixtral cannot express."""
    import transformers

    moe = config.moe
    unsupported = [what for what, bad in (
        ("gpt2 flavour", config.flavour != "llama"), ("biases", config.add_bias),
        ("--moe-layer-freq > 1", moe.layer_freq != 1), ("sigmoid scores", moe.score_function != "softmax"),
        ("--moe-router-pre-softmax", moe.pre_softmax), ("a shared expert", bool(moe.shared_expert_intermediate_size)),
        ("expert bias", moe.enable_expert_bias), ("a capacity factor", moe.capacity_factor is not None)) if bad]
    if unsupported:
        raise ValueError(f"MixtralForCausalLM cannot express {', '.join(unsupported)}; export a model with softmax "
                         f"top-k experts in every block, no shared expert and no bias")
    return transformers.MixtralConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                      intermediate_size=moe.expert_ffn(config.ffn_hidden_size),
                                      num_hidden_layers=config.num_layers,
                                      num_attention_heads=config.num_attention_heads,
                                      num_key_value_heads=config.num_query_groups,
                                      max_position_embeddings=config.seq_length, rms_norm_eps=config.norm_eps,
                                      tie_word_embeddings=config.tie_embeddings, rope_theta=config.rope_theta,
                                      attention_dropout=config.attention_dropout, sliding_window=None,
                                      num_local_experts=moe.num_experts, num_experts_per_tok=moe.topk,
                                      router_aux_loss_coef=moe.aux_loss_coeff)


def export_to_hf(load: str | Path, output: str | Path, *, step: int | None = None, dtype: str | None = None,
                 safe: bool = True) -> Path:
    """Write `output`/config.json and the weights of a megalite checkpoint; returns `output`."""
    config, full, meta = read_full_state(load, step)
    target = DTYPES[dtype] if dtype else next(iter(full.values())).dtype
    state = full_state_to_hf(full, config)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)  # transformers ties it to the input embedding
    # Own, contiguous storage per tensor: split views (q/k/v, gate/up) must not share memory on disk.
    state = {name: tensor.to(target).contiguous().clone() for name, tensor in state.items()}
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    hf_config_for(config, target).save_pretrained(output)
    try:
        from safetensors.torch import save_file
    except ImportError:
        safe = False
    weights = output / ("model.safetensors" if safe else "pytorch_model.bin")
    if safe:
        save_file(state, str(weights), metadata={"format": "pt"})
    else:
        torch.save(state, weights)
    _readable_as_config(weights)
    print(f"exported {meta['model_config']['flavour']} step {meta['step']} (saved at tp={meta['layout']['tp']} "
          f"pp={meta['layout']['pp']} dp={meta['layout']['dp']}) to {output}")
    return output


def _readable_as_config(path: Path) -> None:
    """The weights with the permissions config.json got (the umask's), not a writer's private 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _check_hf_config(hf_dir: Path) -> None:
    """UsageError unless hf_dir/config.json is a JSON object (transformers' own error is a traceback)."""
    path = hf_dir / "config.json"
    if not path.is_file():
        raise UsageError(f"--hf {hf_dir}: {path} not found; pass a directory written by save_pretrained")
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"--hf {hf_dir}: {path} is not valid JSON ({exc}); pass a directory written by "
                         f"save_pretrained") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise UsageError(f"--hf {hf_dir}: {path} is not a transformers config (no model_type)")


def _read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors or pytorch_model*.bin weights")
    state = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(str(file)))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
    return state


def import_from_hf(hf_dir: str | Path, output: str | Path, *, step: int = 0) -> Path:
    """Publish a megalite checkpoint (weights only) of the HF model in `hf_dir`; returns its path."""
    import transformers

    hf_dir = Path(hf_dir)
    _check_hf_config(hf_dir)
    config = config_from_hf(transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True))
    full = hf_to_full_state(_read_hf_weights(hf_dir), config)
    path = write_full_state(output, config, full, step=step, extra={"imported_from": str(hf_dir)})
    print(f"imported {config.flavour} ({config.num_params() / 1e6:.2f}M params) from {hf_dir} to {path}")
    return path


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="megalite checkpoint -> transformers directory")
    ex.add_argument("--load", required=True, help="a --save directory (latest) or one step_* directory")
    ex.add_argument("--step", type=int, default=None, help="export this step instead of the latest")
    ex.add_argument("--output", required=True)
    ex.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the saved parameter dtype")
    ex.add_argument("--bin", action="store_true", help="write pytorch_model.bin instead of model.safetensors")
    im = sub.add_parser("import", help="transformers directory -> megalite checkpoint")
    im.add_argument("--hf", required=True, help="local directory with config.json and weights")
    im.add_argument("--output", required=True, help="checkpoint directory (use it as --load)")
    im.add_argument("--step", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        problem = output_dir_problem("--output", args.output)  # before reading a checkpoint
        if problem:
            raise UsageError(problem)
        if args.command == "export":
            export_to_hf(args.load, args.output, step=args.step, dtype=args.dtype, safe=not args.bin)
        else:
            import_from_hf(args.hf, args.output, step=args.step)
    except (UsageError, CheckpointCorruptError, FileNotFoundError, ValueError, KeyError) as exc:
        print(f"convert_checkpoint: error: {one_line(exc)}", file=sys.stderr)  # a user's input, not a bug: one line
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
