"""megalite: Megatron-style tensor x pipeline x data parallel training in PyTorch and Triton.

The public names load on first use (PEP 562), so `import megalite` is cheap and
`import megalite.plan` (pure arithmetic) never loads torch:

    import megalite
    mesh = megalite.init_mesh(tp=2)
    up = megalite.ColumnParallelLinear(1024, 4096)
    model = megalite.DataParallel(my_model, mesh, zero_stage=1)
    optimizer = megalite.DistributedOptimizer(model, lr=3e-4, weight_decay=0.1)   # a torch.optim.Optimizer:
    # param_groups, state_dict, any torch LR scheduler; optimizer.step() (or step(lr=...)) per step
    megalite.train(cfg, model_provider=..., loss_fn=...)   # your own nn.Module in the loop (docs/own_model.md)

Your own model also gets megalite.LayerNorm / RMSNorm (sequence_parallel=True) and
mark_sequence_parallel, context_parallel_attention, and Pipeline / split_layers over your own stages
(README: "Your own model with the whole toolbox").
"""
from megalite._lazy import lazy_exports

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "megalite.config": ["RunConfig"],
    "megalite.context_parallel.attention": ["context_parallel_attention"],
    "megalite.data_parallel.wrapper": ["DataParallel"],
    "megalite.errors": ["ConfigError", "UsageError"],
    "megalite.layout": ["Layout", "LayoutError"],
    "megalite.distributed.mesh": ["Mesh", "destroy_mesh", "init_mesh"],
    "megalite.config.model": ["GPTConfig"],
    "megalite.model.gpt": ["GPTModel"],
    "megalite.optim.distributed_optimizer": ["DistributedOptimizer"],
    "megalite.optim.loss_scaler": ["DynamicLossScaler"],
    "megalite.pipeline.stages": ["Pipeline", "split_layers"],
    "megalite.tensor_parallel.cross_entropy": ["vocab_parallel_cross_entropy"],
    "megalite.tensor_parallel.layers": ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"],
    "megalite.tensor_parallel.norms": ["LayerNorm", "RMSNorm"],
    "megalite.tensor_parallel.sequence_parallel": ["mark_sequence_parallel"],
    "megalite.training.loop": ["train"],
})
