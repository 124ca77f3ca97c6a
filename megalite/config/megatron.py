"""Megatron-LM's flag names for megalite's settings, so a Megatron command line runs unedited.

Three tables, read where the parser and the settings are generated (megalite.config, megalite.cli):

- SYNONYMS: a megalite setting -> Megatron's other names for it, taking the same value
  (`--tensor-model-parallel-size 2` is `--tp 2`); also accepted as config-file keys. Settings whose
  flag already is Megatron's spelling (`--num-layers`, `--micro-batch-size`, `--lr`, ...) need none.
- ALIASES: a Megatron switch that sets a megalite setting to one value
  (`--use-distributed-optimizer` is `--zero 1`: the optimizer state sharded over dp).
- ALWAYS: a Megatron flag for what megalite always does (`--use-flash-attn`, `--overlap-grad-reduce`):
  accepted, changes nothing.
- `--tokenizer-type`: Megatron's tokenizers as a megalite tokenizer spec (megalite/data/tokenizer.py):
  GPT2BPETokenizer's --vocab-file/--merge-file made into one tokenizer.json, HuggingFaceTokenizer's
  --tokenizer-model (a file or a directory), SentencePieceTokenizer's .model, TikTokenizer's JSON
  (--tiktoken-pattern, --tiktoken-num-special-tokens, --vocab-size), NullTokenizer's --vocab-size.
- `--num-layers-per-virtual-pipeline-stage N`: converted to virtual stages (layers / pp / N);
  `--recompute-method uniform` recomputes every block (--recompute-num-layers then only sizes Megatron's
  groups), `block` the first --recompute-num-layers (megalite's own meaning).
- LACKS: a Megatron flag for a feature megalite does not have -> one line saying so (exit 2), so a
  command line is never half-understood.

Settings Megatron's command lines carry that megalite declares under Megatron's own name
(config/model_parts.py, config/run_parts.py): --init-method-std, --max-position-embeddings, --lr-warmup-fraction,
--lr-decay-iters, --untie-embeddings-and-output-weights, --disable-bias-linear,
--position-embedding-type, --normalization, --swiglu, --group-query-attention, --norm-epsilon,
--rotary-base, --make-vocab-size-divisible-by, --add-qkv-bias, --qk-layernorm, --kv-channels,
--rampup-batch-size (config/rampup.py).
`model_overrides` turns the model ones into GPTConfig fields and `lr_iters` the schedule ones into (warm-up, decay) steps.

Pure Python: no torch.
"""
from __future__ import annotations

import argparse
import enum
from typing import Any

from megalite.data.tokenizer import bpe_files_to_json  # reads the files; numpy, no torch

SYNONYMS: dict[str, tuple[str, ...]] = {
    "tp": ("--tensor-model-parallel-size",),
    "pp": ("--pipeline-model-parallel-size",),
    "cp": ("--context-parallel-size",),
    "virtual_stages": ("--virtual-pipeline-model-parallel-size",),
    "decoder_first_stage_layers": ("--decoder-first-pipeline-num-layers",),
    "decoder_last_stage_layers": ("--decoder-last-pipeline-num-layers",),
    "recompute": ("--recompute-granularity",),  # full | selective, Megatron's values
    "offload_optimizer": ("--optimizer-cpu-offload",),
    "tokenizer": ("--tokenizer-model",),  # a HuggingFace tokenizer.json
}

ALIASES: dict[str, dict[str, Any]] = {
    "zero": {"--use-distributed-optimizer": 1},
    "grad_reduce_dtype": {"--grad-reduce-in-bf16": "bf16"},
}

LACKS: dict[str, str] = {
    "--use-torch-fsdp2": "torch FSDP2; megalite's own fully sharded mode is --zero 3",
    "--apply-layernorm-1p": "zero-centred LayerNorm weights (1 + gamma)",
    "--train-samples": "a schedule in samples (give --train-iters: samples / --global-batch-size)",
    "--lr-decay-samples": "a schedule in samples (give --lr-decay-iters: samples / --global-batch-size)",
    "--lr-warmup-samples": "a schedule in samples (give --lr-warmup-iters: samples / --global-batch-size)",
    "--decoupled-lr": "a separate learning rate for the embedding and output layer",
    "--decoupled-min-lr": "a separate learning rate for the embedding and output layer",
    "--fp8-amax-history-len": "delayed FP8 scaling (megalite's scales are current: --fp8-recipe)",
    "--fp8-amax-compute-algo": "delayed FP8 scaling (megalite's scales are current: --fp8-recipe)",
    "--tiktoken-pattern": "TikTokenizer (give a HuggingFace tokenizer.json with --tokenizer-model)",
    "--distributed-timeout-minutes": "a collective timeout (megalite keeps torch's; --hang-timeout SECONDS "
                                     "reports where every rank waits)",
    "--no-load-rng": "skipping the RNG restore (megalite restores RNG states only at the layout that saved them)",
    "--loss-scale": "a static loss scale (megalite's fp16 scale is dynamic: --initial-loss-scale, "
                    "--loss-scale-window, --hysteresis)",
    "--min-loss-scale": "a floor for the dynamic loss scale other than 1",
    "--no-save-optim": "checkpoints without the optimizer (megalite's always hold it; load with --no-load-optim)",
    "--no-save-rng": "checkpoints without RNG states (megalite's always hold them)",
    "--log-params-norm": "logging the parameter norm",
    "--log-num-zeros-in-grad": "logging the zeros in the gradients",
    "--data-parallel-random-init": "per-replica initialisation (every dp replica starts from the same weights)",
}

# Megatron flags for what megalite always does: accepted and ignored -> (values taken, why)
ALWAYS: dict[str, tuple[int, str]] = {
    "--use-flash-attn": (0, "megalite picks its attention kernel by measurement (kernels/attention_dispatch.py)"),
    "--attention-backend": (1, "megalite picks its attention kernel by measurement"),
    "--transformer-impl": (1, "megalite has one transformer implementation"),
    "--use-mcore-models": (0, "megalite has one model implementation"),
    "--overlap-grad-reduce": (0, "megalite always overlaps the dp reduction with backward"),
    "--moe-grouped-gemm": (0, "megalite's experts always run as one grouped GEMM"),
    "--distributed-backend": (1, "megalite picks nccl on GPUs, gloo on CPUs"),
    "--use-checkpoint-args": (0, "megalite always takes the model's shape from --load's checkpoint"),
    "--log-throughput": (0, "every progress line has tokens/s and MFU"),
    "--ckpt-format": (1, "megalite writes its own layout-free format (tools/convert_checkpoint.py --to dcp exports "
                         "torch_dist)"),
    "--num-workers": (1, "megalite reads memory-mapped samples in the training process"),
    "--data-cache-path": (1, "megalite keeps its sample-index cache beside the data (data/cache.py)"),
    "--tensorboard-log-interval": (1, "TensorBoard gets every --log-interval step"),
    "--log-timers-to-tensorboard": (0, "the step's time split goes to every metrics sink"),
    "--log-validation-ppl-to-tensorboard": (0, "the validation loss and perplexity go to every metrics sink"),
    "--log-memory-to-tensorboard": (0, "the memory peaks go to every metrics sink"),
    "--timing-log-level": (1, "the step's time split is always measured"),
    "--accumulate-allreduce-grads-in-fp32": (0, "gradients accumulate and reduce in fp32 unless --grad-reduce-dtype "
                                                "says otherwise"),
    "--cross-entropy-loss-fusion": (0, "megalite's (vocab-parallel) cross entropy is one fused function"),
    "--calculate-per-token-loss": (0, "the loss is normalised by the global count of target tokens"),
    "--manual-gc": (0, "a step holds no Python garbage to collect on the host"),
    "--empty-unused-memory-level": (1, "megalite never empties the CUDA cache during a step"),
    "--no-create-attention-mask-in-dataloader": (0, "megalite builds no attention mask in the data loader"),
    "--no-mmap-bin-files": (0, "megalite memory-maps the .bin files"),
    "--no-masked-softmax-fusion": (0, "megalite's attention kernels apply the causal mask themselves"),
    "--no-position-embedding": (0, "a rope model has no position table (--position-embedding-type)"),
    "--bias-gelu-fusion": (0, "megalite's kernels choose their own fusions"),
    "--no-bias-gelu-fusion": (0, "megalite's kernels choose their own fusions"),
    "--no-bias-dropout-fusion": (0, "megalite's kernels choose their own fusions"),
    "--no-gradient-accumulation-fusion": (0, "megalite's kernels choose their own fusions"),
    "--dataloader-type": (1, "megalite's sampler reads a seeded order of the samples, Megatron's 'single'"),
}

# Megatron flags accepted for one value only -> (that value, what megalite does); another value is refused
ONLY: dict[str, tuple[float, str]] = {
    "--rotary-percent": (1.0, "megalite's rope rotates every dimension of a head"),
}

class TokenizerType(enum.StrEnum):
    """Megatron's --tokenizer-type values megalite reads (the SentencePiece ones: one reader, eod = eos)."""
    GPT2BPE = "GPT2BPETokenizer"
    HUGGINGFACE = "HuggingFaceTokenizer"
    SENTENCEPIECE = "SentencePieceTokenizer"
    GPT_SENTENCEPIECE = "GPTSentencePieceTokenizer"
    LLAMA2 = "Llama2Tokenizer"
    TIKTOKEN = "TikTokenizer"
    NULL = "NullTokenizer"


TOKENIZER_TYPES = tuple(t.value for t in TokenizerType)
SENTENCEPIECE_TYPES = (TokenizerType.SENTENCEPIECE, TokenizerType.GPT_SENTENCEPIECE, TokenizerType.LLAMA2)

POSITION_EMBEDDINGS = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def lacks_problem(argv: list[str], known: set[str] = frozenset()) -> str | None:
    """The first Megatron flag in argv whose feature megalite lacks, as one line; None if none.
    `known`: the parser's own flags (a flag megalite gains stops being refused)."""
    for i, word in enumerate(argv):
        flag = word.split("=", 1)[0]
        if flag in LACKS and flag not in known:
            return f"{flag} is a Megatron-LM flag for {LACKS[flag]}"
        if flag in ONLY:
            value = word.split("=", 1)[1] if "=" in word else (argv[i + 1] if i + 1 < len(argv) else "")
            accepted, why = ONLY[flag]
            try:
                same = float(value) == accepted
            except ValueError:
                same = False
            if not same:
                return f"{flag} {value}: megalite takes only {accepted:g} ({why})"
    return None


def model_overrides(model_settings) -> dict[str, Any]:
    """GPTConfig fields from the Megatron-named model settings (ValueError naming a mix megalite has not):
    rope + RMSNorm + SwiGLU is the llama flavour, learned positions + LayerNorm + GeLU the gpt2 one."""
    m, out = model_settings, {}
    markers = {"--position-embedding-type": None if m.position_embedding_type is None
               else m.position_embedding_type == "rope",
               "--normalization": None if m.normalization is None else m.normalization == "RMSNorm",
               "--swiglu": m.swiglu}
    given = {flag: llama for flag, llama in markers.items() if llama is not None}
    if given and len(set(given.values())) > 1:
        llama_like = sorted(flag for flag, llama in given.items() if llama)
        raise ValueError(f"{', '.join(llama_like)} and {', '.join(sorted(set(given) - set(llama_like)))} mix the "
                         f"two model flavours megalite has: rope + RMSNorm + --swiglu (llama) or learned_absolute + "
                         f"LayerNorm + GeLU (gpt2); give all three of one")
    if given:
        out["flavour"] = "llama" if next(iter(given.values())) else "gpt2"
    if m.init_method_std is not None:
        out["init_std"] = m.init_method_std
    if m.untie_embeddings_and_output_weights is not None:
        out["tie_embeddings"] = not m.untie_embeddings_and_output_weights
    if m.disable_bias_linear is not None:
        out["add_bias"] = not m.disable_bias_linear
    for setting_name, field_name in (("norm_epsilon", "norm_eps"), ("rotary_base", "rope_theta"),
                                     ("make_vocab_size_divisible_by", "make_vocab_size_divisible_by"),
                                     ("add_qkv_bias", "qkv_bias"), ("qk_layernorm", "qk_layernorm"),
                                     ("kv_channels", "kv_channels"), ("mtp_num_layers", "mtp_num_layers"),
                                     ("mtp_loss_scaling_factor", "mtp_loss_scaling_factor")):
        if getattr(m, setting_name) is not None:
            out[field_name] = getattr(m, setting_name)
    if m.group_query_attention and m.num_query_groups is None:
        out["num_query_groups"] = 1  # Megatron's default groups under --group-query-attention
    return out


def position_problem(model_settings, seq_length: int) -> str | None:
    """--max-position-embeddings below the sequence: the positions would run out (Megatron refuses too)."""
    limit = model_settings.max_position_embeddings
    if limit is not None and limit < seq_length:
        return (f"--max-position-embeddings {limit} is below --seq-length {seq_length}: raise it to at least "
                f"{seq_length}")
    return None


def lr_iters(optimizer_settings, train_iters: int) -> tuple[int, int]:
    """(warm-up steps, decay steps): --lr-decay-iters (default --train-iters), and the warm-up as
    --lr-warmup-fraction of the decay steps when given (Megatron's rule), else --lr-warmup-iters."""
    o = optimizer_settings
    decay = o.lr_decay_iters if o.lr_decay_iters is not None else train_iters
    warmup = int(o.lr_warmup_fraction * decay) if o.lr_warmup_fraction is not None else o.lr_warmup_iters
    return warmup, decay


def non_setting_dests() -> set[str]:
    """The parser destinations add_megatron_flags adds (parse_args drops them from its actions)."""
    return ({"megatron_" + flag[2:].replace("-", "_") for flag in (*ALWAYS, *ONLY)}
            | {"num_layers_per_virtual_pipeline_stage", "recompute_method", "tokenizer_type", "vocab_file",
               "merge_file", "profile", "profile_step_start", "profile_step_end", "tiktoken_pattern",
               "tiktoken_num_special_tokens"})


def add_megatron_flags(parser) -> None:
    """The flags that are not settings: ALWAYS (accepted, no effect), LACKS (refused in one line) and
    --num-layers-per-virtual-pipeline-stage (converted by `virtual_stages_from`)."""
    group = parser.add_argument_group("Megatron-LM flags that are not megalite settings")
    for flag, (values, why) in ALWAYS.items():
        kwargs = {"action": "store_true"} if values == 0 else {"metavar": "VALUE"}
        group.add_argument(flag, dest="megatron_" + flag[2:].replace("-", "_"), help=f"accepted, no effect: {why}",
                           **kwargs)
    for flag, (value, why) in ONLY.items():
        group.add_argument(flag, dest="megatron_" + flag[2:].replace("-", "_"), metavar="VALUE",
                           help=f"accepted as {value:g} only: {why}")
    group.add_argument("--profile", action="store_true", default=None,
                       help="Megatron's profiling switch: --profile-steps START END-1 (default steps 10..11)")
    group.add_argument("--profile-step-start", type=int, default=None, metavar="N", help="with --profile: first step")
    group.add_argument("--profile-step-end", type=int, default=None, metavar="N",
                       help="with --profile: the step profiling stops at (not profiled)")
    group.add_argument("--override-opt_param-scheduler", dest="override_opt_param_scheduler", action="store_const",
                       const=True, default=argparse.SUPPRESS, help="Megatron's spelling of --override-opt-param-scheduler")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None, metavar="N",
                       help="Megatron's spelling of virtual stages: --virtual-stages = num_layers / pp / N")
    add_tokenizer_type_flags(group)
    group.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                       help="with --recompute full: block recomputes the first --recompute-num-layers blocks of each "
                            "chunk (megalite's way); uniform recomputes every block (megalite: one block at a time, "
                            "the same numbers)")


def virtual_stages_from(layers_per_stage: int | None, num_layers: int, pp: int) -> int | None:
    """--virtual-stages from --num-layers-per-virtual-pipeline-stage (None when not given);
    ValueError when the layers do not split so."""
    if layers_per_stage is None:
        return None
    if layers_per_stage < 1 or num_layers % (pp * layers_per_stage):
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {layers_per_stage}: {num_layers} layers do not "
                         f"split into pp {pp} x stages of {layers_per_stage}; pick N dividing num_layers / pp")
    return num_layers // (pp * layers_per_stage)


def add_tokenizer_type_flags(group) -> None:
    """Megatron's tokenizer flags beside --tokenizer-model (training and tools/preprocess_data.py)."""
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                       help="GPT2BPETokenizer (--vocab-file, --merge-file), HuggingFaceTokenizer (--tokenizer-model "
                            "a tokenizer.json or a directory), SentencePieceTokenizer (--tokenizer-model a .model; "
                            "pip install 'megalite[sentencepiece]'), TikTokenizer (--tokenizer-model its JSON; "
                            "pip install 'megalite[tiktoken]'), NullTokenizer (--vocab-size N)")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer's vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer's merges.txt")
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"), default="v2", help="TikTokenizer's split pattern")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                       help="TikTokenizer's special ids before the ranks (<unk>, <s>, </s>, then fillers)")


def tokenizer_from_megatron(tokenizer_type: str | None, vocab_file: str | None, merge_file: str | None,
                            tokenizer: str | None, *, vocab_size: int | None = None, tiktoken_pattern: str = "v2",
                            tiktoken_num_special_tokens: int = 1000) -> str | None:
    """The --tokenizer spec a Megatron tokenizer choice means (None: leave it as it is); ValueError naming
    what is missing. GPT2BPETokenizer's vocab.json + merges.txt become one tokenizer.json
    (megalite.data.tokenizer.bpe_files_to_json: byte-level BPE, GPT-2's pre-tokenizer); `vocab_size` is
    --vocab-size (NullTokenizer's ids, TikTokenizer's cap)."""
    kind = None if tokenizer_type is None else TokenizerType(tokenizer_type)
    if (vocab_file or merge_file) and kind not in (None, TokenizerType.GPT2BPE):
        raise ValueError(f"--vocab-file/--merge-file go with --tokenizer-type GPT2BPETokenizer, not {tokenizer_type}")
    if kind is TokenizerType.NULL:
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size N (its ids are 0..N-1, the end of "
                             "document N)")
        return f"null:{vocab_size}"
    if kind is TokenizerType.GPT2BPE or vocab_file or merge_file:
        if not (vocab_file and merge_file):
            raise ValueError("GPT2BPETokenizer needs both --vocab-file (vocab.json) and --merge-file (merges.txt)")
        return bpe_files_to_json(vocab_file, merge_file)
    if kind is None:
        return None
    if tokenizer is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model (the tokenizer's file"
                         f"{' or directory' if kind is TokenizerType.HUGGINGFACE else ''})")
    if kind in SENTENCEPIECE_TYPES:
        return f"sentencepiece:{tokenizer}"
    if kind is TokenizerType.TIKTOKEN:
        return (f"tiktoken:{tiktoken_pattern}:{tiktoken_num_special_tokens}:"
                f"{'all' if vocab_size is None else vocab_size}:{tokenizer}")
    return tokenizer
