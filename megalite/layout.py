"""The layout: the parallel sizes of a run and every rule between them, validated once.

    layout = Layout(tp=8, pp=4, dp=2, world=64)      # LayoutError (one line naming the fix) if impossible
    layout.dp_cp, layout.expert_dp, layout.experts_whole

One frozen object holds tp, cp, dp (ZeRO's shard size `dp_shard` within it), pp, vp (virtual
stages), ep, etp, the world and the model's expert count. Its construction checks every rule
between them, in one order, each with one message that says what to change; the first broken rule
is raised. The configuration's check (`RunConfig.validate`), `mesh.init_mesh`, the planner's
pre-flight (`plan.validity.preflight`) and `--simulate` all build one, so a bad layout is refused
with the same line wherever it is met. Rules that need more than the sizes (a model's heads and
layers over tp and pp, the batch over dp, the pipeline schedule) stay with what they concern.

Defaults, stated here only: dp = world / (tp*cp*pp) when dp is None (1 when the world is not
given either), world = tp*cp*pp*dp, dp_shard = dp (ZeRO shards over all of dp), etp = 1 (whole
experts on every tp rank: `--etp`'s default), num_experts = 0 (a dense model: no expert groups,
whatever etp says).

Pure Python, no torch: the configuration and the planner read it before torch is imported.
"""
from __future__ import annotations

from dataclasses import dataclass

from megalite.errors import UsageError

# the command line's name of each size, for the messages
FLAGS = {"tp": "--tp", "cp": "--cp", "dp": "--dp", "pp": "--pp", "vp": "--virtual-stages", "ep": "--ep",
         "etp": "--etp", "dp_shard": "--dp-shard", "world": "the world size", "num_experts": "--num-experts"}


class LayoutError(UsageError, ValueError):
    """A layout that cannot run: one line naming the rule and the change that satisfies it."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Layout:
    """The parallel sizes of a run (see the module docstring); LayoutError at construction if they
    break a rule. Rank order (megalite.distributed.topology): tp fastest, then cp, dp, pp."""

    tp: int = 1
    cp: int = 1
    dp: int | None = None  # None: world / (tp*cp*pp)
    pp: int = 1
    vp: int = 1  # virtual pipeline stages: model chunks per pipeline rank
    ep: int = 1  # expert parallel: subdivides dp x cp
    etp: int = 1  # expert tensor parallel: 1 (whole experts) or tp (experts split like the dense MLP)
    dp_shard: int | None = None  # ZeRO's shard group within dp (None: dp); replicas across dp/dp_shard
    world: int | None = None  # None: tp*cp*pp*dp
    num_experts: int = 0  # experts per MoE layer; 0: a dense model

    def __post_init__(self):
        problem = self._sizes_problem() or self._world_problem()
        if problem is None:
            dp = self.dp if self.dp is not None else (self.world // self.model_ranks if self.world else 1)
            object.__setattr__(self, "dp", dp)
            object.__setattr__(self, "world", self.model_ranks * dp)
            object.__setattr__(self, "dp_shard", dp if self.dp_shard is None else self.dp_shard)
            problem = self._pipeline_problem() or self._expert_problem() or self._shard_problem()
        if problem is not None:
            raise LayoutError(problem)

    # ------------------------------------------------------------------ the rules, in order

    def _sizes_problem(self) -> str | None:
        """Each size a positive integer (the expert count a non-negative one)."""
        for name in ("tp", "cp", "dp", "pp", "vp", "ep", "etp", "dp_shard", "world"):
            value = getattr(self, name)
            if value is None and name in ("dp", "dp_shard", "world"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                return f"{FLAGS[name]} must be a positive integer, got {value!r}"
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            return f"--num-experts must be an integer >= 0 (0: a dense model), got {self.num_experts!r}"
        return None

    def _world_problem(self) -> str | None:
        """world = tp*cp*pp*dp (dp inferred from the world when not given)."""
        if self.world is None:
            return None
        model_ranks, with_cp = self.model_ranks, self.cp > 1
        if self.dp is None:
            if self.world % model_ranks == 0:
                return None
            what, flags = ("tp*cp*pp", "--tp/--cp/--pp") if with_cp else ("tp*pp", "--tp/--pp")
            sizes = f"{self.tp}*{self.cp}*{self.pp}" if with_cp else f"{self.tp}*{self.pp}"
            return (f"world size {self.world} is not divisible by {what} = {sizes} = {model_ranks}; "
                    f"launch a multiple of {model_ranks} processes or change {flags}")
        if model_ranks * self.dp == self.world:
            return None
        what, flags = ("tp*cp*pp*dp", "--tp/--cp/--pp/--dp") if with_cp else ("tp*pp*dp", "--tp/--pp/--dp")
        sizes = f"{self.tp}*{self.cp}*{self.pp}*{self.dp}" if with_cp else f"{self.tp}*{self.pp}*{self.dp}"
        return (f"world size {self.world} != {what} = {sizes} = {model_ranks * self.dp}; "
                f"launch {model_ranks * self.dp} processes (torchrun --nproc_per_node ...) or change {flags}")

    def _pipeline_problem(self) -> str | None:
        if self.vp > 1 and self.pp == 1:
            return (f"--virtual-stages {self.vp} needs --pp >= 2 (a rank's model chunks interleave with the other "
                    f"stages'); with --pp 1 set --virtual-stages 1")
        return None

    def _expert_problem(self) -> str | None:
        """ep > 1 needs experts; ep divides dp x cp and the experts; etp is 1 or tp."""
        ep, replicas = self.ep, self.dp_cp
        if ep > 1 and not self.num_experts:
            return (f"--ep {ep} shards experts but the model has none: add --num-experts N (a multiple of {ep}) "
                    f"or drop --ep")
        if replicas % ep:
            return (f"--ep {ep} does not divide dp*cp = {self.dp}*{self.cp} = {replicas} (experts are sharded over "
                    f"the data x context ranks); choose --ep in {divisors(replicas)}")
        if self.num_experts % ep:
            return expert_count_problem(self.num_experts, ep, replicas)
        if self.etp not in (1, self.tp):
            return (f"--etp {self.etp} must be 1 (whole experts on every tp rank) or --tp {self.tp} (experts split "
                    f"over tp); choose --etp 1 or --etp {self.tp}")
        return None

    def _shard_problem(self) -> str | None:
        """dp_shard divides dp; under hybrid sharding each replica group holds every expert (ep | dp_shard*cp)."""
        if self.dp % self.dp_shard:
            return (f"--dp-shard {self.dp_shard} does not divide dp = {self.dp} (ZeRO shards over dp-shard ranks "
                    f"and replicates across dp/dp-shard of them); choose --dp-shard in {divisors(self.dp)}")
        if self.dp_shard < self.dp and (self.dp_shard * self.cp) % self.ep:
            choices = [s for s in divisors(self.dp) if (s * self.cp) % self.ep == 0]
            return (f"--ep {self.ep} does not divide dp_shard*cp = {self.dp_shard}*{self.cp} (an expert-parallel group "
                    f"must lie inside one shard group, so every replica group holds every expert); choose --dp-shard "
                    f"in {choices}")
        return None

    # ------------------------------------------------------------------ derived sizes

    @property
    def model_ranks(self) -> int:
        """Ranks holding one replica of the model's weights and tokens of one microbatch: tp*cp*pp."""
        return self.tp * self.cp * self.pp

    @property
    def dp_cp(self) -> int:
        """The data x context ranks: parameters are replicated over them (gradients reduce there)."""
        return self.dp * self.cp

    @property
    def dp_replicate(self) -> int:
        """Replicas of each ZeRO shard group: dp / dp_shard."""
        return self.dp // self.dp_shard

    @property
    def has_experts(self) -> bool:
        return self.num_experts > 0

    @property
    def experts_whole(self) -> bool:
        """Experts under tp kept whole on every tp rank (etp = 1 < tp), each routing its own 1/tp of the tokens."""
        return self.has_experts and self.etp < self.tp

    @property
    def expert_groups_apart(self) -> bool:
        """Whether the experts have replica groups of their own (ep > 1, or whole experts under tp): the
        mesh then builds the expert-data-parallel group (and, for whole experts, the token group)."""
        return self.ep > 1 or self.experts_whole

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts: dp*cp/ep, times tp for whole experts."""
        return self.dp_cp // self.ep * (self.tp if self.experts_whole else 1)

    def sizes(self) -> dict[str, int]:
        """{name: size} as the rank table and error messages print them."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "vp": self.vp, "ep": self.ep,
                "etp": self.etp, "dp_shard": self.dp_shard, "num_experts": self.num_experts}


def expert_count_problem(num_experts: int, ep: int, replicas: int | None = None) -> str | None:
    """The experts split evenly over ep ranks; `replicas` (dp*cp) narrows the choices when known.
    Also asked by an MoE layer built over a group of another size (megalite.moe.layer)."""
    if num_experts % ep == 0:
        return None
    choices = [d for d in divisors(num_experts) if replicas is None or replicas % d == 0]
    return f"--num-experts {num_experts} is not divisible by --ep {ep}; choose --ep in {choices}"
