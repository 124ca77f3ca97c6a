#!/usr/bin/env python
"""Tokenize text into a memory-mapped .bin/.idx pair for megalite training (Megatron flag names).

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \
        --output-prefix data/corpus --tokenizer byte --workers 8
    # -> data/corpus_text_document.bin/.idx (Megatron's names, one pair per --json-keys key);
    #    train with --data-path data/corpus_text_document (or data/corpus: the one pair beside it is found)

Inputs: plain-text files (one file = one document), directories (walked recursively in sorted
order), JSON-lines files (.jsonl/.json, one document per line and key) and Parquet files
(.parquet, one document per row and --json-keys column; pip install 'megalite[parquet]').
Every document ends with the tokenizer's end-of-document id; one pair per --json-keys key is written
to {output-prefix}_{key}_document, as Megatron-LM's tool names it. The tokenizer: --tokenizer (byte,
a tokenizer.json or directory, a .model) or Megatron's --tokenizer-type flags. --megatron-index writes Megatron-LM's own MMIDIDX
.idx, so the same pair serves both frameworks. --sft reads SFT records (prompt/completion, or chat
messages) and writes a per-token loss mask beside the tokens (docs/finetuning.md). A progress bar (rate, ETA) goes to stderr; plain
lines every 10 s when stderr is not a terminal.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

if not __package__:  # run as a script from a checkout (installed, it is megalite.tools.preprocess_data)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megalite.cli import OneLineParser  # noqa: E402
from megalite.config.megatron import add_tokenizer_type_flags, tokenizer_from_megatron  # noqa: E402
from megalite.data.preprocess import preprocess_files  # noqa: E402
from megalite.data.sft_preprocess import preprocess_sft  # noqa: E402
from megalite.errors import UsageError, report_usage_error, reports_usage_errors  # noqa: E402
from megalite.data.tokenizer import load_tokenizer  # noqa: E402
from megalite.paths import output_prefix_problem  # noqa: E402


def parse_args(argv=None):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True, help="text/JSON-lines files or directories")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx per --json-keys key")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys to read from JSON lines")
    parser.add_argument("--tokenizer", "--tokenizer-model", default=None,
                        help="'byte' (the default), a HuggingFace tokenizer.json or directory, a SentencePiece .model "
                             "(or a spec, megalite/data/tokenizer.py)")
    add_tokenizer_type_flags(parser)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="NullTokenizer's ids (0..N-1), TikTokenizer's vocabulary")
    parser.add_argument("--append-eod", action="store_true",
                        help="accepted for Megatron compatibility: the end-of-document id is always appended")
    parser.add_argument("--workers", type=int, default=None,
                        help="tokenizer processes (default: 1 for the byte tokenizer, whose cost is reading; "
                             "cores - 1 otherwise)")
    parser.add_argument("--megatron-index", action="store_true",
                        help="write the .idx in Megatron-LM's MMIDIDX layout: the pair then serves Megatron-LM and "
                             "megalite alike (megalite reads both layouts)")
    parser.add_argument("--sft", action="store_true",
                        help="SFT records (JSON lines of prompt/completion, or chat messages rendered by the "
                             "tokenizer's chat template): also writes PREFIX_loss_mask.{bin,idx}, 1 on the tokens "
                             "trained on (megalite/data/sft_preprocess.py); train with --sft --data-path PREFIX")
    parser.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    return parser.parse_args(argv)


def _tokenizer_spec(args) -> str:
    """--tokenizer, or what Megatron's --tokenizer-type flags name (megalite.config.megatron)."""
    try:
        spec = tokenizer_from_megatron(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer,
                                       vocab_size=args.vocab_size, tiktoken_pattern=args.tiktoken_pattern,
                                       tiktoken_num_special_tokens=args.tiktoken_num_special_tokens)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return spec or args.tokenizer or "byte"


@reports_usage_errors
def main(argv=None) -> int:
    """A mistake in the input (a missing file, a malformed line, a bad tokenizer) prints one line, exit 2."""
    args = parse_args(argv)
    try:
        if args.workers is not None and args.workers < 1:
            raise UsageError(f"--workers {args.workers}: give 1 or more tokenizer processes (or leave it out)")
        problem = output_prefix_problem("--output-prefix", args.output_prefix, (".bin", ".idx"))
        if problem:
            raise UsageError(problem)
        args.tokenizer = _tokenizer_spec(args)
        if args.sft:  # its own mode: records, not documents; one process (the chat template is Python)
            stats = preprocess_sft(args.input, args.output_prefix, args.tokenizer)
            print(f"{stats.documents} SFT samples, {stats.tokens} tokens", file=sys.stderr)
            print(f"sft: {args.output_prefix}.bin {args.output_prefix}.idx; loss mask: "
                  f"{stats.outputs['loss_mask']}.bin {stats.outputs['loss_mask']}.idx")
            return 0
        tokenizer = load_tokenizer(args.tokenizer)
        workers = args.workers or (1 if tokenizer.name == "byte" else max(1, (os.cpu_count() or 2) - 1))
        stats = preprocess_files(args.input, args.output_prefix, tokenizer, tuple(args.json_keys), workers,
                                 show_progress=not args.no_progress, megatron_index=args.megatron_index,
                                 megatron_names=True)
        if stats.documents == 0:  # every document empty or undecodable: an empty dataset is no dataset
            for prefix in stats.outputs.values():
                for suffix in (".bin", ".idx"):
                    Path(prefix + suffix).unlink(missing_ok=True)
            raise UsageError(f"--input {' '.join(args.input)}: no document could be read ({stats.skipped_empty} "
                             f"empty, {stats.skipped_not_utf8} not UTF-8); nothing written. Give UTF-8 text or "
                             f"JSON lines with the --json-keys {' '.join(args.json_keys)}")
    except UsageError as exc:
        return report_usage_error(exc, rank=0)
    print(stats.summary(), file=sys.stderr)
    for key, prefix in stats.outputs.items():
        print(f"{key}: {prefix}.bin {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
