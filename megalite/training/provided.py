"""Any model in megalite's training loop: a user's own nn.Module, built by a `model_provider`.

    from megalite.training.provided import main

    def model_provider(mesh, *, pre_process, post_process):   # Megatron's shape, with the mesh passed
        return transformers.LlamaForCausalLM(config)          # any nn.Module: ids [b, s] -> output

    def loss_fn(output, labels):                               # labels [b, s], -100 = not a target
        return F.cross_entropy(output.logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")

    sys.exit(main(model_provider=model_provider, loss_fn=loss_fn))   # megalite's flags: --dp, --zero, ...
    # or, with a RunConfig already resolved for this world (training/configure.py: configure):
    megalite.train(cfg, model_provider=model_provider, loss_fn=loss_fn)

The loop then gives the model what it gives GPTModel: the data pipeline (the flags' tokenizer and
corpus; the model sees input ids [b, s] and `loss_fn` the labels aligned with them, already the next
tokens), data parallelism and ZeRO 0-3 (ZeRO-3: one unit per element of every nn.ModuleList, i.e.
per transformer block, or per layer of an nn.Sequential, and one for the rest), full activation recompute (--recompute full: each
such block's forward under torch's non-reentrant checkpoint, which restores torch's RNG for its
dropout), fp16/bf16 (the module is cast to the training dtype), layout-free checkpoints (saved at
one dp / ZeRO layout, loaded at another), resume, elastic resize, metrics, evaluation and the guards.
tp > 1 runs whatever the module does with `mesh.tp_group` (megalite's parallel layers, or a plan
applied in the provider); a module that ignores it is replicated over tp.

`loss_fn(output, labels)` returns the SUM of the per-token losses over the targets (labels !=
-100): the loop divides once by the global token count (all microbatches, all dp ranks). Without
one, the output's logits (`output.logits`, `output[0]` or the output itself, [b, s, V]) go
through cross entropy.

Pipeline parallelism (--pp, --virtual-stages): the provider is called once per local model chunk
with `layer_ids`, the global ids of the blocks that chunk holds (split from --num-layers as GPTModel's
stages are), `pre_process` (it takes the input ids) and `post_process` (it returns what `loss_fn`
takes). Chunks exchange activations [s, b, --hidden-size] (sequence first) in the training dtype, and
each chunk's parameters must carry their whole-model names (e.g. the other blocks' places held by
nn.Identity, as examples/custom_transformer.py does), which is what makes its checkpoints layout-free.

Context parallelism (--cp): the model is called with this cp rank's two zigzag chunks of each
sequence, [b, s/cp] (megalite.context_parallel.split_sequence; `position_ids` gives their positions),
and must attend across the cp group itself (`context_parallel_attention`); a module says it does so
with `context_parallel = True`, else --cp is refused naming that fix (every rank, before training).

Not yet for a provided model, each refused by name in one line (exit 2): --recompute selective
(megalite's attention only), --cuda-graph, MoE flags (megalite's experts only) and
--fused-linear-cross-entropy (GPT's head). The planner models GPTModel: throughput counts
6 x parameters FLOPs per token (no attention term) and --dry-run is refused.
"""
from __future__ import annotations

from megalite.config import RunConfig
from megalite.training import loop
from megalite.training.provided_model import LossFn, ModelProvider, ProvidedModel, default_loss  # noqa: F401


def train(cfg: RunConfig, model_provider: ModelProvider, loss_fn: LossFn | None = None, tokenizer=None,
          resume_plan=None) -> int:
    """megalite.training.loop.train with the user's model (see the module docstring); a resolved configuration."""
    return loop.train(cfg, tokenizer, resume_plan, model_provider=model_provider, loss_fn=loss_fn)


def main(argv: list[str] | None = None, *, model_provider: ModelProvider, loss_fn: LossFn | None = None) -> int:
    """megalite's command line (`examples/pretrain_gpt.py`'s flags) training the user's model."""
    return loop.main(argv, provided=ProvidedModel(model_provider, loss_fn or default_loss))
