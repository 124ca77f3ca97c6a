"""Sample from a megalite checkpoint or a transformers directory, with a KV cache.

    python tools/generate.py --load runs/ckpt --prompt "def fibonacci(n):" --max-new-tokens 64
    python tools/generate.py --hf ./Qwen3-0.6B --prompt "Hello" --prompt "The capital of France" \
        --temperature 0.7 --top-p 0.9 --seed 1
    torchrun --nproc_per_node 2 tools/generate.py --load runs/ckpt --prompt-file prompts.txt   # tp 2

Greedy by default (--temperature 0); --temperature T, --top-k K, --top-p P sample (seeded: every rank
draws the same token). Several prompts run as one batch (left-padded; each gives what it gives alone).
One prompt streams its tokens to the terminal as they come; a batch prints each completion when done.
Under torchrun the world is the tensor-parallel group (tp = WORLD_SIZE); pipeline parallelism is
refused. The tokenizer is --tokenizer, else an HF directory's tokenizer.json, else megalite's byte
tokenizer; --chat renders each prompt as a user turn through the tokenizer's chat template. A row ends
at the end-of-sequence id (--ignore-eos: never).
"""
from __future__ import annotations

import os
import sys

if not __package__:  # run as a script from a checkout (installed, it is megalite.tools.generate)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from megalite.cli import OneLineParser  # noqa: E402
from megalite.data.sft_preprocess import ChatTemplate  # noqa: E402
from megalite.data.tokenizer import load_tokenizer  # noqa: E402
from megalite.errors import UsageError, reports_usage_errors  # noqa: E402
from megalite.generation import SamplingParams, generate  # noqa: E402
from megalite.generation.generate import check_prompts  # noqa: E402
from megalite.generation.load import load_for_generation  # noqa: E402
from megalite.distributed.mesh import destroy_mesh, init_mesh  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parser() -> OneLineParser:
    p = OneLineParser(prog="generate.py", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--load", help="a megalite checkpoint: a --save directory (latest) or a step_* directory")
    source.add_argument("--hf", help="a local transformers directory (config.json + weights)")
    p.add_argument("--step", type=int, default=None, help="with --load: this step instead of the latest")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", default=None, help="one prompt per line (added to --prompt's)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    p.add_argument("--tokenizer", default=None, help="'byte', a tokenizer.json, or the directory transformers saved")
    p.add_argument("--chat", action="store_true", help="each prompt as a user turn through the tokenizer's chat "
                                                       "template (transformers; the --hf or --tokenizer directory)")
    p.add_argument("--eos-id", type=int, default=None, help="end-of-sequence id (default: the model's or the "
                                                             "tokenizer's)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages: 1 only (refused otherwise)")
    return p


def _tokenizer_file(spec: str | None) -> str | None:
    """--tokenizer as load_tokenizer takes it: a directory means its tokenizer.json."""
    return os.path.join(spec, "tokenizer.json") if spec is not None and os.path.isdir(spec) else spec


def _prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file is not None:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise UsageError("no prompt: pass --prompt TEXT (repeatable) or --prompt-file FILE")
    return prompts


def _checked(args) -> SamplingParams:
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    problems = params.problems() + ([f"--max-new-tokens {args.max_new_tokens} must be >= 1"]
                                    if args.max_new_tokens < 1 else [])
    if args.pp != 1:
        problems.append(f"--pp {args.pp}: generation runs the whole model on each tp group; use --pp 1 (any "
                        f"checkpoint loads at any layout)")
    if problems:
        raise UsageError("; ".join(problems))
    return params


def text_of(tokenizer, ids: list[int]) -> str:
    """The text of `ids`; an id past the tokenizer's vocabulary (a model's padded rows) shows as <id>."""
    out, run = [], []
    for i in ids:
        if i < tokenizer.vocab_size:
            run.append(i)
            continue
        out += [tokenizer.decode(run), f"<{i}>"]
        run = []
    return "".join(out + [tokenizer.decode(run)])


class Streamer:
    """on_tokens for one prompt: prints the text each new token adds, decoded whole (a character whose
    UTF-8 bytes span tokens shows once complete); `finish` prints what is left."""

    def __init__(self, tokenizer, say):
        self.tokenizer, self.say, self.ids, self.shown = tokenizer, say, [], ""

    def _show(self, final: bool) -> None:
        text = text_of(self.tokenizer, self.ids)
        if final or not text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            self.say(text[len(self.shown):], end="", flush=True)
            self.shown = text

    def __call__(self, step, tokens, live) -> None:
        if bool(live[0]):
            self.ids.append(int(tokens[0]))
            self._show(final=False)

    def finish(self) -> None:
        self._show(final=True)
        self.say()


def _encoded(args, prompts: list[str], tokenizer, model) -> list[list[int]]:
    """The prompts' ids (--chat: each as a user turn through the chat template of the tokenizer's directory),
    checked against the model (UsageError: too long, ids outside its vocabulary) before any output."""
    texts = prompts
    if args.chat:
        where = args.tokenizer or args.hf
        if where in (None, "byte"):
            raise UsageError("--chat needs a tokenizer with a chat template: --hf DIR or --tokenizer DIR (a directory "
                             "saved by transformers)")
        chat = ChatTemplate(where)
        texts = [chat.prompt(p) for p in prompts]
    encoded = [tokenizer.encode(t) for t in texts]
    try:
        check_prompts(encoded, args.max_new_tokens, model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return encoded


@reports_usage_errors
def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    params, prompts = _checked(args), _prompts(args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    mesh = init_mesh(tp=world, etp=world)  # experts split over tp like the dense MLP
    try:
        loaded = load_for_generation(mesh, load=args.load, hf=args.hf, step=args.step, dtype=DTYPES[args.dtype])
        tokenizer = load_tokenizer(_tokenizer_file(args.tokenizer) or loaded.tokenizer_path)
        encoded = _encoded(args, prompts, tokenizer, loaded.model)
        eos = None if args.ignore_eos else (args.eos_id if args.eos_id is not None else
                                            loaded.eos_token_id if loaded.eos_token_id is not None else tokenizer.eod)
        streamer = Streamer(tokenizer, say) if len(prompts) == 1 else None
        if streamer is not None:
            say(prompts[0], end="", flush=True)
        out = generate(loaded.model, encoded, max_new_tokens=args.max_new_tokens, params=params, eos_token_id=eos,
                       on_tokens=streamer)
        if streamer is not None:
            streamer.finish()
        else:
            for i, (prompt, tokens) in enumerate(zip(prompts, out)):
                say(f"[{i}] {prompt}{text_of(tokenizer, tokens)}")
    finally:
        destroy_mesh()
    return 0


if __name__ == "__main__":
    sys.exit(main())
