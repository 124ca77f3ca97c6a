"""The choices of RunConfig's settings, each an enum declared once: argparse's `choices`, the
config files' accepted strings and the code's comparisons all come from these. The strings are
what users type and what config files and checkpoints store; the code compares members
(`cfg.precision.fp8_recipe == Fp8ScalingRecipe.BLOCKWISE`), so a misspelt choice is an
AttributeError, not a comparison that is quietly false. A StrEnum member still equals its
string, so a caller may pass either (megalite.fp8.recipe.Fp8Recipe("hybrid", "rowwise")).

Pure Python, no torch.
"""
from __future__ import annotations

import enum


class Precision(enum.StrEnum):
    """A floating-point format: of the parameters and activations, or of the gradient reduction
    (whose fp16 only the planner models, for the ZeRO paper's accounting; training refuses it)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def torch_dtype(self):
        """torch.float32, torch.bfloat16 or torch.float16: the one map from a precision to its dtype
        (`Precision(name).torch_dtype` for a plain string)."""
        import torch  # here, not at the top: config/ stays torch-free for the planner and tools/plan.py
        return {Precision.FP32: torch.float32, Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}[self]


class Fp8Format(enum.StrEnum):
    """--fp8-format (Megatron's names): e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients)."""

    E4M3 = "e4m3"
    HYBRID = "hybrid"


class Fp8ScalingRecipe(enum.StrEnum):
    """--fp8-recipe: one scale per tensor, one per row along each GEMM's contraction dim, or per
    1 x 128 activation tile and 128 x 128 weight block (DeepSeek-V3)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"


class Fp8Scales(enum.StrEnum):
    """--fp8-scales: each scale rounded down to a power of two (layout-free to the bit), or max / amax."""

    POW2 = "pow2"
    EXACT = "exact"


class Recompute(enum.StrEnum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Schedule(enum.StrEnum):
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    GPIPE = "gpipe"
    ZB_H1 = "zb-h1"
    DUALPIPEV = "dualpipev"  # DeepSeek's V-shaped zero-bubble schedule: two model chunks per rank (v = 2)


class LRDecay(enum.StrEnum):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"
    WSD = "WSD"  # warmup-stable-decay (Megatron's name): --lr-wsd-decay-iters, --lr-wsd-decay-style


class LRWSDDecay(enum.StrEnum):
    """How WSD's final --lr-wsd-decay-iters steps anneal to --min-lr (optim/lr_schedule.py)."""

    EXPONENTIAL = "exponential"
    LINEAR = "linear"
    COSINE = "cosine"
    MINUS_SQRT = "minus_sqrt"


class ElasticBatch(enum.StrEnum):
    """The global batch when a run resumes on another world (megalite.checkpoint.elastic)."""

    KEEP = "keep"  # the checkpoint's global batch, more or fewer accumulation steps
    SCALE = "scale"  # the global batch in proportion to dp, the learning rate by --elastic-lr-rule


class ElasticLRRule(enum.StrEnum):
    """How --elastic-batch scale rescales the learning rate with the global batch ratio r."""

    LINEAR = "linear"  # lr * r (Goyal et al., 2017)
    SQRT = "sqrt"  # lr * sqrt(r) (Krizhevsky, 2014; Adam-style optimisers)


class OnNonFinite(enum.StrEnum):
    SKIP = "skip"
    STOP = "stop"


class SFTOverlong(enum.StrEnum):
    """--sft-overlong: an SFT sample longer than the sequence is refused (naming it) or truncated to fit."""

    REFUSE = "refuse"
    TRUNCATE = "truncate"


class CPCommType(enum.StrEnum):
    """How context-parallel attention talks (megalite.context_parallel.checks.CP_COMM_TYPES)."""

    P2P = "p2p"  # ring attention: K/V blocks travel round the cp ring
    A2A = "a2a"  # Ulysses: all-to-all from a sequence split to a head split and back


class CPSplit(enum.StrEnum):
    """Which tokens each context-parallel rank holds (megalite.context_parallel.document_split)."""

    ZIGZAG = "zigzag"  # chunks r and 2cp-1-r of the sequence: balances one causal sequence
    DOCUMENTS = "documents"  # chunks r and 2cp-1-r of every packed document: balances the masked work


class GradCompression(enum.StrEnum):
    """How the data-parallel gradient reduction travels (megalite.data_parallel.powersgd)."""

    NONE = "none"
    POWERSGD = "powersgd"  # low-rank factors P, Q with error feedback (Vogels et al. 2019)


class MoEScoreFunction(enum.StrEnum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class MoELoadBalancing(enum.StrEnum):
    AUX_LOSS = "aux_loss"
    SEQ_AUX_LOSS = "seq_aux_loss"
    NONE = "none"


class MoEDropPolicy(enum.StrEnum):
    PROBS = "probs"
    POSITION = "position"


class MoEDispatcher(enum.StrEnum):
    ALLTOALL = "alltoall"
    ALLGATHER = "allgather"


class OptimizerKind(enum.StrEnum):
    """--optimizer (Megatron's flag): AdamW on everything, or Muon on the hidden matrices with AdamW on
    the rest (megalite/optim/muon.py)."""

    ADAMW = "adamw"
    MUON = "muon"

    @classmethod
    def _missing_(cls, value):
        return cls.ADAMW if value == "adam" else None  # Megatron's adam: Adam with decoupled weight decay

    @classmethod
    def synonyms(cls) -> tuple[str, ...]:
        """Values the flag also takes (Megatron's spellings), read as a member by _missing_."""
        return ("adam",)


class MuonAdjustLR(enum.StrEnum):
    """--muon-adjust-lr: the factor on Muon's update of an [A, B] matrix (torch.optim.Muon's adjust_lr_fn)."""

    MATCH_RMS_ADAMW = "match_rms_adamw"  # 0.2 * sqrt(max(A, B)): AdamW's update RMS (Moonlight)
    ORIGINAL = "original"  # sqrt(max(1, A / B)) (Keller Jordan)


class MuonOwners(enum.StrEnum):
    """--muon-owners: which rank orthogonalises which matrix (megalite/plan/muon.py: assign_owners)."""

    BALANCED = "balanced"  # largest first to the least loaded rank
    ROUND_ROBIN = "round-robin"
    FIRST = "first"  # all on one rank (tests)
