"""What this CPU's instruction set offers, read once from Linux's /proc/cpuinfo (torch-free).

Both the start notice (training/launch_checks.py: bf16 runs emulated here) and `--calibrate`
(calibration.py: measure bf16 GEMMs only where they are native) ask the same question.
"""

# x86 AVX512-BF16 and AMX-BF16, Arm's BF16 extension ("features" line)
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags (x86 "flags", Arm "Features" lines), or None where unknown (not Linux)."""
    try:
        with open("/proc/cpuinfo") as info:
            return {word for line in info if line.lower().startswith(("flags", "features"))
                    for word in line.split(":", 1)[-1].split()}
    except OSError:
        return None


def has_native_bf16(flags: set[str]) -> bool:
    """Whether these flags name bf16 arithmetic; without it torch converts every bf16 element."""
    return bool(flags & NATIVE_BF16_FLAGS)
