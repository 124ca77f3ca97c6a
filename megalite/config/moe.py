"""MoEConfig: what makes a model's MLPs mixtures of experts (pure Python, no torch).

Held by `GPTConfig.moe` (None: a dense model). The names follow Megatron-LM's flags
(`--num-experts`, `--moe-router-topk`, ...); RunConfig's `moe` part declares them and builds
this object (`RunConfig.gpt_config`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DROP_POLICIES = ("probs", "position")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    """Routed experts per MoE layer."""
    topk: int = 2
    """Experts each token is sent to."""
    ffn_hidden_size: int | None = None
    """Each expert's inner width (None: the model's ffn_hidden_size)."""
    layer_freq: int | tuple[int, ...] = 1
    """An int N: layer i is an MoE layer when i % N == 0 (1: every layer); the others keep a dense MLP.
    A tuple: one 0 (dense) or 1 (MoE) per layer, Megatron's list form (DeepSeek-V3's first k dense
    layers, HF's first_k_dense_replace: (0,) * k + (1,) * (layers - k))."""
    score_function: str = "softmax"
    """softmax or sigmoid scores of the router's logits."""
    pre_softmax: bool = False
    """softmax only: False (default, Mixtral) softmax over the k chosen logits (renormalised top-k
    weights); True softmax over all experts, then the k largest probabilities (not renormalised)."""
    enable_expert_bias: bool = False
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for the
    choice only (weights use the unbiased scores), moved each step toward the mean load."""
    bias_update_rate: float = 1e-3
    """Step of the expert bias per optimizer step (sign of the load's deviation from the mean)."""
    load_balancing_type: str = "aux_loss"
    """aux_loss (over the layer's tokens), seq_aux_loss (per sequence, averaged) or none."""
    aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0: not computed into the gradient)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE)."""
    num_groups: int | None = None
    """Group-limited routing (DeepSeek-V2/V3's n_group): the experts in this many equal groups of
    consecutive ids; each token first picks `group_topk` groups, then its top-k experts inside them.
    None: no groups."""
    group_topk: int | None = None
    """Groups each token may route to (DeepSeek's topk_group); needs num_groups."""
    topk_scaling_factor: float | None = None
    """DeepSeek's routed_scaling_factor: the combine weights (after any normalisation) times this."""
    shared_expert_intermediate_size: int | None = None
    """Inner width of an always-active shared expert (Qwen-MoE, DeepSeek-MoE); None: none."""
    shared_expert_gate: bool = False
    """Qwen2-MoE: the shared expert's output is scaled per token by sigmoid(x . w), w [1, h] one weight
    per layer (replicated over tp)."""
    capacity_factor: float | None = None
    """None: dropless. Else each expert takes at most ceil(capacity_factor * tokens * topk / experts)
    of a microbatch's tokens in a layer, decided over all of them in the single process's order
    whichever ranks route them (cp; tp at etp 1): the drops are the same at every layout. The rest
    are dropped by `token_drop_policy`."""
    token_drop_policy: str = "probs"
    """Over capacity: keep the highest-probability routes (probs) or the earliest tokens (position)."""
    force_load_balancing: bool = False
    """Benchmarking and testing only (Megatron's --moe-router-force-load-balancing): the router ignores
    its scores' choice and sends each rank's routes exactly as the planner's balanced routing counts
    them (`plan.moe.balanced_routes`); the weights are still the scores' at those experts."""

    def __post_init__(self):
        if isinstance(self.layer_freq, list):  # a config read back from JSON
            object.__setattr__(self, "layer_freq", tuple(self.layer_freq))
        problems = moe_problems(self)
        if problems:
            raise ValueError("; ".join(problems))

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    def is_moe_layer(self, layer_id: int) -> bool:
        if isinstance(self.layer_freq, tuple):  # blocks past the list (MTP's) repeat its last kind
            return bool(self.layer_freq[min(layer_id, len(self.layer_freq) - 1)])
        return layer_id % self.layer_freq == 0

    def group_score_experts(self) -> int:
        """How many of a group's best scores make its score: DeepSeek-V3's two (sigmoid scores, the
        sum of the top 2), DeepSeek-V2's one (softmax scores, the group's maximum)."""
        per_group = self.num_experts // (self.num_groups or 1)
        return min(2, per_group) if self.score_function == "sigmoid" else 1

    def expert_ffn(self, dense_ffn: int) -> int:
        return self.ffn_hidden_size or dense_ffn


def moe_problems(moe: MoEConfig) -> list[str]:
    """What this MoE configuration cannot run, each naming the fix."""
    problems = []
    if moe.num_experts < 1:
        problems.append(f"--num-experts must be >= 1, got {moe.num_experts}")
    if not 1 <= moe.topk <= max(moe.num_experts, 1):
        problems.append(f"--moe-router-topk {moe.topk} must be between 1 and --num-experts {moe.num_experts}")
    problems += _layer_freq_problems(moe.layer_freq)
    problems += _group_problems(moe)
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        problems.append(f"--moe-expert-capacity-factor must be > 0 (or omitted for dropless), got "
                        f"{moe.capacity_factor}")
    if moe.score_function not in SCORE_FUNCTIONS:
        problems.append(f"--moe-router-score-function must be one of {SCORE_FUNCTIONS}, got {moe.score_function!r}")
    if moe.load_balancing_type not in LOAD_BALANCING_TYPES:
        problems.append(f"--moe-router-load-balancing-type must be one of {LOAD_BALANCING_TYPES}")
    if moe.token_drop_policy not in DROP_POLICIES:
        problems.append(f"--moe-token-drop-policy must be one of {DROP_POLICIES}")
    if moe.shared_expert_gate and not moe.shared_expert_intermediate_size:
        problems.append("a shared expert gate needs a shared expert (--moe-shared-expert-intermediate-size)")
    if moe.pre_softmax and moe.score_function != "softmax":
        problems.append("--moe-router-pre-softmax applies to --moe-router-score-function softmax only")
    if moe.topk_scaling_factor is not None and not moe.topk_scaling_factor > 0:
        problems.append(f"--moe-router-topk-scaling-factor must be > 0, got {moe.topk_scaling_factor}")
    for name, value in (("--moe-aux-loss-coeff", moe.aux_loss_coeff), ("--moe-z-loss-coeff", moe.z_loss_coeff)):
        if value < 0:
            problems.append(f"{name} must be >= 0, got {value}")
    return problems


def _layer_freq_problems(layer_freq) -> list[str]:
    if isinstance(layer_freq, tuple):
        if not layer_freq or any(v not in (0, 1) for v in layer_freq):
            return [f"--moe-layer-freq as a list takes one 0 (dense) or 1 (MoE) per layer, got {list(layer_freq)}"]
        return []
    return [] if layer_freq >= 1 else [f"--moe-layer-freq must be >= 1, got {layer_freq}"]


def _group_problems(moe: MoEConfig) -> list[str]:
    """Group-limited routing's rules, each naming the fix."""
    if moe.num_groups is None:
        return ["--moe-router-group-topk needs --moe-router-num-groups"] if moe.group_topk is not None else []
    if moe.num_groups < 1 or moe.num_experts % moe.num_groups:
        return [f"--moe-router-num-groups {moe.num_groups} must divide --num-experts {moe.num_experts}"]
    if moe.group_topk is None or not 1 <= moe.group_topk <= moe.num_groups:
        return [f"--moe-router-group-topk {moe.group_topk} must be between 1 and --moe-router-num-groups "
                f"{moe.num_groups} (the groups a token may use)"]
    reachable = moe.group_topk * (moe.num_experts // moe.num_groups)
    if moe.topk > reachable:
        return [f"--moe-router-topk {moe.topk} is more than the {reachable} experts of --moe-router-group-topk "
                f"{moe.group_topk} groups; raise --moe-router-group-topk"]
    return []
