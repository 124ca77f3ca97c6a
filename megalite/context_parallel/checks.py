"""What context parallelism needs of a configuration, as messages that name the fix.

Pure arithmetic, no torch: the pre-flight (and the torch-free planner) can import it before
any process group exists. `context_parallel_problems` returns every problem at once;
`check_attention` raises the attention ones as a ValueError where a layer is built.
"""
from __future__ import annotations

import math

from megalite.config.choices import CPCommType

CP_COMM_TYPES = tuple(str(c) for c in CPCommType)  # p2p: ring attention (K/V blocks round the ring) | a2a: Ulysses (all-to-all)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ulysses_head_problem(num_attention_heads: int, num_query_groups: int, tp: int, cp: int) -> str | None:
    """Why Ulysses cannot split this rank's heads over cp, or None when it can.

    After tp each rank holds num_attention_heads/tp query heads and num_query_groups/tp kv
    heads; the all-to-all hands each cp rank 1/cp of both, so both must divide by cp.
    """
    heads, groups = num_attention_heads // tp, num_query_groups // tp
    if heads % cp == 0 and groups % cp == 0:
        return None
    valid = _divisors(groups)  # groups divides heads, so these divide both
    what = (f"num_attention_heads/tp = {num_attention_heads}/{tp} = {heads}" if heads % cp
            else f"num_query_groups/tp = {num_query_groups}/{tp} = {groups}")
    return (f"Ulysses context parallelism (--cp-comm-type a2a) splits each rank's attention heads over cp, "
            f"but {what} is not divisible by cp={cp}; choose cp in {valid}, lower --tp, or use "
            f"--cp-comm-type p2p (ring attention splits the sequence, not the heads)")


def attention_problems(cp: int, comm_type: str, num_attention_heads: int, num_query_groups: int, tp: int = 1,
                       attention_dropout: float = 0.0) -> list[str]:
    """Why attention cannot run context-parallel this way (the sequence length aside); [] if it can."""
    if cp == 1:
        return []
    if comm_type not in CP_COMM_TYPES:
        return [f"--cp-comm-type {comm_type!r} is not one of {CP_COMM_TYPES} (p2p: ring attention; a2a: Ulysses "
                f"all-to-all)"]
    problems = []
    if comm_type == CPCommType.A2A:
        problem = ulysses_head_problem(num_attention_heads, num_query_groups, tp, cp)
        if problem is not None:
            problems.append(problem)
    if comm_type == CPCommType.P2P and attention_dropout > 0.0:
        problems.append(f"attention_dropout={attention_dropout} is not supported by ring attention (each rank "
                        f"sees one block of every softmax row); set attention_dropout=0 or use --cp-comm-type a2a")
    return problems


def check_attention(cp: int, comm_type: str, num_attention_heads: int, num_query_groups: int, tp: int = 1,
                    attention_dropout: float = 0.0) -> None:
    """`attention_problems` as one ValueError (raised where an attention layer is built)."""
    problems = attention_problems(cp, comm_type, num_attention_heads, num_query_groups, tp, attention_dropout)
    if problems:
        raise ValueError("; ".join(problems))


def sequence_problems(seq_length: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> list[str]:
    """Why a sequence of seq_length tokens cannot be split over cp (and tp under SP); [] if it can."""
    if cp == 1:
        return []
    if seq_length % (2 * cp):
        return [f"seq_length={seq_length} is not divisible by 2*cp = {2 * cp} (the load-balanced split cuts the "
                f"sequence into 2*cp chunks); choose seq_length a multiple of {2 * cp}"]
    if sequence_parallel and (seq_length // cp) % tp:
        return [f"each cp rank's {seq_length // cp} tokens (seq_length/cp) are not divisible by tp={tp} for "
                f"sequence parallelism; choose seq_length a multiple of {cp * math.lcm(2, tp)}"]
    return []


def context_parallel_problems(seq_length: int, cp: int, comm_type: str, num_attention_heads: int,
                              num_query_groups: int, tp: int = 1, sequence_parallel: bool = False,
                              attention_dropout: float = 0.0) -> list[str]:
    """Every reason (seq_length, cp, comm_type) cannot run with this model and tp; [] if it can."""
    return (sequence_problems(seq_length, cp, tp, sequence_parallel)
            + attention_problems(cp, comm_type, num_attention_heads, num_query_groups, tp, attention_dropout))
