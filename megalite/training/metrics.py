"""See while it runs: throughput, MFU/HFU, memory, time split, ETA, writers and stragglers.

The training loop owns the clock; this module only turns what it measured into numbers:

    meter = ThroughputMeter(model, seq_length=1024, micro_batch_size=4, dp=8, num_microbatches=16,
                            world_size=64, recompute="none", total_steps=10_000)
    timer = TimeBreakdown()
    with timer.phase("forward"): ...
    record = meter.step(step, step_time_s, loss=..., lr=..., grad_norm=...)
    record.update(timer.summary(step_time_s), **memory_stats(device))
    writer.write(record); print(progress_line(record))

MFU (PaLM, appendix B): model FLOPs per token (6N + 12*L*h*s, `GPTConfig.flops_per_token`)
times tokens per second, over the peak of all GPUs. HFU counts recomputed FLOPs too.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from megalite.config.choices import Recompute
from megalite.distributed import comm
from megalite.config.model import GPTConfig
from megalite.plan.params import hardware_flops_per_token
from megalite.training.metrics_file import drop_torn_tail

# Dense (no sparsity) peak TFLOP/s per GPU by precision; fp32 means TF32 tensor cores.
# Matched in order on torch.cuda.get_device_name(): more specific names first.
PEAK_TFLOPS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("H100", "PCIE"), {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0}),
    (("H100", "NVL"), {"bf16": 835.0, "fp16": 835.0, "fp32": 418.0}),
    (("H100",), {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0}),        # SXM5 ("H100 80GB HBM3")
    (("H200",), {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0}),
    (("GH200",), {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0}),
    (("B200",), {"bf16": 2250.0, "fp16": 2250.0, "fp32": 1100.0}),
    (("A100",), {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}),
    (("A10G",), {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0}),
    (("A10",), {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5}),
    (("L40S",), {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0}),
    (("L4",), {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0}),
    (("V100",), {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7}),
    (("MI300X",), {"bf16": 1307.0, "fp16": 1307.0, "fp32": 653.0}),
]


def peak_tflops(device_name: str | None = None, precision: str = "bf16") -> float | None:
    """Dense peak TFLOP/s of one GPU for `precision`, or None when the GPU is unknown (or CPU)."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    name = device_name.upper()
    for keys, peaks in PEAK_TFLOPS:
        if all(k in name for k in keys):
            return peaks.get(precision) or None
    return None


def measured_attention_span(microbatches: list[dict[str, torch.Tensor]], window: int | None) -> float | None:
    """The keys per query of these microbatches' packed documents and window, in the FLOP count's
    convention (config.model.attention_span: 2 * pairs / tokens - 1); token i of a document sees
    min(position_i + 1, window) keys. None without position_ids and window (the sequence length)."""
    if window is None and not any("position_ids" in mb for mb in microbatches):
        return None
    pairs, tokens = 0, 0
    for mb in microbatches:
        ids = mb["input_ids"]
        positions = mb["position_ids"] if "position_ids" in mb else torch.arange(ids.shape[1]).expand(ids.shape)
        seen = positions + 1 if window is None else (positions + 1).clamp(max=window)
        pairs, tokens = pairs + int(seen.sum()), tokens + ids.numel()
    return 2 * pairs / tokens - 1


def effective_batch(micro_batch_size: int, dp: int, num_microbatches: int) -> int:
    """Sequences per optimizer step: micro x data-parallel replicas x accumulation steps."""
    return micro_batch_size * dp * num_microbatches


class ThroughputMeter:
    """Per-step throughput, MFU/HFU, GPU-hours and ETA for a fixed model and layout."""

    def __init__(self, model: GPTConfig, seq_length: int, *, micro_batch_size: int, dp: int, num_microbatches: int,
                 world_size: int, recompute: str = "none", total_steps: int | None = None,
                 peak_tflops_per_gpu: float | None = None, start_step: int = 0, recompute_fraction: float = 1.0):
        self.world_size = world_size
        self.total_steps = total_steps
        self.samples_per_step = effective_batch(micro_batch_size, dp, num_microbatches)
        self.seq_length = seq_length
        self.tokens_per_step = self.samples_per_step * seq_length
        self.model_flops_per_token = model.flops_per_token(seq_length)
        self.hardware_flops_per_token = hardware_flops_per_token(model, recompute, seq_length, recompute_fraction)
        self.model, self.recompute, self.recompute_fraction = model, recompute, recompute_fraction
        self.peak_flops = peak_tflops_per_gpu * 1e12 if peak_tflops_per_gpu else None
        self.gpu_seconds = 0.0
        self._recent: list[float] = []  # last step times, for the ETA
        self._recent_per_sample: list[float] = []  # and per sample (the ETA of a growing batch)
        self._start_step = start_step

    def step(self, step: int, step_time_s: float, samples: int | None = None, remaining_samples: int | None = None,
             attention_span: float | None = None, **fields: Any) -> dict[str, Any]:
        """The metrics record of optimizer step `step` that took `step_time_s` seconds.

        `samples`: this step's global batch when it differs from the layout's (--rampup-batch-size);
        `remaining_samples`: the samples of the steps still to run, when their batches differ (the ETA
        then goes by seconds per sample instead of seconds per step).
        `attention_span`: the keys per query of this step's packed documents / window (StepResult's), so the
        FLOPs (and MFU) count only the attention computed; None: the layout's sequence length.
        Extra keyword fields (loss, lr, grad_norm, ...) are copied into the record.
        """
        if step_time_s <= 0:
            raise ValueError(f"step_time_s must be positive, got {step_time_s}")
        self.gpu_seconds += step_time_s * self.world_size
        samples = samples or self.samples_per_step
        self._recent = (self._recent + [step_time_s])[-20:]
        self._recent_per_sample = (self._recent_per_sample + [step_time_s / samples])[-20:]
        tokens_per_step = samples * self.seq_length
        tokens_per_sec = tokens_per_step / step_time_s
        model_flops, hardware_flops = self.model_flops_per_token, self.hardware_flops_per_token
        if attention_span is not None:
            model_flops = self.model.flops_per_token(span=attention_span)
            hardware_flops = hardware_flops_per_token(self.model, self.recompute, self.seq_length,
                                                      self.recompute_fraction, span=attention_span)
        record: dict[str, Any] = {"step": step, **fields}
        record.update(
            step_time_s=step_time_s,
            tokens_per_step=tokens_per_step,
            effective_batch=samples,
            tokens_per_sec=tokens_per_sec,
            tokens_per_sec_per_rank=tokens_per_sec / self.world_size,
            samples_per_sec=samples / step_time_s,
            tflops_per_rank=model_flops * tokens_per_sec / self.world_size / 1e12,
            gpu_hours=self.gpu_seconds / 3600.0,
        )
        if self.peak_flops:
            record["mfu"] = model_flops * tokens_per_sec / (self.world_size * self.peak_flops)
            if self.recompute != Recompute.NONE:
                record["hfu"] = hardware_flops * tokens_per_sec / (self.world_size * self.peak_flops)
        if self.total_steps is not None:
            remaining = max(0, self.total_steps - step)
            record["total_steps"] = self.total_steps
            record["eta_s"] = remaining * statistics.median(self._recent) if remaining_samples is None \
                else remaining_samples * statistics.median(self._recent_per_sample)
        return record


class TimeBreakdown:
    """Seconds spent per phase (data, forward, backward, optimizer, communication) since reset.

    Host-side timing: with `sync_cuda=True` each phase synchronises the device on entry and exit
    so GPU work is attributed to the phase that launched it (costs a little overlap).
    """

    PHASES = ("data", "forward", "backward", "optimizer", "communication")

    def __init__(self, sync_cuda: bool = False):
        self.sync_cuda = sync_cuda and torch.cuda.is_available()
        self.seconds: dict[str, float] = {}
        self._comm_mark = self._ledger_seconds()

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.sync_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(f"megalite/{name}"):  # a named range in --profile-steps traces
                yield
        finally:
            if self.sync_cuda:
                torch.cuda.synchronize()
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @staticmethod
    def _ledger_seconds() -> float:
        return sum(comm.ledger.seconds.values())

    def add_comm_from_ledger(self) -> float:
        """Add the host-side seconds megalite.distributed.comm spent in blocking calls since the last call."""
        now = self._ledger_seconds()
        delta, self._comm_mark = max(0.0, now - self._comm_mark), now
        self.add("communication", delta)
        return delta

    def summary(self, step_time_s: float | None = None) -> dict[str, float]:
        """{'time_<phase>_s': seconds} (+ 'time_other_s' when the step time is given)."""
        out = {f"time_{name}_s": self.seconds.get(name, 0.0) for name in self.PHASES}
        out.update({f"time_{k}_s": v for k, v in self.seconds.items() if k not in self.PHASES})
        if step_time_s is not None:
            # communication happens inside forward/backward/optimizer: not subtracted again
            counted = sum(v for k, v in self.seconds.items() if k != "communication")
            out["time_other_s"] = max(0.0, step_time_s - counted)
        return out

    def reset(self) -> None:
        self.seconds.clear()
        self._comm_mark = self._ledger_seconds()


def memory_stats(device: torch.device | str | None = None) -> dict[str, float]:
    """Memory in bytes: CUDA allocated / peak / reserved on a GPU; process RSS / peak RSS on CPU."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return {"mem_allocated_bytes": torch.cuda.memory_allocated(device),
                "mem_peak_bytes": torch.cuda.max_memory_allocated(device),
                "mem_reserved_bytes": torch.cuda.memory_reserved(device)}
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {"mem_rss_bytes": rss, "mem_peak_bytes": max(peak, rss)}


def estimate_vs_measured(estimate, device: torch.device | str) -> str:
    """One log line after the first step: the planner's per-rank bytes beside the measured peak.

    `estimate` is a megalite.plan.per_rank.Estimate for this rank's layout. On CUDA the
    measured figure is torch.cuda.max_memory_allocated (it also holds transient buffers the
    estimate leaves to its 10% headroom); on CPU, the process's peak RSS (not comparable).
    """
    device = torch.device(device)
    parts = (f"params {estimate.param_bytes / 1e9:.2f} + grads {estimate.grad_bytes / 1e9:.2f} + optimizer "
             f"{estimate.optimizer_state_bytes / 1e9:.2f} + activations {estimate.activation_bytes / 1e9:.2f}")
    if device.type == "cuda":
        measured = torch.cuda.max_memory_allocated(device)
        ratio = measured / estimate.total_bytes if estimate.total_bytes else float("nan")
        return (f"memory after step 1: measured peak {measured / 1e9:.2f} GB (max_memory_allocated) vs estimated "
                f"{estimate.total_bytes / 1e9:.2f} GB ({parts}); measured/estimated {ratio:.2f}")
    return (f"memory: estimated {estimate.total_bytes / 1e9:.2f} GB per rank on a GPU ({parts}); "
            f"this CPU process peaks at {memory_stats(device)['mem_peak_bytes'] / 1e9:.2f} GB RSS")


# ---------------------------------------------------------------------------------------------
# Output: JSON lines, TensorBoard, one readable line
# ---------------------------------------------------------------------------------------------


class MetricsWriter:
    """Append one JSON object per logged step to `path`; send the same numbers to every sink
    (TensorBoard, W&B: megalite.training.metrics_sinks).

    Only the rank that should write creates one (typically global rank 0; pass enabled=False
    elsewhere). Every line has at least step, loss, lr, grad_norm and tokens_per_sec.
    """

    REQUIRED = ("step", "loss", "lr", "grad_norm", "tokens_per_sec")

    def __init__(self, path: str | None, sinks: list | tuple = (), enabled: bool = True):
        self.enabled = enabled and (path is not None or bool(sinks))
        self._file = None
        self._sinks = list(sinks) if self.enabled else []
        if not self.enabled:
            return
        if path is not None:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            drop_torn_tail(path)
            self._file = open(path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        missing = [k for k in self.REQUIRED if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}; pass them to ThroughputMeter.step(...)")
        self._emit(record, prefix="", flags_too=True)  # e.g. "skipped" as 0/1

    def write_event(self, record: dict[str, Any]) -> None:
        """One line for an event of the run, e.g. {"event": "resize", "step", ...} (no loss: readers
        of the step records skip it); its numbers go to the sinks under "<event>/<name>"."""
        self._emit(record, prefix=f"{record['event']}/", flags_too=False)

    def _emit(self, record: dict[str, Any], prefix: str, flags_too: bool) -> None:
        """One JSON line, and every number (booleans only if `flags_too`) to each sink at the
        record's step."""
        if not self.enabled:
            return
        if self._file is not None:
            self._file.write(json.dumps(record, default=float) + "\n")
        numbers = {prefix + key: value for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float)) and (flags_too or not isinstance(value, bool))}
        for sink in self._sinks:
            sink.scalars(numbers, record["step"])

    def write_eval(self, step: int, loss: float) -> None:
        """One line for an evaluation: {"step", "eval_loss", "eval_perplexity"}."""
        record = {"step": step, "eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0))}
        self._emit(record, prefix="", flags_too=False)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        for sink in self._sinks:
            sink.close()


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    return f"{h}h{rem // 60:02d}m" if h else f"{rem // 60}m{rem % 60:02d}s"


def _si(value: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def progress_line(record: dict[str, Any]) -> str:
    """One readable line, e.g. 'step 120/1000 | loss 3.2140 | lr 3.00e-04 | ... | eta 1h12m'."""
    total = f"/{record['total_steps']}" if record.get("total_steps") else ""
    parts = [f"step {record['step']}{total}"]
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.2e}")
    if record.get("grad_norm") is not None:
        parts.append(f"gnorm {record['grad_norm']:.3f}")
    if "loss_scale" in record:  # fp16: the dynamic scale and the updates skipped so far (as Megatron's line)
        parts.append(f"loss scale {record['loss_scale']:g} | skipped {record.get('skipped_steps', 0)}")
    if "global_batch_size" in record:  # under --rampup-batch-size: the step's batch
        parts.append(f"batch {record['global_batch_size']}")
    parts.append(f"{_si(record['tokens_per_sec'])} tok/s ({_si(record['tokens_per_sec_per_rank'])}/rank)")
    parts.append(f"{1e3 * record['step_time_s']:.0f} ms/step")
    if "mfu" in record:
        parts.append(f"MFU {100 * record['mfu']:.1f}%" + (f" HFU {100 * record['hfu']:.1f}%" if "hfu" in record else ""))
    if "moe_aux_loss" in record:  # mixture of experts: balancing loss, load max/mean, dropped routes
        parts.append(f"moe aux {record['moe_aux_loss']:.4f} load {record['moe_load_imbalance']:.2f}x"
                     + (f" dropped {record['moe_dropped_tokens']}" if record.get("moe_dropped_tokens") else ""))
    if "mtp_loss_1" in record:  # DeepSeek's multi-token prediction: each depth's loss
        parts.append("mtp " + " ".join(f"{record[k]:.4f}" for k in sorted(record) if k.startswith("mtp_loss_")))
    if "mem_peak_bytes" in record:
        parts.append(f"mem peak {record['mem_peak_bytes'] / 1e9:.2f} GB")
    if "eta_s" in record:
        parts.append(f"eta {_duration(record['eta_s'])}")
    return " | ".join(parts)


# ---------------------------------------------------------------------------------------------
# Stragglers
# ---------------------------------------------------------------------------------------------


@dataclass
class StragglerReport:
    median_s: float
    slowest: list[tuple[int, str, float, float]]
    """(rank, host, step seconds, slowdown vs the median, e.g. 0.25 for 25% slower), slowest first."""

    def describe(self) -> str:
        if not self.slowest:
            return f"no stragglers (median step {self.median_s:.3f} s)"
        ranks = ", ".join(f"rank {r} on {host} {t:.3f} s (+{100 * slow:.1f}%)" for r, host, t, slow in self.slowest)
        return f"stragglers vs median step {self.median_s:.3f} s: {ranks}"


def straggler_report(step_times: list[float], hosts: list[str] | None = None, top_k: int = 3,
                     threshold: float = 0.05) -> StragglerReport:
    """Name up to `top_k` ranks whose step time exceeds the median by more than `threshold`.

    step_times[r] is rank r's time (e.g. gathered with `gather_step_times`).
    """
    if not step_times:
        raise ValueError("straggler_report needs at least one rank's step time")
    hosts = hosts or ["?"] * len(step_times)
    median = statistics.median(step_times)
    slow = [(r, hosts[r], t, t / median - 1.0) for r, t in enumerate(step_times) if t > median * (1 + threshold)]
    slow.sort(key=lambda item: -item[2])
    return StragglerReport(median, slow[:top_k])


def gather_step_times(step_time_s: float, group=None) -> tuple[list[float], list[str]]:
    """All ranks' (step time, hostname) over `group` (default: the world), via megalite.distributed.comm."""
    group = group if group is not None else comm.world_group()
    pairs = comm.all_gather_object((step_time_s, socket.gethostname()), group)
    return [t for t, _ in pairs], [h for _, h in pairs]
