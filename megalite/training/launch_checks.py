"""Everything a run checks before it starts, on every rank before any process group exists.

    problems = launch_problems(cfg, world_size, tokenizer_vocab_size, memory=(bytes, "what"))

The settings' own problems come from `RunConfig.validate()` (declared bounds, the model,
combinations of settings, data files); what needs the world or the planner is added here: the
planner's pre-flight (world size, divisibility by tp/pp/cp, batch arithmetic, sequence and
context parallelism), the vocabulary against the tokenizer, the pipeline schedule built and
verified, and, when the device's memory is given, the planner's memory estimate against it with
the changes that would make it fit. Keeping these here lets the configuration stay below the
planner: megalite.plan imports megalite.config, never the reverse.

Pure Python: torch is imported only where a check asks the device (`memory_per_rank()`: the GPU's
memory; the FP8 check: its compute capability; the Triton check: the kernels' dispatch), inside
those functions, so the checks of the settings load without torch.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from megalite.config.choices import Precision
from megalite.config.rampup import microbatch_counts
from megalite.cpu_features import cpu_flags as read_cpu_flags, has_native_bf16
from megalite.paths import output_dir_problem, output_file_problem
from megalite.pipeline.schedules import check_pipeline_config
from megalite.plan.validity import preflight

if TYPE_CHECKING:
    from megalite.config import RunConfig


def launch_problems(cfg: RunConfig, world_size: int, tokenizer_vocab_size: int | None = None,
                    memory: tuple[float, str] | None = None) -> list[str]:
    """Every problem with this resolved configuration on a world of `world_size` ranks, each
    naming its fix ([] when the run may start). `memory`: (bytes each rank may use, what they
    are, e.g. "GPU memory"); the memory estimate is checked only once nothing else is wrong."""
    own = cfg.validate()
    if cfg.bound_problems():
        return own  # values out of range: the layout arithmetic would divide by them
    try:
        model = cfg.gpt_config()
    except ValueError:
        return own  # validate() names the model's problem
    problems = preflight(model, cfg, world_size)
    if tokenizer_vocab_size is not None and model.vocab_size < tokenizer_vocab_size:
        problems.append(f"--vocab-size {model.vocab_size} is smaller than the tokenizer's {tokenizer_vocab_size}; "
                        f"drop --vocab-size or set it >= {tokenizer_vocab_size}")
    if memory is not None:  # launching: the host memory of what each step reads (before building schedules)
        problems += host_memory_problems(cfg, model.seq_length, host_ram_per_rank())
    if cfg.parallel.pp > 1 and not problems:
        try:  # the pipeline's own check: layer split, schedule rules, the schedule built and verified (for
            p = cfg.parallel  # every number of microbatches a --rampup-batch-size step runs)
            for m in microbatch_counts(cfg):
                check_pipeline_config(cfg.schedule, model.num_layers, p.pp, m, p.virtual_stages,
                                      p.decoder_first_stage_layers, p.decoder_last_stage_layers, p.pipeline_layout)
        except ValueError as exc:
            problems.append(str(exc) + _during_rampup(cfg, m))
    problems = list(dict.fromkeys(problems + own + path_problems(cfg) + _accepted_nonsense(cfg, model.num_layers)))
    if not problems and memory is not None:
        problems = preflight(model, cfg, world_size, gpu_memory=memory[0], memory_of=memory[1])
    return problems


def _during_rampup(cfg: RunConfig, m: int) -> str:
    if cfg.training.rampup_batch_size is None or m == cfg.num_microbatches:
        return ""
    return (f" (a --rampup-batch-size step of {m * cfg.training.micro_batch_size * cfg.dp} samples: choose START and "
            f"INCREMENT so that every batch of the ramp runs)")


def _accepted_nonsense(cfg: RunConfig, num_layers: int) -> list[str]:
    """Settings that ran as if not given: --recompute-num-layers beyond the blocks of a model chunk."""
    p, problems = cfg.parallel, []  # (--virtual-stages at --pp 1: the planner's preflight names it)
    if p.recompute_num_layers is not None and num_layers % (p.pp * p.virtual_stages) == 0:
        per_chunk = num_layers // (p.pp * p.virtual_stages)
        if p.recompute_num_layers > per_chunk:
            problems.append(f"--recompute-num-layers {p.recompute_num_layers} is more than the {per_chunk} blocks of "
                            f"each model chunk ({num_layers} layers / (pp {p.pp} x virtual stages "
                            f"{p.virtual_stages})); choose 1..{per_chunk}")
    return problems


# Host bytes per sample a step holds: its index (a Python int in a list) and its input_ids and labels
# rows (int64, seq tokens each) in the collated microbatches; load_microbatches reads a whole step.
HOST_BYTES_PER_INDEX = 36


def host_memory_problems(cfg: RunConfig, seq_length: int, ram_per_rank: float) -> list[str]:
    """The step's samples against this rank's share of host RAM (a batch size that cannot fit grew the
    process until the machine ran out, neither refusing nor training)."""
    per_rank = cfg.global_batch_size // max(1, cfg.dp)
    need = per_rank * (HOST_BYTES_PER_INDEX + 2 * 8 * seq_length)
    if need <= 0.8 * ram_per_rank:
        return []
    return [f"--global-batch-size {cfg.global_batch_size}: each rank reads {per_rank} samples of {seq_length} tokens "
            f"per step into host memory ({need / 1e9:.3g} GB of token ids), more than its share of this machine's RAM "
            f"({ram_per_rank / 1e9:.3g} GB); lower --global-batch-size or spread it over more data-parallel ranks"]


def host_ram_per_rank() -> float:
    """This machine's RAM shared by the node's ranks (LOCAL_WORLD_SIZE)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def path_problems(cfg: RunConfig) -> list[str]:
    """Every output path the run will write, checked now (a directory given as a file, a file as a
    directory, or a path below a file ended in a traceback at its first write)."""
    lg, ft = cfg.logging, cfg.fault_tolerance
    checks = []
    if lg.metrics_file:  # the configuration beside it: its own problem only when the metrics file has none
        checks.append(output_file_problem("--metrics-file", lg.metrics_file)
                      or output_file_problem("--metrics-file", os.path.splitext(lg.metrics_file)[0] + ".config.toml"))
    if lg.tensorboard_dir:
        checks.append(output_dir_problem("--tensorboard-dir", lg.tensorboard_dir))
    if lg.wandb_save_dir:
        checks.append(output_dir_problem("--wandb-save-dir", lg.wandb_save_dir))
    if lg.profile_steps:
        checks.append(output_dir_problem("--profile-dir", lg.profile_dir))
    if lg.memory_snapshot:
        checks.append(output_dir_problem("--memory-snapshot", lg.memory_snapshot))
    if ft.hang_timeout and ft.hang_report_dir:
        checks.append(output_dir_problem("--hang-report-dir", ft.hang_report_dir))
    return list(dict.fromkeys(c for c in checks if c))


def machine_problems(cfg: RunConfig, cuda_available: bool, kernel_backend: str) -> list[str]:
    """What this machine cannot run of `cfg`: --cuda-graph without CUDA, and bf16 in Triton's CPU
    interpreter (numpy has no bfloat16: its tl.dot returns garbage while the loss looks normal).
    kernel_backend: MEGALITE_KERNEL_BACKEND as the kernels read it (`dispatch.backend_name()`)."""
    problems = []
    if cfg.training.cuda_graph and not cuda_available:
        problems.append("--cuda-graph needs a CUDA GPU and none is visible here; drop --cuda-graph")
    if cfg.logging.memory_snapshot and not cuda_available:
        problems.append("--memory-snapshot records the CUDA allocator's history and no CUDA GPU is visible here; "
                        "drop --memory-snapshot (on a CPU, --profile-steps records memory events)")
    if kernel_backend == "triton" and not cuda_available:  # the kernels would raise at the first op
        from megalite.kernels.dispatch import HAVE_TRITON, interpreting  # torch: see the module docstring

        if not HAVE_TRITON:
            problems.append("MEGALITE_KERNEL_BACKEND=triton but triton cannot be imported here; install triton "
                            "(Linux) or set MEGALITE_KERNEL_BACKEND=auto")
        elif not interpreting():
            problems.append("MEGALITE_KERNEL_BACKEND=triton without a GPU needs Triton's CPU interpreter: set "
                            "TRITON_INTERPRET=1 (slow: for checking kernels), or MEGALITE_KERNEL_BACKEND=auto")
    if cfg.precision.precision == Precision.BF16 and not cuda_available and kernel_backend == "triton":
        problems.append("MEGALITE_KERNEL_BACKEND=triton on a CPU runs Triton's interpreter, which has no bf16 "
                        "matrix multiply; use --precision fp16 or fp32, or MEGALITE_KERNEL_BACKEND=auto")
    if cfg.precision.fp8_format is not None:
        problems += _fp8_machine_problems(cuda_available, kernel_backend)
    return problems


def _fp8_machine_problems(cuda_available: bool, kernel_backend: str) -> list[str]:
    """FP8 GEMMs need Ada or Hopper (sm_89+); Triton's CPU interpreter has no float8. On a CPU without
    the interpreter torch._scaled_mm runs them (for testing; the start banner says so)."""
    if not cuda_available:
        return ["--fp8-format on Triton's CPU interpreter: it has no float8 types; use "
                "MEGALITE_KERNEL_BACKEND=auto (torch._scaled_mm runs FP8 on a CPU, for testing)"] \
            if kernel_backend == "triton" else []
    import torch  # asks the device: see the module docstring

    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        return [f"--fp8-format needs an sm_89+ GPU (Ada, Hopper) for FP8 GEMMs; this one is sm_{major}{minor}: drop "
                f"--fp8-format"]
    return []


def machine_notes(cfg: RunConfig, cuda_available: bool, cpu_flags: set[str] | None = None) -> list[str]:
    """What this machine will do slowly, said once at start (not refused): bf16 on a CPU without native
    bf16 arithmetic (avx512_bf16 / amx_bf16) runs emulated, several times slower than fp32."""
    if cuda_available or cfg.precision.precision != Precision.BF16:
        return []
    flags = cpu_flags if cpu_flags is not None else read_cpu_flags()
    if flags is None or has_native_bf16(flags):
        return []
    return ["note: this CPU has no native bf16 arithmetic (no avx512_bf16 / amx_bf16): bf16 runs emulated, several "
            "times slower than fp32; use --precision fp32 here unless bf16 itself is what you test"]


def memory_per_rank() -> tuple[float, str]:
    """(bytes, whose) this rank may fill: its GPU's memory, or on a CPU the machine's RAM shared by
    the node's ranks (LOCAL_WORLD_SIZE). Asked before any process group exists."""
    import torch  # asks the device: see the module docstring

    if torch.cuda.is_available():
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        return float(torch.cuda.get_device_properties(device).total_memory), f"GPU {device}'s memory"
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / ranks, ("this machine's RAM" + (f" / {ranks} ranks" if ranks > 1 else ""))
