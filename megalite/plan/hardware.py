"""Hardware profiles: what one device (and the links between devices) can do, for the step-time model.

A profile states, per device: the dense matmul peak per precision and the fraction of it a GEMM
reaches as a function of its size (an efficiency curve), the achievable memory (copy) bandwidth,
the all-reduce bus bandwidth inside a node and per rank across nodes (nccl-tests conventions),
the latency of one collective, and what the host costs per transformer block, per microbatch
and per step (launches, dispatch, Python). Pure data and arithmetic, no torch.

Built-in profiles (`BUILTIN`) describe A100-80GB, H100-SXM and H200 from datasheets and public
microbenchmarks (each names its sources in `source`); `tools/plan.py --calibrate OUT.json`
measures the machine it runs on (megalite/calibration.py) and writes the same fields.

Units in the profile (and its JSON): TFLOP/s, GB/s (1e9 bytes), microseconds. The methods answer
in seconds.

    hw = load_profile("A100-80GB")            # or a path to a profile.json
    hw.matmul_seconds(4096, 4096, 4096, "bf16")
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from megalite.errors import UsageError
from megalite.plan.json_fields import field_problem


ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


class HardwareProfileError(UsageError, ValueError):
    """A --hardware name that is not built in and not a readable profile file, or a bad field."""


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind and its interconnect. See the module docstring for units."""

    name: str
    peak_tflops: dict[str, float]
    """Dense matmul peak per precision ("bf16", "fp16", "fp32"; "fp8" where the GPU has FP8 tensor cores)."""
    matmul_efficiency: tuple[tuple[float, float], ...]
    """(n, fraction of peak) for an n x n x n GEMM, n increasing; a GEMM (m, n, k) reads the curve at
    the cube root of m*n*k (its work), log-linearly between points and flat beyond the ends."""
    memory_bandwidth_gbs: float
    """Achievable copy bandwidth (bytes read + bytes written per second), for memory-bound ops."""
    intra_node_busbw_gbs: float
    """All-reduce bus bandwidth of a group inside one node (also the p2p bandwidth there)."""
    inter_node_busbw_gbs: float
    """Bus bandwidth per rank across nodes (one NIC's worth); a group with r ranks per node gets r of it."""
    elementwise_gbs: float | None = None
    """Bytes read + written per second by elementwise kernels with transcendental math (GeLU/SiLU,
    softmax, cross entropy's exp, AdamW's sqrt): a GPU streams them at about the copy bandwidth
    (None: use it); a CPU's vector math is slower than its memory."""
    attention_efficiency: float | None = None
    """Fraction of peak a fused (flash) attention forward + backward reaches, its FLOPs counted as
    3.5 x 4 b h s (s/2) d for causal attention; None: its products run on the GEMM curve."""
    devices_per_node: int | None = 8
    """Ranks one node holds; None: every rank of the job shares one node (a CPU machine)."""
    collective_latency_us: float = 10.0
    """Fixed cost of one collective or p2p transfer (small-message time)."""
    collective_ranks: tuple[tuple[int, float, float], ...] = ()
    """Measured (CPU calibration): (n, latency us, bus bandwidth GB/s) of an all-reduce over n ranks,
    n increasing. Where ranks outnumber the cores, every hop of a ring waits for a process to be
    scheduled, so the fixed cost grows with n. Empty: collective_latency_us and the bus
    bandwidths for every group size (a GPU's fixed cost barely depends on it)."""
    attention_ms: tuple[tuple[int, str, bool, int, str, float], ...] = ()
    """Measured: (head_dim, precision, causal, seq_len, implementation, forward + backward ms) of one
    attention call of `ATTENTION_TABLE_TOKENS` tokens with query heads x head_dim = `ATTENTION_TABLE_WIDTH`
    (tools/tune_attention.py's dispatch table, the rows of kernels/attention_dispatch.MEASURED_MS).
    Where a call's (head_dim, precision, causal) has rows the planner times it from them
    (plan/kernel_rates.py); elsewhere attention_efficiency / the GEMM curve."""
    memory_fractions: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Measured: fraction of the copy bandwidth (forward, backward) each memory-bound kernel family
    reaches ("norm", "rope", "activation", "cross_entropy", "adamw", "layout_copy",
    "grad_accumulate"; plan/kernel_rates.py); a family not listed runs at the copy bandwidth."""
    launch_host_us: float = 0.0
    """Measured: host time per GPU operation (kernel launch, memset, copy) of megalite's training
    step, Python and autograd included. When set, host time = launches counted from the model
    (plan/launches.py) x this, overlapped with the GPU as a queue (timing.py), replacing the three
    overheads below; 0: those overheads."""
    block_overhead_us: float = 0.0
    """Host time of one transformer block's forward + backward at negligible size (launches, dispatch)."""
    microbatch_overhead_us: float = 0.0
    """Host time per microbatch outside the blocks (embedding, head, loss, schedule)."""
    step_overhead_us: float = 0.0
    """Host time per optimizer step besides the update's memory traffic (bookkeeping, launches)."""
    host_synchronous: bool = False
    """True on a CPU: the host runs the ops, so overheads add to compute; on a GPU they overlap it."""
    cores: int | None = None
    """CPU: cores the node's ranks share (ranks x threads beyond it slow compute down); None on GPUs."""
    threads_per_rank: int = 1
    """CPU: threads one rank computes with (what the GEMM curve was measured with)."""
    rank_slowdown: tuple[tuple[int, float], ...] = ()
    """CPU, measured: (n, how much slower each of n processes computing at once is than one alone);
    it includes whatever else loads the machine. Empty: the `cores` rule."""
    source: str = ""
    device_memory_gb: float | None = None
    """Memory of one device in GB (1e9 bytes): what `plan.py --suggest` fits layouts into when
    --gpu-memory is not given; None: not known (a CPU profile)."""
    """Where the numbers come from (datasheets, benchmarks, or the calibration's command and date)."""
    measurements: dict = field(default_factory=dict, compare=False)
    """Calibration only: the raw measurements behind the fields (sizes, times), for the record."""

    def __post_init__(self):
        curve = tuple((float(n), float(e)) for n, e in self.matmul_efficiency)
        if not curve or any(n <= 0 or not 0 < e <= 1.5 for n, e in curve) or \
                [n for n, _ in curve] != sorted(n for n, _ in curve):
            raise HardwareProfileError(f"profile {self.name!r}: matmul_efficiency must be (n, fraction) pairs with "
                                       f"n > 0 increasing and 0 < fraction, got {self.matmul_efficiency!r}")
        object.__setattr__(self, "matmul_efficiency", curve)
        object.__setattr__(self, "rank_slowdown", tuple((int(n), float(x)) for n, x in self.rank_slowdown))
        table = tuple((int(n), float(lat), float(bw)) for n, lat, bw in self.collective_ranks)
        if [n for n, _, _ in table] != sorted({n for n, _, _ in table}) or any(n < 2 or bw <= 0 for n, _, bw in table):
            raise HardwareProfileError(f"profile {self.name!r}: collective_ranks must be (n >= 2, latency_us, busbw_gbs > 0) "
                                       f"with n increasing, got {self.collective_ranks!r}")
        object.__setattr__(self, "collective_ranks", table)
        object.__setattr__(self, "attention_ms", tuple((int(d), str(p), bool(c), int(n), str(i), float(ms))
                                                       for d, p, c, n, i, ms in self.attention_ms))
        object.__setattr__(self, "memory_fractions", {k: (float(f), float(b)) for k, (f, b) in
                                                      dict(self.memory_fractions).items()})
        if any(not (0 < f <= 1.5 and 0 < b <= 1.5) for f, b in self.memory_fractions.values()) or \
                any(ms <= 0 for *_, ms in self.attention_ms) or self.launch_host_us < 0:
            raise HardwareProfileError(f"profile {self.name!r}: memory_fractions must be (forward, backward) "
                                       f"fractions in (0, 1.5], attention_ms positive milliseconds and "
                                       f"launch_host_us >= 0")
        for name in ("memory_bandwidth_gbs", "intra_node_busbw_gbs", "inter_node_busbw_gbs"):
            if not getattr(self, name) > 0:
                raise HardwareProfileError(f"profile {self.name!r}: {name} must be positive")
        if not self.peak_tflops:
            raise HardwareProfileError(f"profile {self.name!r}: peak_tflops needs at least one precision")

    # -- arithmetic ------------------------------------------------------------------------------

    def peak_flops(self, precision: str) -> float:
        """Dense matmul FLOP/s at `precision` (bf16 and fp16 stand in for each other)."""
        peaks = self.peak_tflops
        value = peaks.get(precision) or peaks.get({"bf16": "fp16", "fp16": "bf16"}.get(precision, ""))
        if value is None:
            raise HardwareProfileError(f"profile {self.name!r} has no peak for {precision}; add peak_tflops."
                                       f"{precision} (has {sorted(peaks)}), or calibrate with "
                                       f"`tools/plan.py --calibrate OUT.json --calibrate-bf16`")
        return value * 1e12

    def matmul_efficiency_at(self, n: float) -> float:
        """Fraction of peak an n x n x n GEMM reaches (log-linear in n between the curve's points)."""
        sizes = [size for size, _ in self.matmul_efficiency]
        i = bisect.bisect_left(sizes, n)
        if i == 0:
            return self.matmul_efficiency[0][1]
        if i == len(sizes):
            return self.matmul_efficiency[-1][1]
        (n0, e0), (n1, e1) = self.matmul_efficiency[i - 1], self.matmul_efficiency[i]
        w = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
        return e0 + w * (e1 - e0)

    def matmul_seconds(self, m: float, n: float, k: float, precision: str, batch: float = 1) -> float:
        """Seconds of `batch` GEMMs [m, k] x [k, n] in one launch: their FLOPs at the curve's efficiency
        for their total work, and never less than moving both operands and the result once (a
        roofline: attention's products over a small head dimension are bound by memory)."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        size = (batch * m * n * k) ** (1.0 / 3.0)
        compute = 2.0 * batch * m * n * k / (self.peak_flops(precision) * self.matmul_efficiency_at(size))
        moved = ELEMENT_BYTES.get(precision, 2) * batch * (m * k + k * n + m * n)
        return max(compute, self.memory_seconds(moved))

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds to move `nbytes` (read + written) through memory at the copy bandwidth."""
        return nbytes / (self.memory_bandwidth_gbs * 1e9)

    def elementwise_seconds(self, nbytes: float) -> float:
        """Seconds of elementwise kernels that read + write `nbytes` in all."""
        return nbytes / ((self.elementwise_gbs or self.memory_bandwidth_gbs) * 1e9)

    def _measured_collective(self, group_size: int) -> tuple[float, float] | None:
        """(latency us, busbw GB/s) of `group_size` ranks from `collective_ranks`: linear in n between
        measured sizes; below the first, the first; beyond the last, the latency grows with the
        ring's n - 1 hops at the last measured bandwidth. None without a table."""
        table = self.collective_ranks
        if not table:
            return None
        if group_size <= table[0][0]:
            return table[0][1], table[0][2]
        for (n0, l0, b0), (n1, l1, b1) in zip(table, table[1:]):
            if group_size <= n1:
                w = (group_size - n0) / (n1 - n0)
                return l0 + w * (l1 - l0), b0 + w * (b1 - b0)
        n, latency, bandwidth = table[-1]
        return latency * (group_size - 1) / (n - 1), bandwidth

    def collective_latency_s(self, group_size: int) -> float:
        """Seconds of fixed cost of one collective over `group_size` ranks (2 for a p2p transfer)."""
        measured = self._measured_collective(group_size)
        return (measured[0] if measured else self.collective_latency_us) * 1e-6

    def busbw(self, group_size: int, stride: int, ranks_per_node: int | None) -> float:
        """Bus bandwidth (bytes/s) of a group of `group_size` ranks `stride` ranks apart.

        Measured per group size (`collective_ranks`): that. Otherwise inside a node (the group's
        span fits): the intra-node bandwidth; across nodes each node's r = ranks of the group on
        it drive r NICs in parallel: r x inter-node, at most intra-node.
        """
        measured = self._measured_collective(group_size)
        if measured:
            return measured[1] * 1e9
        per_node = ranks_per_node if ranks_per_node is not None else self.devices_per_node
        if per_node is None or group_size * stride <= per_node:
            return self.intra_node_busbw_gbs * 1e9
        on_one_node = max(1, min(group_size, per_node // stride))
        return min(self.intra_node_busbw_gbs, on_one_node * self.inter_node_busbw_gbs) * 1e9

    def compute_slowdown(self, ranks_on_node: int) -> float:
        """CPU: how much slower each rank computes with `ranks_on_node` ranks on the machine: the
        measured `rank_slowdown` (linear between its points, proportional beyond the last), else
        ranks x threads over the cores. 1 on a GPU."""
        if self.rank_slowdown:
            points = sorted(self.rank_slowdown)
            for (n0, x0), (n1, x1) in zip(points, points[1:]):
                if n0 <= ranks_on_node <= n1:
                    return x0 + (x1 - x0) * (ranks_on_node - n0) / (n1 - n0)
            last_n, last_x = points[-1]
            return last_x * ranks_on_node / last_n if ranks_on_node > last_n else points[0][1]
        if self.cores is None:
            return 1.0
        return max(1.0, ranks_on_node * self.threads_per_rank / self.cores)

    # -- files -----------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["matmul_efficiency"] = [list(point) for point in self.matmul_efficiency]
        out["collective_ranks"] = [list(row) for row in self.collective_ranks]
        out["attention_ms"] = [list(row) for row in self.attention_ms]
        out["memory_fractions"] = {k: list(v) for k, v in self.memory_fractions.items()}
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, data: dict, where: str = "profile") -> HardwareProfile:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise HardwareProfileError(f"{where}: unknown field(s) {unknown}; a profile has {sorted(names)}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in data and
                         f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        if missing:
            raise HardwareProfileError(f"{where}: missing field(s) {missing}")
        for name, value in data.items():
            problem = field_problem(name, _FIELD_TYPES.get(name), value)
            if problem:
                raise HardwareProfileError(f"{where}: {problem}")
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:  # a table of the wrong shape or with text where numbers belong
            raise HardwareProfileError(f"{where}: {exc}") from None


_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(HardwareProfile)}


def latency_bound_curve(plateau: float, peak_tflops: float, fixed_us: float) -> tuple[tuple[float, float], ...]:
    """An efficiency curve from two numbers: a GEMM of work W = 2n^3 takes W / (plateau * peak) plus a
    fixed `fixed_us` (launch, tile ramp-up, tail), i.e. efficiency(n) = plateau * W / (W + plateau *
    peak * fixed). Evaluated at n = 128 ... 32768."""
    flops_in_fixed = plateau * peak_tflops * 1e12 * fixed_us * 1e-6
    return tuple((float(n), plateau * 2 * n ** 3 / (2 * n ** 3 + flops_in_fixed)) for n in (2 ** i for i in range(7, 16)))


# GPU GEMM curves: `latency_bound_curve` with a 6 us fixed cost (fits XLA's measured sm_90 bf16 table,
# openxla matmul_interpolator_data.h: 512^3 at 4% of peak, 2x1024^3 at 38%, 2048^3 at 64%, 4096^3 at
# 79%) and the plateau each GPU's best GEMM shape reaches in Bekman's mamf-finder sweeps (A100 SXM
# 271 TFLOP/s = 87%, H100 SXM 794 TFLOP/s = 80%). Copy bandwidth: 88% of the datasheet HBM figure.
# Bus bandwidths: nccl-tests all-reduce on 8 NVLink GPUs (A100 ~230 GB/s, H100 ~360 GB/s); across
# nodes one NIC per GPU (A100: HDR 200 Gb/s, H100/H200: NDR 400 Gb/s) at ~95%. Host overheads: ~40
# kernel launches per block (forward + backward) at ~5 us; they overlap the GPU's work. Flash
# attention forward + backward at FlashAttention-2's published causal rates (Dao 2023: 50-73% of the
# A100's peak; ~35% of the H100's): megalite's Triton kernels are not yet timed on a GPU.
A100_80GB = HardwareProfile(
    name="A100-80GB", peak_tflops={"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    matmul_efficiency=latency_bound_curve(0.805, 312.0, 6.0),
    memory_bandwidth_gbs=0.88 * 2039, intra_node_busbw_gbs=230.0, inter_node_busbw_gbs=23.75, devices_per_node=8,
    device_memory_gb=80.0,
    attention_efficiency=0.55,
    collective_latency_us=15.0, block_overhead_us=200.0, microbatch_overhead_us=300.0, step_overhead_us=5000.0,
    source="A100 SXM4 80GB datasheet (312 TFLOP/s bf16/fp16 dense, 19.5 fp32, 2039 GB/s HBM2e, NVLink 3, "
           "HDR 200 Gb/s per GPU); GEMM curve, copy and bus bandwidths: see megalite/plan/hardware.py")

H100_SXM = HardwareProfile(
    name="H100-SXM", peak_tflops={"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0},
    matmul_efficiency=latency_bound_curve(0.80, 989.0, 6.0),
    memory_bandwidth_gbs=0.88 * 3350, intra_node_busbw_gbs=360.0, inter_node_busbw_gbs=47.5, devices_per_node=8,
    device_memory_gb=80.0,
    attention_efficiency=0.35,
    collective_latency_us=15.0, block_overhead_us=200.0, microbatch_overhead_us=300.0, step_overhead_us=5000.0,
    source="H100 SXM5 80GB datasheet (989 TFLOP/s bf16 dense, 67 fp32, 3350 GB/s HBM3, NVLink 4, NDR 400 Gb/s "
           "per GPU); GEMM curve, copy and bus bandwidths: see megalite/plan/hardware.py")

# H200 SXM 141GB: the H100's chip and interconnect with HBM3e (4800 GB/s on the datasheet), and
# measured on one H200 (torch 2.11 + triton 3.6, 2026-11-26; raw outputs of the first run in
# ../shared/gpu/2026-11-26-h200/, the second run's in docs/benchmarks.md "Kernels"):
#  attention: tools/tune_attention.py's dispatch table = kernels/attention_dispatch.MEASURED_MS (sm_90,
#    bf16, causal; a test holds these rows equal to it);
#  memory fractions (forward, backward) of the copy bandwidth: tools/bench_kernels.py's "after" column
#    (gpu_ms, copy 4251 GB/s), the backward from the fwd+bwd and fwd times with the bench's bytes (norms
#    fwd x,y / bwd x,dy,dx; rope 2 / 2; gelu 2 / 3; swiglu 3 / 5; cross entropy logits 1 / 2; adamw 28
#    bytes per parameter; SwiGLU measured 1.02 of the copy, taken as 1.0); "layout_copy" (torch's copies of strided tensors and broadcast bias adds) and
#    "grad_accumulate" (fp32 main grad += bf16 grad) are those kernels' in-step rates in the first run's
#    profiles (llama_prof.tgz ops: contiguous/reshape copies 12.6 GB in 7.80 ms = 0.38 of 4248 GB/s;
#    the main-grad adds 9.9 GB in 3.67 ms = 0.64), torch's kernels, which no bench times alone;
#  copy bandwidth: bench_kernels' 1 GiB device-to-device copy (4248 GB/s);
#  launch_host_us: the gpt2-124m step (micro batch 8 x 1024, bf16) was host-bound: 46-55 ms of wall
#    time per step (unprofiled) for the 961 GPU operations (857 kernels, 95 memsets, 9 copies) its
#    trace counts per step (gpt2_trace.json.gz): 50.5 ms / 961 = 52.5 us of host per operation.
H200_MEASURED_ATTENTION_MS = {   # (head_dim, precision, causal) -> {seq_len: {implementation: fwd+bwd ms}}
    (128, "bf16", True): {1024: {"triton": 2.0184, "sdpa": 1.89, "sdpa_gqa": 1.4081},
                          2048: {"triton": 3.1956, "sdpa": 2.6857, "sdpa_gqa": 2.2421},
                          4096: {"triton": 5.7896, "sdpa": 4.306, "sdpa_gqa": 3.7353},
                          8192: {"triton": 10.5196, "sdpa": 7.7639, "sdpa_gqa": 7.3578},
                          16384: {"triton": 19.3394, "sdpa": 14.6954, "sdpa_gqa": 14.2206}},
    (64, "bf16", True): {1024: {"triton": 2.0917, "sdpa": 2.309, "sdpa_gqa": 1.8182},
                         2048: {"triton": 3.3102, "sdpa": 3.3196, "sdpa_gqa": 2.8307},
                         4096: {"triton": 5.94, "sdpa": 5.3294, "sdpa_gqa": 4.9197},
                         8192: {"triton": 10.9121, "sdpa": 9.4876, "sdpa_gqa": 8.8704},
                         16384: {"triton": 21.2314, "sdpa": 18.1031, "sdpa_gqa": 17.6596}},
}
H200 = dataclasses.replace(
    H100_SXM, name="H200", memory_bandwidth_gbs=4248.0, device_memory_gb=141.0,
    attention_ms=tuple((d, p, c, seq, impl, ms) for (d, p, c), rows in H200_MEASURED_ATTENTION_MS.items()
                       for seq, row in rows.items() for impl, ms in row.items()),
    memory_fractions={"rms_norm": (0.911, 0.702), "layer_norm": (0.910, 0.567), "rope": (0.893, 0.881),
                      "gelu": (0.856, 0.704), "swiglu": (1.0, 1.0), "cross_entropy": (0.713, 0.874),
                      "adamw": (0.974, 0.974), "layout_copy": (0.38, 0.38), "grad_accumulate": (0.64, 0.64)},
    launch_host_us=52.5,
    source="H200 SXM datasheet (the H100's compute and NVLink 4); copy bandwidth, attention, memory-bound "
           "kernels and host time per launch measured on one H200: see megalite/plan/hardware.py")

BUILTIN: dict[str, HardwareProfile] = {p.name: p for p in (A100_80GB, H100_SXM, H200)}
DEFAULT = "H100-SXM"


def builtin_for_device(device_name: str) -> str | None:
    """The nearest built-in profile of a GPU by the name CUDA reports ("NVIDIA H100 80GB HBM3" ->
    "H100-SXM"; an A100 40GB reads as the 80GB one, a GH200 as an H200); None for other devices."""
    for key, profile in (("H200", "H200"), ("H100", "H100-SXM"), ("A100", "A100-80GB")):
        if key in device_name.upper():
            return profile
    return None


def load_profile(name_or_path: str | HardwareProfile | None = None) -> HardwareProfile:
    """A built-in profile by name (case-insensitive), or one read from a JSON file; None: the default."""
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    name = name_or_path or DEFAULT
    for key, profile in BUILTIN.items():
        if key.lower() == name.lower():
            return profile
    path = Path(name)
    if not path.is_file():
        raise HardwareProfileError(f"--hardware {name}: not a built-in profile ({', '.join(BUILTIN)}) and no such "
                                   f"file; write one with `python tools/plan.py --calibrate {name}`")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise HardwareProfileError(f"--hardware {name}: cannot read a profile ({exc})") from None
    if not isinstance(data, dict):
        raise HardwareProfileError(f"--hardware {name}: a profile is a JSON object")
    return HardwareProfile.from_dict(data, where=f"--hardware {name}")
