"""Which layout to run: step time by part, layout suggestions, and the one-line reason for a choice.

`suggest()` ranks the layouts of N GPUs that fit by `step_time()` (the model of `timing.py` on a
hardware profile of `hardware.py`); `justify()` is the reason printed at start-up. Built on
`per_rank.py` (the accounting) and `validity.py` (validity).
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config.choices import CPCommType, Recompute
from megalite.config import CPCommType, Recompute, RunConfig
from megalite.config.model import GPTConfig
from megalite.plan.per_rank import Estimate, estimate
from megalite.plan.hardware import HardwareProfile, load_profile
from megalite.plan.layout import GB
from megalite.plan.search import fits, search
from megalite.plan.timing import predict_step_time
from megalite.plan.units import human_bytes, human_count
from megalite.plan.validity import preflight


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Suggestion:
    cfg: RunConfig
    estimate: Estimate
    step_time_s: float
    reason: str


def step_time(model: GPTConfig, cfg: RunConfig, est: Estimate | None = None, gpus_per_node: int | None = None,
              hardware: str | HardwareProfile | None = None) -> dict:
    """Seconds per step, by part, on `hardware` (a built-in profile name, a profile file or a
    HardwareProfile; default H100-SXM): see `megalite.plan.timing` for the model. Keys: compute,
    tp, cp, pp, dp, bubble, optimizer, sync, offload, total. `est` is accepted for callers that have one."""
    return predict_step_time(model, cfg, hardware, ranks_per_node=gpus_per_node).breakdown()


# The practitioners' order when a model does not fit: ZeRO-2 first, ZeRO-3 when stage 2 does not
# fit, the optimizer offload last. Each later step is justified by the size of the one before.
_EARLIER = {"zero3": ("ZeRO-2", dict(zero=2)), "offload": ("ZeRO-3 on the GPU", dict(offload_optimizer=False))}


def _why_not_earlier(model: GPTConfig, cfg: RunConfig, gpu_memory: float | None, step: str) -> str:
    """' (ZeRO-2 would need X GB)' for a ZeRO-3 (step 'zero3') or offloaded ('offload') layout,
    when a GPU size is known."""
    if not gpu_memory or (step == "zero3" and cfg.parallel.zero != 3):
        return ""
    name, change = _EARLIER[step]
    if step == "offload" and cfg.parallel.zero != 3:
        name = f"ZeRO-{cfg.parallel.zero} without offload"
    needed = estimate(model, cfg.replace(**change)).total_bytes
    return f" ({name} would need {needed / GB:.1f} GB)"


def _reason(model: GPTConfig, cfg: RunConfig, est: Estimate, parts: dict, gpu_memory: float | None,
            gpus_per_node: int, hardware: str | HardwareProfile | None) -> str:
    par, bits = cfg.parallel, []
    if par.tp > 1:
        where = "NVLink" if par.tp <= gpus_per_node else "across nodes"
        bits.append(f"tp={par.tp} on {where} ({parts['tp'] / parts['total']:.0%} of the step)")
    if par.cp > 1:
        method = "ring attention" if par.cp_comm_type == CPCommType.P2P else "Ulysses all-to-all"
        bits.append(f"cp={par.cp} ({method}) splits each sequence: activations /{par.cp} "
                    f"({parts['cp'] / parts['total']:.0%} of the step exposed)")
    if par.ep > 1:
        bits.append(f"ep={par.ep} shards the experts: {human_count(est.params_per_rank)} parameters per rank, "
                    f"{human_bytes(est.comm_bytes.get('ep/all_to_all', 0))} of token all-to-all per step")
    if model.moe is not None and par.tp > 1:
        bits.append(f"etp={par.etp}: " + ("whole experts on every tp rank, each routing its own 1/tp of the tokens"
                                          if par.etp == 1 else "experts split over tp, the sequence gathered"))
    if par.pp > 1:
        chunks = f"x{par.virtual_stages} chunks" if par.virtual_stages > 1 else ""
        bits.append(f"pp={par.pp}{chunks} bubble {est.bubble_fraction:.0%}")
    if par.tp * par.pp * par.cp == 1:
        bits.append("pure data parallel (model fits one GPU)")
    if par.zero:
        sharded = ("optimizer", "optimizer+grads", "all states")[par.zero - 1]
        over = f"dp={cfg.dp}" if par.cp == 1 else f"dp x cp = {cfg.dp * par.cp}"
        if cfg.dp_shard < cfg.dp:  # hybrid sharding
            over = (f"dp_shard={cfg.dp_shard}" + (" x cp" if par.cp > 1 else "")
                    + f", replicated x{cfg.dp // cfg.dp_shard}")
        bits.append(f"ZeRO-{par.zero} shards {sharded} over {over}" + _why_not_earlier(model, cfg, gpu_memory, "zero3"))
    if par.recompute != Recompute.NONE:
        bits.append(f"{par.recompute} recompute (+{est.hardware_flops_per_step / est.flops_per_step - 1:.0%} FLOPs)")
    if par.offload_optimizer:
        bits.append("optimizer offloaded to host" + _why_not_earlier(model, cfg, gpu_memory, "offload"))
    bits.append(f"{est.total_bytes / GB:.1f}/{gpu_memory / GB:.0f} GB" if gpu_memory
                else f"{human_bytes(est.total_bytes)} per rank")
    return f"~{parts['total']:.3g} s/step on {load_profile(hardware).name}: " + "; ".join(bits)


def justify(model: GPTConfig, cfg: RunConfig, gpu_memory: float | None = None, gpus_per_node: int | None = None,
            hardware: str | HardwareProfile | None = None) -> str:
    """The planner's one-line account of a chosen layout (as --suggest words it), for the run's
    start banner and the file saved beside checkpoints."""
    est = estimate(model, cfg)
    gpus_per_node = gpus_per_node or cfg.parallel.tp
    return _reason(model, cfg, est, step_time(model, cfg, est, gpus_per_node, hardware), gpu_memory, gpus_per_node,
                   hardware)


def _context_parallel_choices(model: GPTConfig, cfg: RunConfig) -> list[tuple[int, CPCommType]]:
    """(cp, comm type) to try with this (tp, pp): cp = 1, and when the sequence makes activations
    dominate (more than the model states at micro batch 1 without recompute), every cp splitting
    the ranks left for dp and the sequence, with ring attention and with Ulysses."""
    choices = [(1, CPCommType.P2P)]
    if preflight(model, cfg, cfg.world_size):
        return choices
    est = estimate(model, cfg)
    if est.activation_bytes <= est.param_bytes + est.grad_bytes + est.optimizer_state_bytes:
        return choices
    return choices + [(cp, kind) for cp in _divisors(cfg.dp) if cp > 1 and model.seq_length % (2 * cp) == 0
                      for kind in CPCommType]


def _expert_parallel_choices(model: GPTConfig, replicas: int) -> list[int]:
    """ep to try: 1 for a dense model; for experts every ep dividing both dp*cp and the expert count."""
    if model.moe is None:
        return [1]
    return [d for d in _divisors(replicas) if model.moe.num_experts % d == 0]


def _etp_choices(model: GPTConfig, tp: int, cp: int) -> list[int]:
    """etp to try: 1 for a dense model or at tp 1; for experts under tp both 1 (whole experts, each tp
    rank routing its own s/(tp*cp) tokens: the sequence must divide) and tp (experts split like the MLP)."""
    if model.moe is None or tp == 1:
        return [1]
    return ([1] if model.seq_length % (tp * cp) == 0 else []) + [tp]


def _candidates(model: GPTConfig, base: RunConfig, gpus: int, gpus_per_node: int, offload: bool):
    """Every layout suggest() tries: tp within a node, pp dividing the layers, cp when activations
    dominate, ep and etp for experts, v, ZeRO, recompute, micro batch."""
    for tp in [d for d in _divisors(gpus_per_node) if gpus % d == 0]:
        try:
            model.check_tensor_parallel(tp)
        except ValueError:
            continue
        for pp in [d for d in _divisors(gpus // tp) if model.num_layers % d == 0]:
            ranks = gpus // (tp * pp)  # dp x cp
            plain = base.replace(tp=tp, pp=pp, dp=ranks, micro_batch_size=1, sequence_parallel=tp > 1,
                                 pipeline_schedule=None)
            for cp, cp_comm_type in _context_parallel_choices(model, plain):
                dp = ranks // cp
                for ep, etp, v in [(ep, etp, v) for ep in _expert_parallel_choices(model, dp * cp)
                                   for etp in _etp_choices(model, tp, cp)
                                   for v in ((1, 2) if pp > 1 else (1,))]:
                    for zero in (0, 1, 3) if dp * cp > 1 else (0,):  # megalite's ZeRO-2 peaks like ZeRO-1
                        for recompute in Recompute:
                            for mb in (1, 2, 4, 8):
                                # ZeRO-1/2 with the parameter all-gathers behind the next forward
                                # (what megalite runs best); without it they are exposed every step.
                                yield base.replace(tp=tp, pp=pp, dp=dp, cp=cp, cp_comm_type=cp_comm_type, ep=ep,
                                                   etp=etp, virtual_stages=v, zero=zero, offload_optimizer=offload,
                                                   overlap_param_gather=zero in (1, 2),
                                                   recompute=recompute, sequence_parallel=tp > 1,
                                                   micro_batch_size=mb, pipeline_schedule=None)


def _dp_shard_choices(cfg: RunConfig, gpus_per_node: int) -> list[int]:
    """Hybrid sharding's S to try for a ZeRO layout: every S < dp dividing dp whose shard group (S dp
    ranks x cp, tp*cp ranks apart) fills whole nodes, with the ep groups inside it."""
    p, dp = cfg.parallel, cfg.dp
    if p.zero == 0:
        return []
    return [s for s in _divisors(dp) if 2 <= s < dp and (s * p.tp * p.cp) % gpus_per_node == 0 and (s * p.cp) % p.ep == 0]


def _with_best_shard(model: GPTConfig, cfg: RunConfig, est, parts: dict, gpus: int, gpu_memory: float,
                     gpus_per_node: int, hardware) -> tuple[RunConfig, object, dict]:
    """The layout at the S that predicts fastest and fits (flat ZeRO unless a hybrid S is faster by more
    than the ranking's rounding): --suggest's search of S, layout by layout, after the pruned search."""
    best = (cfg, est, parts)
    for shard in _dp_shard_choices(cfg, gpus_per_node):
        other = cfg.replace(dp_shard=shard, num_distributed_optimizer_instances=None)
        if preflight(model, other, gpus) or not fits(model, other, gpu_memory):
            continue
        other_parts = predict_step_time(model, other, hardware, ranks_per_node=gpus_per_node).breakdown()
        if round(other_parts["total"], 4) < round(best[2]["total"], 4):
            best = (other, estimate(model, other), other_parts)
    return best


# "ZeRO-3 only when stage 2 does not fit: it adds communication": among layouts whose predicted
# step times differ by less than the model's own error, the lower ZeRO stage is the better bet.
NEAR_BEST = 0.02


def suggest(model: GPTConfig, gpus: int, gpu_memory: float, nodes: int = 1, gpus_per_node: int | None = None,
            global_batch_size: int | None = None, precision: str = "bf16", top_k: int = 10,
            hardware: str | HardwareProfile | None = None, base: RunConfig | None = None,
            exhaustive: bool = False) -> list[Suggestion]:
    """Layouts of `gpus` GPUs that fit `gpu_memory` bytes, fastest first, with a reason each.

    Tries tp within a node (sequence parallel when tp > 1), every pp dividing num_layers,
    context parallelism (ring and Ulysses) when long sequences make activations dominate, for an
    MoE model every ep dividing dp*cp and the experts and etp 1 and tp,
    interleaving, ZeRO 0, 1 (= 2's peak here) and 3, recompute none/selective/full, micro batch
    1-8, and the optimizer offload only when nothing else fits (the practitioners' order: stage 2,
    then 3, then offload; the reason line says why a later step was needed). At equal step time
    the lower ZeRO stage wins, and so it does among all layouts within 2% of the best predicted step
    time (`NEAR_BEST`; the reason line says what it passed over). global_batch_size defaults to 8
    sequences per GPU. Step times are on `hardware` (default H100-SXM).
    base: the configuration whose other settings every candidate keeps (the model name and sizes,
    training, optimizer, data); each candidate's `cfg` is whole and resolved (model sizes, schedule
    and vocabulary written out), so saving it and loading it with --config plans the same run.
    The search skips what provably cannot reach the first top_k (plan/search.py); `exhaustive`
    predicts every layout that fits instead, for the same result.
    """
    gpus_per_node = gpus_per_node or max(1, gpus // nodes)
    base = (base or RunConfig()).replace(global_batch_size=global_batch_size or 8 * gpus, precision=precision)
    base = base.replace(**_model_settings(model))
    hardware = load_profile(hardware)  # once: a profile file is read here, not per candidate
    found: list[Suggestion] = []
    for offload in (False, True):
        for cfg, est, parts in search(model, _candidates(model, base, gpus, gpus_per_node, offload), gpus,
                                      gpu_memory, gpus_per_node, hardware, top_k, NEAR_BEST, exhaustive):
            cfg, est, parts = _with_best_shard(model, cfg, est, parts, gpus, gpu_memory, gpus_per_node, hardware)
            found.append(Suggestion(cfg, est, parts["total"],
                                    _reason(model, cfg, est, parts, gpu_memory, gpus_per_node, hardware)))
        if found:
            break
    ranked = _rank(found)
    for s in ranked:
        s.cfg = s.cfg.resolved(gpus, model.vocab_size)
    return ranked[:top_k]


def _model_settings(model: GPTConfig) -> dict:
    """The architecture written out as settings, so a saved candidate needs no preset table."""
    names = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
             "seq_length", "vocab_size")
    return {name: getattr(model, name) for name in names}


def _rank(found: list[Suggestion]) -> list[Suggestion]:
    """Fastest first, except that within NEAR_BEST of the fastest the lowest ZeRO stage (then flat ZeRO
    over hybrid sharding) comes first;
    the first suggestion's reason then names the faster-on-paper layout it was preferred to."""
    if not found:
        return found
    best = min(s.step_time_s for s in found)
    rank = {r: i for i, r in enumerate(Recompute)}

    def key(c: Suggestion):
        p, near = c.cfg.parallel, c.step_time_s <= best * (1 + NEAR_BEST)
        hybrid = c.cfg.dp_shard < c.cfg.dp  # near the best, flat ZeRO first too: less memory, fewer bytes
        return (not near, p.zero if near else 0, near and hybrid, round(c.step_time_s, 4), p.tp * p.pp, p.cp, p.zero,
                rank[p.recompute], p.virtual_stages, -c.cfg.dp_shard)

    ranked = sorted(found, key=key)
    first, fastest = ranked[0], min(found, key=lambda c: (c.step_time_s, c.cfg.parallel.zero))
    if fastest.cfg.parallel.zero > first.cfg.parallel.zero:
        gain = 1 - fastest.step_time_s / first.step_time_s
        first.reason += (f"; ranked above ZeRO-{fastest.cfg.parallel.zero} ({gain:.1%} faster on paper): within "
                         f"{NEAR_BEST:.0%} of the best step time the lowest ZeRO stage wins (ZeRO-3 gathers the "
                         f"parameters every step: more communication, for memory this layout does not need)")
    return ranked

