"""Communication per step, per rank and group, in comm.ledger's convention (nccl-tests sizes):
all_reduce counts the tensor, all_gather the gathered output, reduce_scatter the full input,
send/recv the tensor, all_to_all the input. Tests compare these formulas with the ledger of real runs.

Context parallelism (cp > 1): activations hold s/cp tokens, so tp and pp traffic shrink by cp;
attention adds the cp group's own traffic ('cp/send' + 'cp/recv' for ring attention,
'cp/all_to_all' for Ulysses); parameters are replicated over dp x cp, whose group the ledger
names 'dp_cp' (at cp = 1 it is the dp group, 'dp').

Hybrid sharding (--dp-shard S < dp): the ZeRO traffic above runs over the shard group, S x cp
ranks, named 'dp_shard' ('edp_shard' for the experts' members of it), and each step adds one
all-reduce of the reduced shard over the dp/S replicas, 'dp_replicate' (`add_replica_bytes`).

Gradient compression (--grad-compression powersgd): the dp gradient reduction (all-reduce at
ZeRO 0, reduce-scatter at ZeRO 1/2) becomes all-reduces of 4 * (R*(n+m) per compressed n x m
matrix + numel per other gradient) bytes (plan/compression.py), per replica group (dp or dp_cp,
and edp for the experts of an MoE model kept apart); the warm-up steps are not modelled.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megalite.config.choices import CPCommType, OptimizerKind, Recompute
from megalite.config.model import GPTConfig
from megalite.plan.muon_stage import stage_muon
from megalite.plan import fp8, fp8_amax
from megalite.plan.compression import replace_dp_grad_bytes
from megalite.plan.diloco import grad_norm_slots, is_diloco, replace_replica_bytes
from megalite.plan.mla import attention_head_dims, latent_sequence_parallel_grads, latent_tp_bytes
from megalite.plan.layout import (DTYPE_BYTES, dp_group_name, head_stage, is_hybrid, is_v_shaped, local_seq_length,
                                  recomputed_stage_layers, stage_layers, zero_group_name, zero_shard_ranks)
from megalite.plan.moe import (dispatch_bytes, expert_dp_config, experts_apart, moe_replica_bytes,
                               moe_tensor_parallel_bytes, mtp_depths, stage_expert_params, stage_moe_layers)
from megalite.plan.params import stage_params
from megalite.plan.zero3 import add_zero3_dp_bytes, add_zero3_expert_bytes

if TYPE_CHECKING:
    from megalite.config import RunConfig


def communication_bytes(model: GPTConfig, cfg: RunConfig, stage: int, whole_forward_rerun: bool = False, *,
                        step: int | None = None) -> dict[str, int]:
    """'group/op' -> bytes per optimizer step on one rank of pipeline stage `stage` (DiLoCo's differ by step,
    plan/diloco.py: those of 1-based step `step`, or the mean per step when None).

    whole_forward_rerun: full recompute re-runs each block's whole forward, the MLP output's
    reduction included (a reentrant checkpoint, as Megatron-LM's own; megalite's stops earlier).
    """
    a, t, m, v = DTYPE_BYTES[cfg.precision.precision], cfg.parallel.tp, cfg.num_microbatches, cfg.parallel.virtual_stages
    s, b, h = local_seq_length(model, cfg), cfg.training.micro_batch_size, model.hidden_size
    pp, sp = cfg.parallel.pp, cfg.parallel.sequence_parallel
    u = a * s * b * h                      # one full [s, b, h] activation ([s/cp, b, h] per cp rank)
    out: dict[str, int] = {}

    def add(key: str, n: int) -> None:
        if n:
            out[key] = out.get(key, 0) + n

    if t > 1:
        _tensor_parallel_bytes(add, model, cfg, stage, u, whole_forward_rerun)
    else:  # an MoE capacity factor under cp still gathers the microbatch's choices over cp
        for key, n in moe_tensor_parallel_bytes(model, cfg, stage, whole_forward_rerun).items():
            add(key, n)
    for key, n in context_parallel_bytes(model, cfg, stage).items():
        add(key, n)
    for group, (_, n) in fp8_amax.amax_all_reduces(model, cfg, stage).items():  # FP8's scales (plan/fp8_amax.py)
        add(f"{group}/all_reduce", n)
    params = stage_params(model, cfg, stage)
    for key, n in dispatch_bytes(model, cfg, stage).items():  # MoE token dispatch over ep
        add(key, n)
    if experts_apart(model, cfg):  # experts reduce over their own replicas (ZeRO-3: their own units)
        experts = stage_expert_params(model, cfg, stage, with_mtp=True)  # the MTP depths' experts reduce there too
        params -= experts
        edp, to_edp = expert_dp_config(cfg), lambda key, n: add(_expert_group(key), n)  # noqa: E731
        if cfg.parallel.zero == 3:
            add_zero3_expert_bytes(to_edp, cfg, experts)
        else:
            add_dp_bytes(to_edp, experts, edp)
    if cfg.parallel.zero == 3 and cfg.dp * cfg.parallel.cp > 1:
        add_zero3_dp_bytes(add, model, cfg, stage, params)
        add_replica_bytes(add, params, cfg)
    else:
        add_dp_bytes(add, params, cfg)
        replace_dp_grad_bytes(out, model, cfg, stage)  # --grad-compression powersgd: P, Q and the leftovers instead
    replace_replica_bytes(out, model, cfg, step)  # DiLoCo: its outer steps instead of the replica all-reduce
    add(f"{dp_group_name(cfg)}/all_reduce", moe_replica_bytes(model, cfg, stage))  # MoE statistics (and bias load)
    if cfg.optimizer.optimizer == OptimizerKind.MUON:  # whole matrices to their owners and back (plan/muon_stage.py)
        for key, n in stage_muon(model, cfg, stage).comm_bytes.items():
            add(key, n)
    add("embedding/all_reduce", _tied_embedding_bytes(model, cfg, stage))
    if pp > 1:
        chunk = u // (t if sp else 1)
        first, last = stage == 0, stage == pp - 1
        fwd_send = m * (v - 1 if last else v)
        fwd_recv = m * (v - 1 if first else v)
        if is_v_shaped(cfg):  # DualPipeV: stage 0 starts and ends the V, stage pp-1 turns it in memory
            fwd_send = fwd_recv = m * (v - 1 if first or last else v)
        add("pp/send", chunk * (fwd_send + fwd_recv))   # activations forward, grads back
        add("pp/recv", chunk * (fwd_recv + fwd_send))
    return out


def _expert_group(key: str) -> str:
    """The experts' ledger key for a dense one: their shard group 'edp_shard' under hybrid sharding, the
    same replica groups ('dp_replicate'), else 'edp'."""
    group, op = key.split("/", 1)
    return {"dp_shard": "edp_shard", "edp_shard": "edp_shard", "dp_replicate": "dp_replicate"}.get(group, "edp") \
        + "/" + op


def _tied_embedding_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """The tied embedding's gradient summed over the embedding group (first and last stage, pp > 1; MTP's
    copy of the embedding on the last stage is tied the same way)."""
    pp, t = cfg.parallel.pp, cfg.parallel.tp
    if not (pp > 1 and (model.tie_embeddings or model.mtp_num_layers) and stage in (0, pp - 1)):
        return 0
    table = model.padded_vocab_size(t) // t * model.hidden_size
    if cfg.parallel.zero == 3:  # ZeRO-3 sums the fp32 gradient SHARD of the tied unit
        return -(-table // (cfg.dp * cfg.parallel.cp)) * 4
    return table * DTYPE_BYTES[cfg.precision.grad_reduce_dtype]


def _tensor_parallel_bytes(add, model: GPTConfig, cfg: RunConfig, stage: int, u: int,
                           whole_forward_rerun: bool) -> None:
    """The tp group's bytes of one stage per step (see communication_bytes); u: one [s, b, h] activation."""
    t, m, pp, sp = cfg.parallel.tp, cfg.num_microbatches, cfg.parallel.pp, cfg.parallel.sequence_parallel
    s, b = local_seq_length(model, cfg), cfg.training.micro_batch_size
    depths = mtp_depths(model, cfg, stage)  # each MTP depth runs a block (never recomputed) and the head
    layers = stage_layers(model, cfg)[stage] + depths
    # Full recompute re-runs a block's forward until its last saved tensor is packed (torch's
    # non-reentrant checkpoint stops there, after the MLP output GEMM): both input gathers
    # and the attention output's reduction again, not the MLP output's reduction.
    rerun = recomputed_stage_layers(model, cfg)[stage]
    # an MoE block's MLP part runs collectives of its own (plan/moe.py); attention is every block's
    mlps = layers - stage_moe_layers(model, cfg, stage, with_mtp=True)
    mlp_rerun = rerun - stage_moe_layers(model, cfg, stage, recomputed=True)
    mlp_rerun_reductions = mlp_rerun if whole_forward_rerun else 0
    if sp:
        # fwd: all-gather before QKV and MLP-in, reduce-scatter after out-proj and MLP-out;
        # bwd: the transposes, plus QKV and MLP-in re-gather the input shard they kept
        # (FP8: the QKV / MLP-in input gathers, fwd + re-gather, go in FP8: plan/fp8.py); a re-run block
        # gathers its inputs forward once more
        a, tokens = DTYPE_BYTES[cfg.precision.precision], s * b
        forward, regather = fp8.sp_input_gathers(cfg, u, a, tokens)
        inputs = forward + regather
        add("tp/all_gather", m * (layers * (u + inputs) + rerun * forward + mlps * (u + inputs)
                                  + mlp_rerun * forward))
        add("tp/reduce_scatter", m * (2 * layers + rerun + 2 * mlps + mlp_rerun_reductions) * u)
    else:
        add("tp/all_reduce", m * (2 * layers + rerun + 2 * mlps + mlp_rerun_reductions) * u)  # Megatron's 4 per layer
    for key, n in moe_tensor_parallel_bytes(model, cfg, stage, whole_forward_rerun).items():
        add(key, n)
    if model.mla is not None:  # DeepSeek's latent attention moves its latents, not x (plan/mla.py)
        per_token = DTYPE_BYTES[cfg.precision.precision] * s * b
        a = DTYPE_BYTES[cfg.precision.precision]
        for key, n in latent_tp_bytes(model, u=u, per_token=per_token, microbatches=m, layers=layers, rerun=rerun,
                                      sequence_parallel=sp,
                                      gathers=lambda nbytes: fp8.sp_input_gathers(cfg, nbytes, a, s * b)).items():
            add(key, n)
    # the vocab-parallel embedding: fwd reduce (-scatter), bwd its transpose under SP; once on stage 0 and
    # once per MTP depth (Emb(t_{i+k}))
    embeddings = m * ((stage == 0) + depths)
    add("tp/reduce_scatter" if sp else "tp/all_reduce", embeddings * u)
    add("tp/all_gather", embeddings * u if sp else 0)
    if stage == head_stage(cfg):  # the last stage; stage 0 under DualPipeV; the head once more per MTP depth
        heads = m * (1 + depths)
        if sp:
            add("tp/all_gather", 2 * heads * u)                     # output-layer input, fwd + bwd
            add("tp/reduce_scatter", heads * u)                     # and its gradient
        else:
            add("tp/all_reduce", heads * u)                         # grad of the copied input
        add("tp/all_reduce", heads * (2 * t + 1) * 4 * s * b)       # CE: per-rank max, sum-exp; target
        # M_k (column-parallel, [2h] -> [h/tp], its output gathered over h): without SP fwd that gather (u), bwd
        # the [2h] input's gradient summed (2u); under SP also its [2h] input gathered fwd and again in bwd (4u),
        # the output's sequence split transposed in bwd (u), the input's gradient reduce-scattered (2u)
        add("tp/all_gather", m * depths * (6 if sp else 1) * u)
        add("tp/reduce_scatter" if sp else "tp/all_reduce", m * depths * 2 * u)
    add("tp/all_reduce", sequence_parallel_grad_bytes(model, cfg, stage))


def sequence_parallel_grad_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """Under SP the gradients of the norms, the row-parallel biases (added to the sequence shard)
    and gpt2's position table are partial per tp rank; the DP engine all-reduces them over tp
    once per step (fp32 main grads)."""
    if not cfg.parallel.sequence_parallel or cfg.parallel.tp == 1:
        return 0
    h = model.hidden_size
    norm = 2 * h if model.flavour == "gpt2" else h
    depths = mtp_depths(model, cfg, stage)  # each MTP depth: a block and its enorm, hnorm and final norm
    layers = stage_layers(model, cfg)[stage] + depths
    mlps = layers - stage_moe_layers(model, cfg, stage, with_mtp=True)  # an MoE block's MLP has no row bias
    n = 2 * norm * layers + (h * (layers + mlps) if model.add_bias else 0) + 3 * norm * depths
    if model.mla is not None:  # the latent norms and the replicated down-projections
        n += latent_sequence_parallel_grads(model, layers)
    if stage == head_stage(cfg):
        n += norm
    if stage == 0 and model.flavour == "gpt2":
        n += model.seq_length * h
    per_step = cfg.num_microbatches if cfg.parallel.zero == 3 else 1  # ZeRO-3 reduces every microbatch
    return per_step * n * DTYPE_BYTES[cfg.precision.grad_reduce_dtype]


def context_parallel_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> dict[str, int]:
    """The cp group's traffic per step on one rank of `stage`: attention's, per layer and microbatch.

    With b, h, h_kv this tp rank's batch and heads, d_qk and d_v a head's query/key and value channels
    (both d, except under latent attention), s/cp its tokens, a the activation bytes, and F forward passes
    of a layer's attention (1, 2 under selective recompute, 2 for the blocks full recompute re-runs),
    B = 1 backward:
      ring (p2p), U = b*h_kv*(s/cp)*(d_qk + d_v): send = recv = F*(cp-1)*U*a + B*((cp-1)*U*a + cp*U*4)
        (K/V go cp-1 hops; in backward K/V again and the fp32 dK/dV cp hops, home included);
      Ulysses (a2a): all_to_all = (F + B) * ((h + h_kv)*d_qk + (h_kv + h)*d_v) * b*(s/cp)*a (q, k, v there,
        the output back).
    """
    p = cfg.parallel
    if p.cp == 1:
        return {}
    a, t, m, cp = DTYPE_BYTES[cfg.precision.precision], p.tp, cfg.num_microbatches, p.cp
    s, b, (d_qk, d_v) = local_seq_length(model, cfg), cfg.training.micro_batch_size, attention_head_dims(model)
    h, h_kv = model.num_attention_heads // t, model.num_query_groups // t
    layers = stage_layers(model, cfg)[stage]
    rerun = layers if p.recompute == Recompute.SELECTIVE else recomputed_stage_layers(model, cfg)[stage]
    forwards, backwards = m * (layers + rerun), m * layers
    if p.cp_comm_type == CPCommType.A2A:
        return {"cp/all_to_all": (forwards + backwards) * ((h + h_kv) * d_qk + (h_kv + h) * d_v) * b * s * a}
    unit = b * h_kv * s * (d_qk + d_v)
    hops = forwards * (cp - 1) * unit * a + backwards * ((cp - 1) * unit * a + cp * unit * 4)
    return {"cp/send": hops, "cp/recv": hops}


def add_dp_bytes(add, params: int, cfg: RunConfig) -> None:
    """Data-parallel traffic for `params` parameters on this rank (over dp x cp: its replicas; under
    hybrid sharding over the shard group, then `add_replica_bytes`)."""
    if cfg.dp * cfg.parallel.cp == 1:
        return
    add_replica_bytes(add, params, cfg)
    if zero_shard_ranks(cfg) == 1:  # S = 1, cp = 1: a shard group of one rank sends nothing
        return
    p, g, m = DTYPE_BYTES[cfg.precision.precision], DTYPE_BYTES[cfg.precision.grad_reduce_dtype], cfg.num_microbatches
    group = zero_group_name(cfg)
    if cfg.parallel.zero == 0:
        add(f"{group}/all_reduce", params * g)
    elif cfg.parallel.zero == 1:
        add(f"{group}/reduce_scatter", params * g)        # once per step, in grad_reduce_dtype
        add(f"{group}/all_gather", params * p)            # updated params after the sharded step
    elif cfg.parallel.zero == 2:
        add(f"{group}/reduce_scatter", params * g)        # also once, during the last microbatch
        add(f"{group}/all_gather", params * p)
    else:  # ZeRO-3 from a parameter count alone: plan/zero3.py has the full accounting
        add(f"{group}/reduce_scatter", m * params * g)
        add(f"{group}/all_gather", 2 * m * params * p)    # params gathered for forward and backward


def add_replica_bytes(add, params: int, cfg: RunConfig) -> None:
    """Hybrid sharding's all-reduce across the dp/S replica groups, once per step, into
    `add("dp_replicate/all_reduce", bytes)`: the reduced shard of `params` (ZeRO 1/2: in
    --grad-reduce-dtype, bucket by bucket; ZeRO-3: the step's fp32 gradient shard; ZeRO 0: the
    whole gradient, nothing being sharded)."""
    if not is_hybrid(cfg):
        return
    g, shard = DTYPE_BYTES[cfg.precision.grad_reduce_dtype], -(-params // zero_shard_ranks(cfg))
    zero = cfg.parallel.zero
    add("dp_replicate/all_reduce", params * g if zero == 0 else shard * (4 if zero == 3 else g))


def step_scalar_collectives(cfg: RunConfig) -> dict[str, tuple[int, int]]:
    """Ledger group -> (ranks in it, count) of the one-element all-reduces every step waits for on
    one rank: the step's target-token count (over dp x cp; under DiLoCo over each replica group's
    shard group, then summed over 'dp_replicate'), the finiteness check of the loss and
    the mean loss (the world), and the gradient norm (the model-parallel group tp x pp, or the
    world when ZeRO shards the gradients over dp x cp or the experts differ over ep > 1:
    optim/clip.reduce_square_sum); with MTP depths, their D losses in one more (the world:
    model/mtp.mtp_stats). Groups of one rank issue none."""
    tp, pp, cp, dp, world = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.dp, cfg.world_size
    out: dict[str, tuple[int, int]] = {}

    def add(group: str, ranks: int, count: int) -> None:
        if ranks > 1:
            out[group] = (ranks, out.get(group, (ranks, 0))[1] + count)

    if is_diloco(cfg):  # each replica group counts its own tokens, then the groups' counts are summed
        add(zero_group_name(cfg), cfg.dp_shard * cp, 1)
        add("dp_replicate", dp // cfg.dp_shard, 1)
    else:
        add(dp_group_name(cfg), dp * cp, 1)
    add("world", world, 2 + (cfg.gpt_config().mtp_num_layers > 0))
    if (cfg.parallel.zero and dp * cp > 1) or cfg.parallel.ep > 1:
        add("world", world, 1)
    else:
        add("mp", tp * pp, 1)
    return out


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor: bytes on the busiest link per byte of ledger size."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # send, recv, broadcast
