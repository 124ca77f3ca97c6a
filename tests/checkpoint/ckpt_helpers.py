"""Shared pieces of the checkpoint tests: a tiny model, per-step global batches, a train loop."""
import contextlib
import importlib.util
import io
import pathlib

import torch

from megalite.parameters import params as P
from megalite.model import preset
from megalite.config import RunConfig
from megalite.training import loop
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

MICRO, GLOBAL, SEQ = 2, 8, 16


def model_config(flavour="gpt2"):
    if flavour == "llama":
        return preset("tiny-llama", num_layers=4, hidden_size=64, ffn_hidden_size=96, seq_length=SEQ)
    return preset("tiny", num_layers=4, hidden_size=64, seq_length=SEQ)


def train_config(tp=1, pp=1, dp=1, **kw):
    # adam_eps above float32 gradient noise: see tests/training/test_train_step.py
    return RunConfig.build(tp=tp, pp=pp, dp=dp, micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3,
                       weight_decay=0.1, clip_grad=0.5, seed=3, adam_eps=1e-6, **kw)


def step_batches(step, vocab, dp, dp_rank):
    """This dp rank's microbatches of global batch `step` (different tokens every step)."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[step % GLOBAL, : 3 + step] = -100  # uneven target counts across ranks
    per_rank = GLOBAL // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    return [{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(MICRO), labels[mine].split(MICRO))]


def build(model, cfg, mesh):
    chunks = build_model_chunks(model, cfg, mesh)
    return chunks, build_optimizer(build_data_parallel(chunks, cfg, mesh), cfg)


def train(chunks, optimizer, mesh, cfg, steps):
    """Train the given (1-based) steps; return their losses."""
    return [train_step(optimizer.model, optimizer, step_batches(s, chunks[0].config.vocab_size, mesh.dp_size, mesh.dp_rank),
                       mesh, cfg, lr=1e-3 * (1 + 0.1 * s)).loss for s in steps]


def full_params(chunks):
    """{logical name: full tensor} of a (1, 1, 1) model."""
    return {n: P.shard_spec(p).assemble([p.detach().clone()]) for n, p in chunks[0].logical_parameters()}


def load_convert_tool():
    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"
    spec = importlib.util.spec_from_file_location("convert_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def megalite_logits(checkpoint, ids):
    """Logits of megalite's (1, 1, 1) GPTModel loaded from a checkpoint of any layout."""
    from megalite.checkpoint import load_checkpoint
    from megalite.checkpoint.full_state import resolve_checkpoint_dir
    from megalite.checkpoint.reader import CheckpointReader
    from megalite.distributed.mesh import single_process_mesh
    from megalite.config.model import GPTConfig
    from megalite.model.gpt import GPTModel

    config = GPTConfig(**CheckpointReader(resolve_checkpoint_dir(checkpoint)).metadata["model_config"])
    model = GPTModel(config, single_process_mesh("cpu")).eval()
    load_checkpoint(checkpoint, [model], None, single_process_mesh("cpu"), log=lambda *_: None)
    with torch.no_grad():
        return model(ids)[..., :config.vocab_size]


# The training program's arguments for a one-block model, a one-sample batch and a step per log line.
SMALL_RUN = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
             "--micro-batch-size", "1", "--global-batch-size", "1", "--eval-iters", "0", "--log-interval", "1"]


def run_in_process(argv):
    """(exit code, stdout, stderr) of the training program in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = loop.main(argv)
    return code, out.getvalue(), err.getvalue()
