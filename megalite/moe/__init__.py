"""Mixture of experts, in three parts a reader can hold one at a time (Megatron-core's split):

- router.py      scores, deterministic top-k, capacity drops, aux / seq-aux / z losses, expert bias
- dispatcher.py  tokens to their experts' ep ranks and back: all-to-all (per-rank counts) or all-gather
- experts.py     this rank's experts (SwiGLU or GeLU), grouped GEMMs over [E_local, K, N] weights
- layer.py       MoELayer: the block's MLP made of the three (+ an optional shared expert)
- bookkeeping.py what a train step does with MoE layers (loss scale, expert-bias update, metrics)

MoEConfig, the experts' settings, is pure Python and lives with the other settings (config/moe.py).
"""
