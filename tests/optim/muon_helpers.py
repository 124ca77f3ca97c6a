"""Shared by the Muon tests: a small Llama-flavour GPT (fused qkv with grouped queries, SwiGLU's fused
gate/up), its data, and the single-process oracle: torch.optim.Muon on the hidden matrices' blocks
plus torch.optim.AdamW on the rest, clipped by torch.nn.utils.clip_grad_norm_."""
import math

import torch
from torch import nn

from megalite.parameters import params as P
from megalite.model import GPTModel, preset
from megalite.optim.muon import default_hidden_matrix, matrix_blocks

GLOBAL_BATCH, SEQ, STEPS = 4, 16, 5
# AdamW's lr and eps as tests/optim/test_gpt_3d.py explains (Adam magnifies last-bit gradient differences of
# near-zero elements by up to lr/eps); Muon's group at its own lr (MuonSettings.lr)
LR, MUON_LR, WEIGHT_DECAY, CLIP, EPS = 3e-3, 2e-2, 0.1, 0.5, 1e-6


def config(**overrides):
    return preset("tiny-llama", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=48, seq_length=SEQ, **overrides)


def batch(step, vocab):
    gen = torch.Generator().manual_seed(700 + step)
    ids = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=gen)
    labels = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=gen)
    labels[0, :3] = -100
    return ids, labels, int((labels != -100).sum())


class TorchMuonAdamW:
    """The oracle: each hidden matrix's blocks as leaf tensors under torch.optim.Muon, the rest under AdamW."""

    def __init__(self, model, *, lr=LR, muon_lr=MUON_LR, adjust_lr_fn="match_rms_adamw", momentum=0.95, nesterov=True, ns_steps=5):
        named = list(model.logical_parameters())
        self.hidden = [(n, p) for n, p in named if default_hidden_matrix(n, p)]
        rest = [(n, p) for n, p in named if not default_hidden_matrix(n, p)]
        self.blocks = []  # (param, dim, start, size, leaf)
        for _, p in self.hidden:
            for dim, start, size in matrix_blocks(P.shard_spec(p)):
                self.blocks.append((p, dim, start, size, nn.Parameter(p.detach().narrow(dim, start, size).clone())))
        self.muon = torch.optim.Muon([b[-1] for b in self.blocks], lr=muon_lr, weight_decay=WEIGHT_DECAY,
                                     momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                     adjust_lr_fn=adjust_lr_fn)
        self.adamw = torch.optim.AdamW([{"params": [p for _, p in rest if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
                                        {"params": [p for _, p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                       lr=lr, eps=EPS)

    @torch.no_grad()
    def step(self):
        for p, dim, start, size, leaf in self.blocks:
            leaf.grad = p.grad.narrow(dim, start, size).clone()
        self.muon.step()
        self.adamw.step()
        for p, dim, start, size, leaf in self.blocks:
            p.narrow(dim, start, size).copy_(leaf)


def reference(steps=STEPS, cfg=None, clip=CLIP, **muon_kwargs):
    """(losses, grad norms, full parameters) of the oracle (clip None: unclipped)."""
    cfg = cfg or config()
    model = GPTModel(cfg, seed=7)
    opt = TorchMuonAdamW(model, **muon_kwargs)
    losses, norms = [], []
    for step in range(steps):
        model.zero_grad()
        ids, labels, tokens = batch(step, cfg.vocab_size)
        loss = model(ids, labels, reduction="sum") / tokens
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf)))
        opt.step()
        losses.append(float(loss.detach()))
    full = {n: P.shard_spec(p).assemble([p.detach()]) for n, p in model.logical_parameters()}
    return losses, norms, full


def run_cfg(dense=False, **kw):
    """A RunConfig of a tiny MoE Llama (both blocks MoE; `dense`: plain MLPs) under Muon, Newton-Schulz in fp32;
    `kw`: the layout."""
    from megalite.config import RunConfig
    settings = dict(micro_batch_size=2, global_batch_size=8, lr=LR, muon_lr=MUON_LR, weight_decay=WEIGHT_DECAY,
                    clip_grad=CLIP, seed=3, adam_eps=EPS, model="moe-tiny", num_layers=2, hidden_size=32,
                    num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64, seq_length=SEQ, vocab_size=257,
                    num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2,
                    optimizer="muon", muon_ns_dtype="fp32", lr_warmup_iters=0, lr_decay_style="constant")
    if dense:
        settings = {k: v for k, v in settings.items() if not k.startswith(("moe_", "num_experts"))}
        settings["model"] = "tiny-llama"
    return RunConfig.build(**{**settings, **kw})


def cfg_batches(cfg, dp, dp_rank, steps):
    """Every step's microbatches for this dp rank (the global batch split like GlobalBatchSampler)."""
    out, micro, per_rank = [], cfg.training.micro_batch_size, cfg.global_batch_size // dp
    for step in range(steps):
        gen = torch.Generator().manual_seed(900 + step)
        ids = torch.randint(0, 257, (cfg.global_batch_size, SEQ + 1), generator=gen)
        inputs, labels = ids[:, :-1], ids[:, 1:].clone()
        labels[step, :3] = -100
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        out.append([{"input_ids": i, "labels": t} for i, t in zip(inputs[mine].split(micro), labels[mine].split(micro))])
    return out


def train_cfg(m, cfg, steps):
    """(losses, {name: (spec, this rank's tensor)}, optimizer) after `steps` steps of the real train step."""
    from megalite.training.step import build_data_parallel, build_model_chunks, build_optimizer, train_step
    chunks = build_model_chunks(cfg.gpt_config(), cfg, m)
    optimizer = build_optimizer(build_data_parallel(chunks, cfg, m), cfg)
    losses = [train_step(optimizer.model, optimizer, mbs, m, cfg, None).loss  # each group at its own lr
              for mbs in cfg_batches(cfg, m.dp_size, m.dp_rank, steps)]
    optimizer.wait_for_params()
    with optimizer.model.gathered():
        params = {n: (P.shard_spec(p), p.detach().float().clone()) for c in chunks for n, p in c.logical_parameters()}
    return losses, params, optimizer
