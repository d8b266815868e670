"""Where Triton can run a kernel of this package: CUDA tensors, or anywhere under its CPU
interpreter (TRITON_INTERPRET=1, set before triton is first imported). Shared by every kernel's
host wrapper, which falls back to its torch path (or raises) with the reason returned here."""

from __future__ import annotations

import os

import torch


def import_triton():
    """(triton, triton.language, None), or (None, None, why) where triton cannot be imported.
    Each kernel module binds the first two as its globals `triton` and `tl`, which its
    @triton.jit functions read, and keeps the third as `_TRITON_IMPORT_ERROR`."""
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - triton ships with torch on every platform we use
        return None, None, f"triton is not importable ({e})"
    return triton, tl, None


def is_interpreted(fn) -> bool:
    """Whether a @triton.jit function was decorated under the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


def pick_kernel(kernel, device: torch.device, import_error: str | None):
    """(kernel, None) where Triton can run `kernel` on `device`, else (None, reason).

    @triton.jit reads TRITON_INTERPRET when a function is decorated: Triton's own library
    (tl.zeros, ...) when triton is first imported, a kernel when its module is imported. The
    interpreter needs both; setting the variable any later changes nothing."""
    if kernel is None:
        return None, import_error
    if is_interpreted(kernel):
        import triton.language as tl

        if not is_interpreted(tl.zeros):
            return None, ("TRITON_INTERPRET was set after triton was imported: set it before the "
                          "first `import triton` of the process")
        return kernel, None  # runs on any device
    if device.type == "cuda":
        return kernel, None
    requested = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
    late = " when triton was imported (setting it later has no effect)" if requested else ""
    return None, f"tensors are on {device.type} and TRITON_INTERPRET was not set{late}"


def compile_for_nvidia(fn, signature: dict, constexprs: dict, options: dict, arch: int):
    """Compile a @triton.jit function for an NVIDIA target without a GPU (Triton's bundled
    ptxas): returns (compiled kernel, "REG:n STACK:m" per thread from cuobjdump). Raises what
    the compiler raises. For the scripts' --compile-only checks."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs),
                              target=GPUTarget("cuda", arch, 32), options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        dump = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                              text=True).stdout
    usage = " ".join(next((ln for ln in dump.splitlines() if "REG:" in ln), "?").split()[:2])
    return compiled, usage


def signature_of(kernel, types: dict[str, str], default: str = "i32") -> dict[str, str]:
    """A @triton.jit kernel's argument types for compile_for_nvidia: "constexpr" for its
    constexpr parameters, types[name] for the others ("*bf16", "*i64", "fp32", ...), default
    where a name is absent."""
    return {p.name: "constexpr" if p.is_constexpr else types.get(p.name, default) for p in kernel.params}


def not_compilable_reason(kernel) -> str | None:
    """Why the scripts' --compile-only cannot compile `kernel` in this process (it was decorated
    under the interpreter), or None."""
    import triton

    return None if isinstance(kernel, triton.JITFunction) else "TRITON_INTERPRET is set: unset it for --compile-only"


def ones_specialised(fn, signature: dict, constexprs: dict) -> tuple[dict, dict]:
    """(signature, constexprs) of the binary Triton's launcher compiles when every int argument
    it specialises is 1: it then passes the argument as the constant 1, so an expression of
    such arguments alone is a Python int inside the kernel (`(A * Q).to(...)` fails to compile
    where A = 1, a one-request batch; the CPU interpreter never specialises, so only a GPU or
    this compile shows it). Arguments in `do_not_specialize` stay as they are."""
    sig, consts = dict(signature), dict(constexprs)
    for p in fn.params:
        if not p.is_constexpr and not p.do_not_specialize and sig.get(p.name) in ("i32", "i64"):
            sig[p.name], consts[p.name] = "constexpr", 1
    return sig, consts


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def compile_report(fn, signature: dict, constexprs: dict, options: dict, arch: int) -> tuple[object, str, int]:
    """compile_for_nvidia for a table that reports every configuration: (compiled, usage, 0), or
    (None, "FAILED: <error and its first line>", 1) where the compiler raises, for these
    arguments or for the same with every specialisable int argument 1 (ones_specialised)."""
    try:
        compiled, usage = compile_for_nvidia(fn, signature, constexprs, options, arch)
    except Exception as e:  # noqa: BLE001 - the table goes on; the caller's exit status says it failed
        return None, f"FAILED: {_first_line(e)}", 1
    ones = ones_specialised(fn, signature, constexprs)
    if ones != (signature, constexprs):
        try:
            compile_for_nvidia(fn, *ones, options, arch)
        except Exception as e:  # noqa: BLE001
            return None, f"FAILED with its int arguments 1, as Triton specialises them: {_first_line(e)}", 1
    return compiled, usage, 0


def check_once(cache: dict, kernel, device, import_error: str | None, differs) -> str | None:
    """None if `kernel` may serve on `device`, else why not: Triton cannot run it there, or
    differs(device) (its comparison with the torch path: None where they agree, else how they
    differ) found a difference or raised. A verdict is kept in `cache` per device, so each
    process compiles and compares once."""
    import torch

    device = torch.device(device)
    name = str(device)
    if name in cache:
        return cache[name]
    runnable, why_not = pick_kernel(kernel, device, import_error)
    if runnable is None:
        return why_not
    try:
        why = differs(device)
    except Exception as e:  # noqa: BLE001 - any failure means: keep the torch path
        why = f"the kernel failed its check: {type(e).__name__}: {e}"
    cache[name] = why
    return why


def choose_kernels(mode: str, device, module_name: str, kernel_name: str, what: str) -> str | None:
    """Whether `what` runs through the kernels of kernels/<module_name>.py on `device`: None if
    it does, else why not ("" where nothing was tried). mode "torch": never; "auto": on a CUDA
    device once the module's `check_kernel` matched torch there; "triton": wherever Triton can
    run `kernel_name` (e.g. its CPU interpreter), else ValueError saying why. The module is
    imported only when needed: importing triton early would keep its interpreter off for good."""
    import importlib

    import torch

    device = torch.device(device)
    if mode == "torch" or (mode == "auto" and device.type != "cuda"):
        return ""
    module = importlib.import_module(f"vllm_ouroboros.kernels.{module_name}")
    if mode == "triton":
        why = pick_kernel(getattr(module, kernel_name), device, module._TRITON_IMPORT_ERROR)[1]
        if why is not None:
            raise ValueError(f"{what}: kernels asked for ('triton'), but they cannot run here: {why}")
        return None
    return module.check_kernel(device)
