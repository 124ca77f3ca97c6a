"""Shared pieces of the MoE layout tests: a tiny MoE model's configuration, per-step batches, a train loop."""
import torch

from megalite.distributed import comm
from megalite.config import RunConfig
from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step

STEPS, MICRO, GLOBAL, SEQ = 2, 2, 8, 16  # steps per run, sequences per microbatch / step, tokens


def batches(dp, dp_rank, steps=STEPS):
    """Every step's microbatches for this dp rank (the global batch split like GlobalBatchSampler)."""
    out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, 257, (GLOBAL, SEQ + 1), generator=gen)
        inputs, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[step % GLOBAL, : 3 + step] = -100  # uneven target counts across dp ranks
        per_rank = GLOBAL // dp
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        out.append([{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(MICRO), labels[mine].split(MICRO))])
    return out


def cfg_for(tp=1, pp=1, dp=1, ep=1, **kw):
    """The tiny MoE model at this layout; `kw` adds settings or overrides these (e.g. num_layers)."""
    settings = dict(micro_batch_size=MICRO, global_batch_size=GLOBAL, lr=1e-3, weight_decay=0.1, clip_grad=0.5, seed=3,
                    adam_eps=1e-6, model="moe-tiny", num_layers=2, hidden_size=64, num_attention_heads=4,
                    num_query_groups=2, ffn_hidden_size=128, seq_length=SEQ, vocab_size=257, num_experts=4,
                    moe_router_topk=2, moe_ffn_hidden_size=64, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
    return RunConfig.build(tp=tp, pp=pp, dp=dp, ep=ep, **{**settings, **kw})


def train(m, cfg, steps=range(STEPS), chunks=None, optimizer=None):
    """Train `steps` (0-based) on a new model (or the given one); the ledger holds the last step's bytes."""
    if chunks is None:
        chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
        optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    results = []
    all_batches = batches(m.dp_size, m.dp_rank, max(steps, default=-1) + 1)
    for step in steps:
        comm.ledger.reset()
        results.append(train_step(optimizer.model, optimizer, all_batches[step], m, cfg, lr=1e-3))
    return chunks, optimizer, results
