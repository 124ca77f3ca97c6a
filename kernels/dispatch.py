"""Which implementation runs: the Triton kernels or the plain-PyTorch references.

`MEGALITE_KERNEL_BACKEND` (read on every call, so tests and users can switch it at run time):

- `auto` (default): Triton for CUDA tensors when triton imports, the PyTorch reference elsewhere;
- `triton`: always the Triton kernels. On CPU tensors this needs `TRITON_INTERPRET=1`, and
  the kernels then run in Triton's interpreter (how the tests check the kernel code itself);
- `torch`: always the PyTorch reference.

Triton is imported guardedly: where it is missing (macOS, Windows) `import megalite.kernels`
still works, `triton.jit` below is a no-op decorator and only the references run.

Triton decides interpreter-or-compiler when a function is decorated, i.e. when a module is
imported. For triton's own language functions (tl.sum, tl.max, tl.sigmoid are @jit functions)
that is the first `import triton` of the process: without a GPU we make that import an
interpreter-mode one (see `_import_triton`); if something else imported triton first in
compiled mode on a CPU-only machine, the kernels cannot run on CPU and `runnable` says so.
For our kernels, `runnable(kernel, device)` decides at launch time (it builds an interpreted
twin of a compiled kernel for CPU tensors), so it does not matter whether `megalite.kernels`
was imported before TRITON_INTERPRET was set. Kernels therefore call no other `@triton.jit`
helper of ours: each is self-contained.
"""
from __future__ import annotations

import functools
import os
import sys

import torch


def _import_triton():
    """Import triton; on a machine without a GPU, in interpreter mode.

    Triton fixes interpreter-or-compiler for its own language functions at its first import.
    Without a GPU compiled Triton cannot run anything, so the interpreter loses nothing and
    makes MEGALITE_KERNEL_BACKEND=triton work on CPU whoever imports megalite.kernels first.
    TRITON_INTERPRET is restored afterwards: the backend choice still reads it per call. An
    explicit TRITON_INTERPRET (e.g. =0 for `compile_check`) is respected as it is.
    """
    if "triton" in sys.modules or "TRITON_INTERPRET" in os.environ or torch.cuda.is_available():
        import triton
        import triton.language

        return triton, triton.language
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        import triton.language

        return triton, triton.language
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


try:  # triton is Linux-only; everything here must work without it
    triton, tl = _import_triton()
    HAVE_TRITON = True
except Exception:  # noqa: BLE001 - ImportError, or a broken install on an odd platform
    HAVE_TRITON = False

    class _TritonMissing:
        """Stands in for `triton` so kernel modules can still be defined (never launched)."""

        @staticmethod
        def jit(fn=None, **_kwargs):
            return fn if fn is not None else (lambda f: f)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 << max(0, (int(n) - 1).bit_length())

    class _LanguageMissing:
        constexpr = object  # only ever used in kernel signatures' annotations

    triton = _TritonMissing()
    tl = _LanguageMissing()

BACKENDS = ("auto", "triton", "torch")
SUPPORTED_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_POISON_ENV = "MEGALITE_KERNEL_POISON"


def backend_name() -> str:
    name = os.environ.get("MEGALITE_KERNEL_BACKEND", "auto").strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"MEGALITE_KERNEL_BACKEND={name!r} is not a backend; choose one of {BACKENDS}")
    return name


def interpreting() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def use_triton(tensor: torch.Tensor) -> bool:
    """Should an op on `tensor` run its Triton kernels (True) or its PyTorch reference (False)?"""
    name = backend_name()
    if name == "torch":
        return False
    if name == "auto":
        return HAVE_TRITON and tensor.device.type == "cuda"
    if not HAVE_TRITON:
        raise RuntimeError("MEGALITE_KERNEL_BACKEND=triton but triton cannot be imported here; "
                           "install triton (Linux) or set MEGALITE_KERNEL_BACKEND=auto or torch")
    if tensor.device.type != "cuda" and not interpreting():
        raise ValueError(f"MEGALITE_KERNEL_BACKEND=triton on {tensor.device.type} tensors needs Triton's "
                         "interpreter: set TRITON_INTERPRET=1, or use MEGALITE_KERNEL_BACKEND=auto")
    return True


_INTERPRETED_TWINS: dict[int, object] = {}


def interpreter_ready() -> bool:
    """Was triton imported with TRITON_INTERPRET=1, so its language functions can be interpreted?"""
    if not HAVE_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


def runnable(kernel, device: torch.device):
    """The kernel to launch for tensors on `device`: compiled on CUDA, interpreted on CPU.

    A kernel decorated while TRITON_INTERPRET was unset is a compiled JITFunction; for CPU
    tensors we wrap its Python function in the interpreter ourselves.
    """
    if device.type == "cuda":  # before the import below: this runs once per launch
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    if not interpreter_ready():
        raise RuntimeError("triton was first imported in this process without TRITON_INTERPRET=1, so its "
                           "language functions are compiled-only; set TRITON_INTERPRET=1 before anything "
                           "imports triton (or megalite.kernels) to run the kernels on CPU")
    twin = _INTERPRETED_TWINS.get(id(kernel))
    if twin is None:
        _interpret_device_functions(kernel.fn.__globals__)
        twin = _INTERPRETED_TWINS[id(kernel)] = InterpretedFunction(kernel.fn)
    return twin


def _interpret_device_functions(namespace: dict, seen: set | None = None) -> None:
    """Make the @triton.jit functions a kernel calls (its module's globals, and theirs) interpretable.

    A kernel's interpreted twin runs its Python source in its module's namespace, where a device
    function decorated while TRITON_INTERPRET was unset is a compiled-only JITFunction (calling it
    raises); in a process whose triton is in interpreter mode nothing can be compiled anyway, so
    each is swapped for its interpreted twin, once per namespace."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    seen = set() if seen is None else seen
    if id(namespace) in seen:
        return
    seen.add(id(namespace))
    for name, value in list(namespace.items()):
        if isinstance(value, JITFunction):
            namespace[name] = InterpretedFunction(value.fn)
            _interpret_device_functions(value.fn.__globals__, seen)


def check_float_dtype(op: str, tensor: torch.Tensor, name: str = "input",
                      supported: tuple[torch.dtype, ...] = SUPPORTED_FLOAT_DTYPES) -> None:
    if tensor.dtype not in supported:
        names = ", ".join(str(d).replace("torch.", "") for d in supported)
        raise TypeError(f"{op}: {name} has dtype {str(tensor.dtype).replace('torch.', '')}; the Triton kernel "
                        f"supports {names} (or set MEGALITE_KERNEL_BACKEND=torch for the reference)")


def check_same_device(op: str, *tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{op}: inputs are on different devices {sorted(map(str, devices))}; move them to one")


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty for kernel outputs; NaN-filled (or -1 for integers) when MEGALITE_KERNEL_POISON=1.

    The tests poison every output this way, so an element a kernel forgets to write fails.
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get(_POISON_ENV, "0") == "1":
        out.fill_(float("nan") if out.is_floating_point() else -1)
    return out


def num_programs_hint(device: torch.device) -> int:
    """How many persistent programs to launch for reductions over rows (e.g. weight gradients)."""
    if device.type == "cuda":
        return 4 * _multi_processor_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # the interpreter runs programs one after another: keep few


@functools.lru_cache(maxsize=None)  # called per launch; the device's properties never change
def _multi_processor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids: `triton.cdiv` is a constexpr function in newer Triton, whose host
    call costs microseconds per launch (issue 26: the host's time per call is the small model's step)."""
    return -(-a // b)


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [rows, n] with unit column stride (a view when possible, else a copy).

    Kernels take the row stride as an argument, so row-strided views (e.g. a slice of a
    fused qkv output) are not copied.
    """
    rows = tensor.reshape(-1, tensor.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows
