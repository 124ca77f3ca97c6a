"""Convert between megalite checkpoints (any layout) and HuggingFace `transformers` directories.

    # megalite -> HF: config.json + model.safetensors (pytorch_model.bin without safetensors)
    python tools/convert_checkpoint.py export --load runs/ckpt [--step 1200] --output hf_out [--dtype bf16]
    # HF -> megalite: a checkpoint holding weights only; train from it with --load DIR (the optimizer
    # starts from these weights at step 0)
    python tools/convert_checkpoint.py import --hf hf_dir --output runs/from_hf

GPT-2, Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Mixtral and Qwen3-MoE (megalite/model/hf_config.py;
docs/models.md); tensor names and layouts are mapped by megalite.model.hf. Export writes the family
that expresses the model and, with --tokenizer, that tokenizer's bos/eos ids. A checkpoint saved at any (tp, pp, dp, zero) exports the same
files: the full tensors are assembled from its layout-free boxes, every file read verified.
Nothing is downloaded: `--hf` is a local directory.

torch's formats (megalite/checkpoint/torch_formats.py): `--to dcp | safetensors --load CKPT --output OUT`,
`--from dcp --load DCP_DIR --output CKPT`. Megatron-core's (megalite/checkpoint/megatron.py, docs/megatron.md):
`--from megatron --load MEGATRON_SAVE_DIR --output CKPT [--vocab-size N]`, the legacy per-rank files or torch_dist.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from megalite.checkpoint import CheckpointCorruptError, read_full_state, write_full_state
from megalite.cli import OneLineParser
from megalite.errors import UsageError, one_line, reports_usage_errors
from megalite.extras import require
from megalite.config.model import GPTConfig
from megalite.model.hf import config_from_hf, full_state_to_hf, hf_to_full_state, with_mtp_as_present
from megalite.model.hf_config import hf_config_from, special_token_ids
from megalite.paths import output_dir_problem
from megalite.checkpoint import torch_formats as tf
from megalite.checkpoint.megatron import read_megatron
from megalite.progress import ProgressBar

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def hf_config_for(config: GPTConfig, dtype: torch.dtype, tokenizer: str | None = None):
    """The transformers config of the same model (megalite.model.hf_config.hf_config_from) with the
    bos/eos ids of `tokenizer` ("byte" or a tokenizer.json; None: the vocabulary's last id)."""
    bos, eos = special_token_ids(tokenizer) if tokenizer is not None else (None, None)
    return hf_config_from(config, dtype, bos_token_id=bos, eos_token_id=eos)


def _within(ids, vocab_size: int) -> bool:
    """Whether token id(s) `ids` (an int or a list; None: none) all lie in [0, vocab_size)."""
    ids = ids if isinstance(ids, list) else [ids]
    return all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)


def export_to_hf(load: str | Path, output: str | Path, *, step: int | None = None, dtype: str | None = None,
                 safe: bool = True, tokenizer: str | None = None, progress: bool = True) -> Path:
    """Write `output`/config.json and the weights of a megalite checkpoint; returns `output`.
    `progress`: a progress bar on stderr while the checkpoint's tensors are read (megalite.progress)."""
    bar = ProgressBar(None, unit="MB", count_name="tensors", label="reading") if progress else None
    config, full, meta = read_full_state(load, step, progress=bar)
    target = DTYPES[dtype] if dtype else next(iter(full.values())).dtype
    state = full_state_to_hf(full, config)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)  # transformers ties it to the input embedding
    # Own, contiguous storage per tensor: split views (q/k/v, gate/up) must not share memory on disk.
    state = {name: tensor.to(target).contiguous().clone() for name, tensor in state.items()}
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    imported = (meta.get("extra") or {}).get("special_token_ids") or {}  # an imported model's own ids
    imported = {k: v for k, v in imported.items() if _within(v, config.vocab_size)}  # (a config's defaults may not be)
    if tokenizer is None and imported:
        hf_config_from(config, target, bos_token_id=imported.get("bos"),
                       eos_token_id=imported.get("eos")).save_pretrained(output)
    else:
        hf_config_for(config, target, tokenizer).save_pretrained(output)
    try:
        from safetensors.torch import save_file  # optional: without it the weights go out as pytorch_model.bin
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


def _read_hf_weights(directory: Path, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every weight file of `directory` (safetensors, else pytorch_model*.bin), with a progress bar over
    their bytes (a large model's files are shards of a few GB each)."""
    files = sorted(directory.glob("*.safetensors")) or sorted(directory.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors or pytorch_model*.bin weights")
    state = {}
    bar = ProgressBar(sum(f.stat().st_size for f in files), unit="MB", count_name="files",
                      label="reading") if progress else None
    for file in files:
        if bar is not None:
            bar.update(0)  # (a file of several GB: the line shows before its read)
        if file.suffix == ".safetensors":
            load_file = require("safetensors.torch", f"reading {file.name}").load_file  # the [hf] extra
            state.update(load_file(str(file)))
        else:
            state.update(torch.load(file, map_location="cpu", weights_only=True))
        if bar is not None:
            bar.update(file.stat().st_size, 1)
    if bar is not None:
        bar.update(0, final=True)
    return state


def import_from_hf(hf_dir: str | Path, output: str | Path, *, step: int = 0, progress: bool = True) -> Path:
    """Publish a megalite checkpoint (weights only) of the HF model in `hf_dir`; returns its path.
    `progress`: a progress bar on stderr while the weight files are read (megalite.progress)."""
    transformers = require("transformers", "convert_checkpoint.py import")  # the [hf] extra
    hf_dir = Path(hf_dir)
    _check_hf_config(hf_dir)
    hf_config = transformers.AutoConfig.from_pretrained(hf_dir, local_files_only=True)
    weights = _read_hf_weights(hf_dir, progress)
    config = with_mtp_as_present(config_from_hf(hf_config), weights)  # DeepSeek-V3's MTP layers, if the files hold them
    full = hf_to_full_state(weights, config)
    ids = {"bos": getattr(hf_config, "bos_token_id", None), "eos": getattr(hf_config, "eos_token_id", None)}
    path = write_full_state(output, config, full, step=step, extra={"imported_from": str(hf_dir),
                                                                    "special_token_ids": ids})  # kept by export
    print(f"imported {config.flavour} ({config.num_params() / 1e6:.2f}M params) from {hf_dir} to {path}")
    return path


def import_megatron(load: str | Path, output: str | Path, *, vocab_size: int | None = None) -> Path:
    """Publish a megalite checkpoint (weights only, step 0) of a Megatron-core GPT checkpoint; returns its path."""
    config, full, info = read_megatron(load, vocab_size=vocab_size)
    path = write_full_state(output, config, full, step=0, extra={"imported_from": str(load), "megatron": {
        "format": info.format, "iteration": info.iteration, "tp": info.tp, "pp": info.pp}})
    print(f"imported Megatron {info.format} iteration {info.iteration} (saved at tp={info.tp} pp={info.pp}; "
          f"{config.flavour}, {config.num_params() / 1e6:.2f}M params) to {path}")
    return path


def torch_formats_main(argv: list[str]) -> int:
    """--to dcp | safetensors, --from dcp (megalite/checkpoint/torch_formats.py)."""
    parser = OneLineParser(prog="convert_checkpoint.py", description="megalite checkpoint <-> torch formats")
    way = parser.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=["dcp", "safetensors"], help="megalite checkpoint -> this format")
    way.add_argument("--from", dest="source", choices=["dcp", "megatron"], help="this format -> megalite checkpoint "
                     "(megatron: a Megatron-core GPT checkpoint, legacy per-rank files or torch_dist)")
    parser.add_argument("--load", required=True, help="the checkpoint (--to) or the DCP directory (--from)")
    parser.add_argument("--step", type=int, default=None, help="--to: this step instead of the latest")
    parser.add_argument("--output", required=True, help="DCP directory, .safetensors file, or checkpoint directory")
    parser.add_argument("--vocab-size", type=int, default=None, help="--from megatron: keep the embedding's first "
                        "N rows (default: Megatron's padded vocabulary, every row)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    bar = None if args.no_progress else ProgressBar(None, unit="MB", count_name="tensors", label="reading")
    try:
        if args.source == "dcp":
            path = tf.import_dcp(args.load, args.output)
        elif args.source == "megatron":
            problem = output_dir_problem("--output", args.output)
            if problem:
                raise UsageError(problem)
            path = import_megatron(args.load, args.output, vocab_size=args.vocab_size)
        elif args.to == "dcp":
            path = tf.export_dcp(args.load, args.output, step=args.step, progress=bar)
        else:
            path = tf.export_safetensors(args.load, args.output, step=args.step, progress=bar)
    except (UsageError, CheckpointCorruptError, FileNotFoundError, ValueError, KeyError) as exc:
        print(f"convert_checkpoint: error: {one_line(exc)}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="torch's formats (no subcommand):\n"
                                  "  --to {dcp,safetensors} --load CHECKPOINT --output OUT [--step N]   megalite -> "
                                  "torch.distributed.checkpoint or one .safetensors file\n"
                                  "  --from dcp --load DCP_DIR --output CHECKPOINT                      "
                                  "torch.distributed.checkpoint -> megalite\n"
                                  "  --from megatron --load MEGATRON_DIR --output CHECKPOINT [--vocab-size N]  "
                                  "Megatron-core (legacy or torch_dist) -> megalite\n"
                                  "(`convert_checkpoint.py --to dcp --help` lists their flags)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--to" in argv or "--from" in argv:  # torch's formats (DCP, safetensors) rather than transformers'
        return torch_formats_main(argv)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="megalite checkpoint -> transformers directory")
    ex.add_argument("--load", required=True, help="a --save directory (latest) or one step_* directory")
    ex.add_argument("--step", type=int, default=None, help="export this step instead of the latest")
    ex.add_argument("--output", required=True)
    ex.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: the saved parameter dtype")
    ex.add_argument("--bin", action="store_true", help="write pytorch_model.bin instead of model.safetensors")
    ex.add_argument("--tokenizer", default=None, help="the run's tokenizer ('byte' or a tokenizer.json): its "
                    "bos/eos ids go into config.json (default: an imported model's own ids, else the last "
                    "vocabulary id for both)")
    im = sub.add_parser("import", help="transformers directory -> megalite checkpoint")
    im.add_argument("--hf", "--load", dest="hf", required=True, help="local directory with config.json and weights "
                    "(--load, as export and --from name their input, is the same flag)")
    im.add_argument("--output", required=True, help="checkpoint directory (use it as --load)")
    im.add_argument("--step", type=int, default=0)
    for command in (ex, im):  # on a terminal a bar with rate and ETA; in a log a line every 10 s
        command.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    try:
        problem = output_dir_problem("--output", args.output)  # before reading a checkpoint
        if problem:
            raise UsageError(problem)
        require("transformers", f"convert_checkpoint.py {args.command}")  # missing: one line naming [hf]
        if args.command == "export":
            export_to_hf(args.load, args.output, step=args.step, dtype=args.dtype, safe=not args.bin,
                         tokenizer=args.tokenizer, progress=not args.no_progress)
        else:
            import_from_hf(args.hf, args.output, step=args.step, progress=not args.no_progress)
    except (UsageError, CheckpointCorruptError, FileNotFoundError, ValueError, KeyError) as exc:
        print(f"convert_checkpoint: error: {one_line(exc)}", file=sys.stderr)  # a user's input, not a bug: one line
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
