"""Training throughput of megalite at tp=pp=dp=1 vs a plain PyTorch loop over transformers' model.

Both train the same architecture (GPT-2 or Llama flavour, same config) on the same random tokens
with AdamW, in the same process, alternating trials so machine noise hits both alike. megalite
runs its real path (model chunks, DP-grad buffers, sharded-optimizer code, global loss
normalisation); the baseline is the loop anyone would write (GPT2LMHeadModel or LlamaForCausalLM):

    loss = hf_model(input_ids, labels=labels).loss; loss.backward(); clip; opt.step(); opt.zero_grad()

    python tools/bench_train.py                      # CPU: a small GPT-2, fp32
    python tools/bench_train.py --model gpt2-124m --micro-batch-size 8 --bf16    # on a GPU
    python tools/bench_train.py --model gpt2-124m --micro-batch-size 8 --bf16 --cuda-graph  # megalite replays
                                                     # each microbatch's captured forward+backward
    python tools/bench_train.py --model llama3-1b --micro-batch-size 4 --seq-length 2048 --bf16 --compile-baseline

--compile-baseline makes the baseline the strongest loop a user writes with transformers: fp32
weights, bf16 autocast (with --bf16, the mixed precision megalite trains in), fused AdamW on a GPU
and `torch.compile(model)` (--compile-backend: inductor; `eager` runs dynamo alone, a CPU smoke
test). The plain baseline casts the whole model to bf16 instead (issue 26's figures).

Prints tokens/s of each (median over trials) and the ratio megalite / baseline, and a GOAL line
(--goal: >= 1.0 by default; the GPU plan passes issue 36's 1.5 for --cuda-graph, 1.25 for the
compiled baseline).
Not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse  # noqa: F401  (tests reach argparse.Namespace through the module)
import gc
import statistics
import time

import torch
from megalite.errors import reports_usage_errors
from megalite.cli import OneLineParser
from megalite.extras import require
from megalite.model import preset
from megalite.config import RunConfig
from megalite.distributed.mesh import single_process_mesh
from megalite.training.cuda_graph import StepGraphs
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@reports_usage_errors
def main(argv=None) -> int:
    args = _parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.cuda_graph and device.type != "cuda":
        print("bench_train: --cuda-graph needs a CUDA GPU and none is visible here; drop --cuda-graph")
        return 2
    model_cfg = _model_config(args)
    b, s = args.micro_batch_size, args.seq_length
    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, model_cfg.vocab_size, (b, s + 1), generator=gen)  # [b, s + 1]: inputs and next tokens
    if args.one_at_a_time:  # each system alone in memory: its trials, then freed before the other is built
        megalite_step = _megalite_step(model_cfg, args, device, data)
        ours = _trials(megalite_step, args, device, b * s)
        megalite_step.release()
        del megalite_step
        _free(device)
        theirs = _trials(_hf_baseline_step(model_cfg, args, device, data), args, device, b * s)
    else:
        megalite_step = _megalite_step(model_cfg, args, device, data)
        baseline_step = _hf_baseline_step(model_cfg, args, device, data)
        ours, theirs = _alternating_trials(megalite_step, baseline_step, args, device, tokens_per_step=b * s)
    _report(model_cfg, args, device, ours, theirs)
    return 0


def _parse_args(argv):
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a megalite preset (gpt2 flavour); default: a small CPU model")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per trial")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--cuda-graph", action="store_true", help="megalite with --cuda-graph (needs a GPU)")
    parser.add_argument("--compile-baseline", action="store_true",
                        help="baseline: fp32 weights, bf16 autocast, fused AdamW and torch.compile(model)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the baseline")
    parser.add_argument("--goal", type=float, default=1.0, help="the ratio megalite / baseline to reach")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="time megalite's trials, free it, then the baseline's (when both do not fit at once; "
                             "the trials no longer alternate)")
    return parser.parse_args(argv)


def _model_config(args):
    """The GPTConfig both systems train: a megalite preset, or a small gpt2-flavour model for CPU."""
    if args.model:
        model_cfg = preset(args.model, seq_length=args.seq_length)
    else:
        model_cfg = preset("tiny", num_layers=6, hidden_size=256, num_attention_heads=8, vocab_size=8192,
                           seq_length=args.seq_length)
    if model_cfg.moe is not None:
        raise SystemExit("bench_train compares dense models: pick a preset without experts")
    return model_cfg


def _megalite_step(model_cfg, args, device, data):
    """One optimizer step of megalite's real training path (chunks, DP buffers, optimizer) on `data`."""
    b = args.micro_batch_size
    batch = [{"input_ids": data[:, :-1], "labels": data[:, 1:]}]
    mesh = single_process_mesh(device)
    cfg = RunConfig.build(micro_batch_size=b, global_batch_size=b, precision="bf16" if args.bf16 else "fp32",
                          clip_grad=1.0, weight_decay=0.1, cuda_graph=args.cuda_graph)
    chunks = build_model_chunks(model_cfg, cfg, mesh)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, mesh), cfg)
    graphs = StepGraphs(optimizer.model) if args.cuda_graph else None  # captured at the first (warm-up) step

    def megalite_step():
        train_step(optimizer.model, optimizer, batch, mesh, cfg, lr=1e-4, graphs=graphs)

    def release():  # the gradient hooks tie the parameters into a cycle through autograd's C++ side
        optimizer.model.grads.remove_hooks()
    megalite_step.release = release
    return megalite_step


def _hf_model(model_cfg, args):
    """transformers' model of the same architecture (dropout off, SDPA attention), on the CPU in fp32."""
    transformers = require("transformers", "tools/bench_train.py (the HF baseline)")  # the [hf] extra
    if model_cfg.flavour == "gpt2":
        hf_cfg = transformers.GPT2Config(vocab_size=model_cfg.vocab_size, n_positions=args.seq_length,
                                         n_embd=model_cfg.hidden_size, n_layer=model_cfg.num_layers,
                                         n_head=model_cfg.num_attention_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(hf_cfg)
    hf_cfg = transformers.LlamaConfig(vocab_size=model_cfg.vocab_size, hidden_size=model_cfg.hidden_size,
                                      intermediate_size=model_cfg.ffn_hidden_size,
                                      num_hidden_layers=model_cfg.num_layers,
                                      num_attention_heads=model_cfg.num_attention_heads,
                                      num_key_value_heads=model_cfg.num_query_groups,
                                      max_position_embeddings=args.seq_length, rms_norm_eps=model_cfg.norm_eps,
                                      rope_theta=model_cfg.rope_theta, tie_word_embeddings=model_cfg.tie_embeddings,
                                      attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(hf_cfg)


def _hf_baseline_step(model_cfg, args, device, data):
    """One step of the plain loop over transformers' model of the same shape (module docstring)."""
    bf16 = args.bf16
    hf = _hf_model(model_cfg, args)
    hf_params = sum(p.numel() for p in hf.parameters())  # a tied head counts once, as in num_params()
    if hf_params != model_cfg.num_params():
        raise SystemExit(f"bench_train: transformers' model has {hf_params} parameters, megalite's "
                         f"{model_cfg.num_params()}: not the same shape")
    if args.compile_baseline:  # fp32 weights under bf16 autocast, fused AdamW, the model compiled
        hf = hf.to(device).train()
        fused = dict(fused=True) if device.type == "cuda" else {}
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1, **fused)
        forward = torch.compile(hf, backend=args.compile_backend)
    else:
        hf = hf.to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32).train()
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, weight_decay=0.1)
        forward, bf16 = hf, False  # the weights are bf16 already
    ids, labels = data[:, :-1].to(device), data[:, :-1].to(device)  # HF shifts labels itself

    def baseline_step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = forward(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        hf_opt.step()
        hf_opt.zero_grad(set_to_none=True)
    return baseline_step


def _tokens_per_sec(step_fn, args, device, tokens_per_step: int) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step_fn()
    _sync(device)
    return tokens_per_step * args.steps / (time.perf_counter() - start)


def _trials(step_fn, args, device, tokens_per_step: int) -> list[float]:
    """Tokens/s of one system per trial, after two warm-up steps (allocator, kernels, compilation)."""
    step_fn()
    step_fn()
    return [_tokens_per_sec(step_fn, args, device, tokens_per_step) for _ in range(args.trials)]


def _free(device) -> None:
    """Return the memory of a system whose step function is no longer referenced."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _alternating_trials(megalite_step, baseline_step, args, device, tokens_per_step: int):
    """Tokens/s of each system per trial, the two alternating so machine noise hits both alike."""
    for fn in (megalite_step, baseline_step):  # warm-up (allocator, kernels, first-step calibration)
        fn()
        fn()
    ours, theirs = [], []
    for _ in range(args.trials):
        ours.append(_tokens_per_sec(megalite_step, args, device, tokens_per_step))
        theirs.append(_tokens_per_sec(baseline_step, args, device, tokens_per_step))
    return ours, theirs


def _report(model_cfg, args, device, ours, theirs) -> None:
    transformers = require("transformers", "tools/bench_train.py (the HF baseline)")
    m, t = statistics.median(ours), statistics.median(theirs)
    params = model_cfg.num_params() / 1e6
    b, s = args.micro_batch_size, args.seq_length
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU x{torch.get_num_threads()} threads"
    print(f"device: {name}; torch {torch.__version__}; transformers {transformers.__version__}")
    print(f"model: {model_cfg.flavour} flavour, {model_cfg.num_layers} layers, h={model_cfg.hidden_size}, "
          f"vocab {model_cfg.vocab_size}, {params:.1f}M params; batch {b}x{s} tokens; "
          f"{'bf16' if args.bf16 else 'fp32'}; {args.trials} trials x {args.steps} steps")
    print(f"megalite (tp=pp=dp=1{', cuda graph' if args.cuda_graph else ''}): {m:12.0f} tokens/s  (trials {', '.join(f'{x:.0f}' for x in ours)})")
    baseline = (f"HF + torch.compile({args.compile_backend}){', bf16 autocast' if args.bf16 else ''}"
                if args.compile_baseline else "plain loop, HF")
    print(f"{baseline}: {t:12.0f} tokens/s  (trials {', '.join(f'{x:.0f}' for x in theirs)})")
    print(f"ratio megalite / baseline:  {m / t:.3f}x")
    what = f"{args.model or 'small gpt2'} {b}x{s}{' --cuda-graph' if args.cuda_graph else ''}"
    print(f"GOAL bench_train {what}: megalite / {baseline} >= {args.goal:.2f}x | measured {m / t:.3f}x | "
          f"{'met' if m / t >= args.goal else 'NOT met'}")


if __name__ == "__main__":
    raise SystemExit(main())
