"""Optimizers: ZeRO-sharded AdamW, whole-mesh gradient clipping, fp16 loss scaling, lr schedules."""
from megalite.optim.clip import (allreduce_sequence_parallel_grads, clip_grad_norm, counts_in_grad_norm,
                                 global_grad_norm)
from megalite.optim.adamw import adamw_update
from megalite.optim.distributed_optimizer import DistributedOptimizer, OptimizerStep, default_no_weight_decay
from megalite.optim.loss_scaler import DynamicLossScaler
from megalite.optim.lr_schedule import LRSchedule, ScheduledLR

__all__ = ["DistributedOptimizer", "DynamicLossScaler", "LRSchedule", "OptimizerStep", "ScheduledLR", "adamw_update", "allreduce_sequence_parallel_grads",
           "clip_grad_norm", "counts_in_grad_norm", "default_no_weight_decay", "global_grad_norm"]
