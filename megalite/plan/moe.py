"""Mixture of experts in the planner: expert parameters per rank, token-dispatch bytes, routing buffers.

Pure arithmetic (no torch). Per MoE block on a rank (E experts, ep ranks, tp, etp (1 or tp), expert
width f_e, T = s*b tokens of a microbatch routed per rank: at etp = tp every tp rank routes the
whole sequence (under SP the block gathers it), at etp = 1 each tp rank its own T/tp):

- parameters: the router E*h (replicated), E/ep local experts of (h*mlp_in + f_e*h)/etp each
  (mlp_in = 2 f_e for SwiGLU), a shared expert's dense MLP /tp, instead of the dense MLP;
- expert parameters are replicated over the expert-data-parallel group (dp*cp/ep ranks, times tp
  at etp = 1): their ZeRO shards, gradient reductions and gathers run there (ledger group "edp"
  when ep > 1 or etp < tp);
- all-to-all dispatcher: per microbatch and block, forward the counts (E int64) and two
  all-to-alls of the k*T routes ([T*k, h], dispatch and combine), backward two more: 4*a*T*k*h
  + 8*E bytes on the "ep" group (comm.ledger counts an all-to-all's input, rows to itself
  included); all-gather dispatcher: tokens, routes and weights gathered, the output reduce-scattered;
- tp traffic of the block (instead of the dense MLP's), as layer.py runs it: see moe_tensor_parallel_bytes;
- routing buffers kept for backward, per block and microbatch: the experts' input rows and the rows
  combined 2*a*T*k*h, the experts' intermediates a*T*k*(mlp_in + f_e)/etp, the router's input, its fp32
  probabilities and the route indices (routing_activation_bytes): replacing the dense MLP's activations.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from megalite.config.choices import Fp8ScalingRecipe, MoEDispatcher, Recompute
from megalite.config.model import GPTConfig
from megalite.pipeline.partition import ChunkPlacement, stage_layers as partition_stage_layers
from megalite.plan.layout import DTYPE_BYTES, chunk_placement_of, head_stage

if TYPE_CHECKING:
    from megalite.config import RunConfig


def stage_moe_layers(model: GPTConfig, cfg: RunConfig, stage: int, recomputed: bool = False, *,
                     with_mtp: bool = False) -> int:
    """MoE blocks held by pipeline stage `stage` (every chunk of it); recomputed: only those full
    recompute re-runs (the first recompute_num_layers of each chunk, or all; none without it).
    with_mtp: the head stage's MTP depths with experts too (never recomputed), for what a block moves."""
    p = cfg.parallel
    if model.moe is None or (recomputed and p.recompute != Recompute.FULL):
        return 0
    depths = mtp_moe_depths(model, cfg, stage) if with_mtp and not recomputed else 0
    return depths + _moe_layers(model.moe, model.num_layers, p.pp, p.virtual_stages, p.decoder_first_stage_layers,
                                p.decoder_last_stage_layers, p.pipeline_layout, stage,
                                p.recompute_num_layers if recomputed else None, chunk_placement_of(cfg))


def mtp_depths(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """MTP depths run by a rank of `stage`: all of them on the head stage, none elsewhere."""
    return model.mtp_num_layers if stage == head_stage(cfg) else 0


def mtp_moe_depths(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """The MTP depths of `stage` whose block has experts (depth k is block num_layers + k)."""
    return sum(model.is_moe_block(model.num_layers + k) for k in range(mtp_depths(model, cfg, stage)))


@lru_cache(maxsize=8192)
def _moe_layers(moe, num_layers: int, pp: int, v: int, first: int | None, last: int | None, layout: str | None,
                stage: int, per_chunk_cap: int | None, placement: ChunkPlacement = ChunkPlacement.INTERLEAVED) -> int:
    """stage_moe_layers' count, cached: the planner's search asks it for every stage of every candidate."""
    ranges = [range(num_layers)] if pp == 1 else partition_stage_layers(num_layers, pp, v, stage, first, last, layout,
                                                                        placement=placement)
    if per_chunk_cap is not None:
        ranges = [r[:per_chunk_cap] for r in ranges]
    return sum(moe.is_moe_layer(i) for r in ranges for i in r)


def _mlp_params(model: GPTConfig, ffn: int, tp: int, bias: bool) -> int:
    mlp_in = ffn if model.flavour == "gpt2" else 2 * ffn
    return (model.hidden_size * mlp_in + ffn * model.hidden_size) // tp + ((mlp_in // tp + model.hidden_size)
                                                                          if bias else 0)


def expert_params_per_layer(model: GPTConfig, cfg: RunConfig) -> int:
    """One MoE block's expert parameters on one rank: E/ep experts, each /etp."""
    moe = model.moe
    return moe.num_experts // cfg.parallel.ep * _mlp_params(model, moe.expert_ffn(model.ffn_hidden_size),
                                                           cfg.etp_size, False)


def experts_apart(model: GPTConfig, cfg: RunConfig) -> bool:
    """Whether the experts have a replica group of their own (ep > 1, or whole experts over tp > 1)."""
    return model.moe is not None and (cfg.parallel.ep > 1 or cfg.experts_whole)


def routed_tokens(model: GPTConfig, cfg: RunConfig) -> int:
    """Tokens of a microbatch one rank routes: s/cp * b, split over tp at etp = 1."""
    tokens = model.seq_length // cfg.parallel.cp * cfg.training.micro_batch_size
    return tokens // (cfg.parallel.tp // cfg.etp_size)


def dense_change_per_layer(model: GPTConfig, cfg: RunConfig) -> int:
    """An MoE block's non-expert parameters minus the dense MLP's it replaces (one rank)."""
    moe, tp = model.moe, cfg.parallel.tp
    shared = _mlp_params(model, moe.shared_expert_intermediate_size, tp, False) \
        if moe.shared_expert_intermediate_size else 0
    shared += model.hidden_size * moe.shared_expert_gate  # Qwen2-MoE's [1, h] gate, replicated
    return moe.num_experts * model.hidden_size + shared - _mlp_params(model, model.ffn_hidden_size, tp, model.mlp_bias)


def stage_expert_params(model: GPTConfig, cfg: RunConfig, stage: int, *, with_mtp: bool = False) -> int:
    """Expert parameters of one rank of stage `stage` (sharded over ep, replicated over expert-dp;
    with_mtp: the MTP depths' experts too)."""
    layers = stage_moe_layers(model, cfg, stage, with_mtp=with_mtp)
    return layers * expert_params_per_layer(model, cfg) if layers else 0


def expert_dp_config(cfg: RunConfig) -> RunConfig:
    """The layout the experts' replicas see: dp*cp/ep replicas (x tp at etp = 1), no cp (for
    model_state_bytes, add_dp_bytes)."""
    whole = cfg.parallel.tp // cfg.etp_size
    edp = cfg.dp * cfg.parallel.cp // cfg.parallel.ep * whole
    # hybrid sharding: the experts' shard group is the expert-dp members of one replica group
    shard = cfg.dp_shard * cfg.parallel.cp // cfg.parallel.ep * whole if cfg.dp_shard < cfg.dp else None
    return cfg.replace(dp=edp, cp=1, dp_shard=shard, num_distributed_optimizer_instances=None)


def balanced_routes(routes: int, num_experts: int, ep: int, source: int, dest: int) -> list[int]:
    """The planner's routing assumption (dropless, balanced), as counts: of the `routes` rows ep rank
    `source` routes, how many go to each local expert of ep rank `dest` ([num_experts/ep] ints).

    Every rank sends routes/ep to each ep rank (the remainder r, one each, to the r ranks after
    itself: so every rank also receives exactly `routes`), split evenly over that rank's experts
    (the first ones one more). dispatch_bytes' 2*T*k rows per forward (sent, then received back)
    and routing_activation_bytes' T*k received rows are this; `--simulate` answers the dispatcher's
    count exchange with it (a meta tensor has no counts: megalite/simulate/routing.py)."""
    local = num_experts // ep
    share, extra = divmod(routes, ep)
    to_dest = share + (1 if (dest - source - 1) % ep < extra else 0)
    per_expert, rest = divmod(to_dest, local)
    return [per_expert + (1 if e < rest else 0) for e in range(local)]


def dispatch_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> dict[str, int]:
    """'ep/op' -> bytes per step on one rank of stage `stage` (dropless: every route travels)."""
    layers, ep = stage_moe_layers(model, cfg, stage, with_mtp=True), cfg.parallel.ep
    if not layers or ep == 1:
        return {}
    a, m, k, h = DTYPE_BYTES[cfg.precision.precision], cfg.num_microbatches, model.moe.topk, model.hidden_size
    tokens = routed_tokens(model, cfg)
    forwards = m * (layers + stage_moe_layers(model, cfg, stage, recomputed=True))  # full recompute dispatches again
    if cfg.parallel.moe_token_dispatcher_type == MoEDispatcher.ALLGATHER:
        gathered = ep * tokens
        return {"ep/all_gather": forwards * gathered * (h * a + k * 8 + k * a) + m * layers * gathered * h * a,
                "ep/reduce_scatter": forwards * gathered * h * a + m * layers * gathered * (h + k) * a}
    routes = tokens * k
    return {"ep/all_to_all": forwards * (2 * routes * h * a + 8 * model.moe.num_experts)
            + m * layers * 2 * routes * h * a}


def routing_activation_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """Bytes an MoE block keeps for backward beyond the attention part, per microbatch (one rank), as
    moe/layer.py, router.py and dispatcher.py keep them. T tokens of the microbatch, T' = T/tp of them
    routed here at etp 1, R = T' k routes (dropless, balanced: as many received as sent):

    - the experts' rows: their input [R, h] (the permuted or received copy), the rows the unpermute
      combines [R, h], fc1's output the activation keeps and fc2's input: a R (2h + (mlp_in + f_e)/etp);
    - the route indices (int64 [R]): the permutation's and the unpermute's, and with the all-to-all at
      ep > 1 the received rows' expert order and its inverse; the experts' group sizes [E/ep]; the
      routing weights [T', k] in the training dtype;
    - the router: its input (router_input_bytes), its probabilities [T', E] fp32 and chosen experts
      [T', k] int64 (the weights' normalisation and the balancing losses keep a few [T']-sized more);
    - a shared expert: its input [T, h] and its MLP's intermediates."""
    moe, a, t, etp = model.moe, DTYPE_BYTES[cfg.precision.precision], cfg.parallel.tp, cfg.etp_size
    tokens = model.seq_length // cfg.parallel.cp * cfg.training.micro_batch_size
    mine = routed_tokens(model, cfg)  # routed on this rank (T/tp at etp = 1)
    routes, f = mine * moe.topk, moe.expert_ffn(model.ffn_hidden_size)
    mlp_in = f if model.flavour == "gpt2" else 2 * f
    total = a * routes * (2 * model.hidden_size + mlp_in // etp + f // etp)
    exchanged = cfg.parallel.ep > 1 and cfg.parallel.moe_token_dispatcher_type == MoEDispatcher.ALLTOALL
    total += 8 * routes * (4 if exchanged else 2) + 8 * (moe.num_experts // cfg.parallel.ep) + a * routes
    total += router_input_bytes(model, cfg) + 4 * mine * moe.num_experts + 8 * routes
    if moe.shared_expert_intermediate_size:
        s_f = moe.shared_expert_intermediate_size
        total += a * tokens * (model.hidden_size + (2 if model.flavour == "gpt2" else 3) * s_f // t)
    return total


def router_input_bytes(model: GPTConfig, cfg: RunConfig) -> int:
    """What the router's linear keeps of its input, F.linear(tokens.float(), weight.float()): under a training
    dtype narrower than fp32, fp32 copies of the T' tokens [T', h] and of its weight [E, h]; in fp32 the
    tokens themselves, whose storage is the whole [T, h] the block routes from (the norm output or, under
    SP, its gather: at etp 1 without SP this rank's rows are a view of it), except the rank's own shard
    under SP at etp 1 ([T', h]). That whole [T, h] is a shared expert's input too, counted there (unless
    tensorwise FP8 keeps that input in 1 byte)."""
    moe, h, p = model.moe, model.hidden_size, cfg.parallel
    mine = routed_tokens(model, cfg)
    if DTYPE_BYTES[cfg.precision.precision] != 4:
        return 4 * (mine * h + moe.num_experts * h)
    if p.sequence_parallel and cfg.etp_size == 1 and p.tp > 1:
        return 4 * mine * h
    shared_keeps_it = moe.shared_expert_intermediate_size and not (
        cfg.precision.fp8_format is not None and cfg.precision.fp8_recipe == Fp8ScalingRecipe.TENSORWISE)
    return 0 if shared_keeps_it else 4 * model.seq_length // p.cp * cfg.training.micro_batch_size * h


def _capacity_gather_bytes(moe, cp: int, tokens: int) -> int:
    """One forward's gather of a capacity factor's choices: the microbatch's cp*tokens [T, k] ids (int64)
    and weights (fp32), and under cp each token's index (int64); 0 when dropless."""
    if moe.capacity_factor is None:
        return 0
    return cp * tokens * (moe.topk * (8 + 4) + (8 if cp > 1 else 0))


def moe_tensor_parallel_bytes(model: GPTConfig, cfg: RunConfig, stage: int, whole_forward_rerun: bool = False
                              ) -> dict[str, int]:
    """'group/op' -> bytes per step of the stage's MoE blocks on the tp group (tp_cp for the router's
    counts at etp 1 under cp), in place of the dense MLP's; u = one [s/cp, b, h] activation, F = forwards
    (1, 2 for a block full recompute re-runs; a reduction after the block's last saved tensor runs
    again only with whole_forward_rerun), per block and microbatch:

    etp = tp: SP gathers the sequence (F u) and the output's scatter gathers its gradient (u); the
    experts' output is all-reduced (F R h a, R = T k routes: a rank's mean, dropless) and the
    routed tokens' gradient too (u).
    etp = 1: no tp collective on the routed tokens; without SP the entry split gathers the gradient (u)
    and the exit gathers the output (u, again in a whole rerun); the router's counts are summed over
    the token group (F 4E fp32, seq_aux F 4bE); per step the router's gradient E h (grad_reduce_dtype, over tp;
    ZeRO-3: per microbatch), the metrics (E+4 float64) and the expert bias's load (E fp32).
    A capacity factor gathers the microbatch's [cp T, k] ids (int64) and fp32 weights (F), and under
    cp each token's index (int64), over the token group (etp 1: tp or tp_cp; etp = tp: cp).
    Shared expert (a dense non-SP tp MLP on the whole sequence): its output reduction (u, whole rerun
    again) and its input's gradient (u); under SP at etp 1 also the sequence gathered (F u) and its
    output's scatter gradient (u); at etp 1 without SP its output's scatter gradient (u).
    """
    layers, p = stage_moe_layers(model, cfg, stage, with_mtp=True), cfg.parallel
    if not layers or (p.tp == 1 and (p.cp == 1 or model.moe.capacity_factor is None)):
        return {}
    moe, t, m, sp = model.moe, p.tp, cfg.num_microbatches, p.sequence_parallel
    a, g = DTYPE_BYTES[cfg.precision.precision], DTYPE_BYTES[cfg.precision.grad_reduce_dtype]
    b, h, e = cfg.training.micro_batch_size, model.hidden_size, moe.num_experts
    tokens = model.seq_length // p.cp * b
    u, rerun = a * tokens * h, stage_moe_layers(model, cfg, stage, recomputed=True)
    forwards, whole = m * (layers + rerun), m * (layers + (rerun if whole_forward_rerun else 0))
    out: dict[str, int] = {}

    def add(key: str, n: int) -> None:
        if n:
            out[key] = out.get(key, 0) + n

    capacity = forwards * _capacity_gather_bytes(moe, p.cp, tokens)
    if t == 1:  # only the capacity's gather over cp
        add("cp/all_gather", capacity)
        return out
    if moe.shared_expert_intermediate_size:
        add("tp/all_reduce", (whole + m * layers) * u)
        if cfg.etp_size == 1:
            add("tp/all_gather", (forwards if sp else 0) * u + m * layers * u)
    if cfg.etp_size == t:
        add("cp/all_gather", capacity if p.cp > 1 else 0)
        add("tp/all_gather", (forwards + m * layers) * u if sp else 0)
        add("tp/all_reduce", forwards * tokens * moe.topk * h * a + m * layers * u)
        return out
    if not sp:
        add("tp/all_gather", (m * layers + whole) * u)
    counts = {"aux_loss": 4 * e, "seq_aux_loss": 4 * b * e}.get(moe.load_balancing_type, 0)
    add("tp/all_reduce" if p.cp == 1 else "tp_cp/all_reduce", forwards * counts)
    add("tp/all_gather" if p.cp == 1 else "tp_cp/all_gather", capacity)
    per_step = m if p.zero == 3 else 1
    bias = 4 * e if moe.enable_expert_bias else 0
    add("tp/all_reduce", layers * (per_step * e * h * g + (e + 4) * 8 + bias))
    return out


def moe_replica_bytes(model: GPTConfig, cfg: RunConfig, stage: int) -> int:
    """Bytes per step one rank of `stage` all-reduces over its token replicas (dp x cp: ledger 'dp' or
    'dp_cp') for the MoE blocks' bookkeeping, per block: the step's statistics (moe/bookkeeping.moe_stats:
    E loads, aux and z losses, drops and forwards, E+4 float64) and, with an expert bias, its load
    (E fp32, router.update_expert_bias). 0 without replicas or MoE blocks on the stage."""
    layers = stage_moe_layers(model, cfg, stage, with_mtp=True)
    if not layers or cfg.dp * cfg.parallel.cp == 1:
        return 0
    e = model.moe.num_experts
    return layers * ((e + 4) * 8 + (4 * e if model.moe.enable_expert_bias else 0))
