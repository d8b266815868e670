"""What Triton compiles a kernel launch by, computed on the host: for tests that every launch a
server makes eagerly finds a binary compiled before serving (tests/test_tree_attention_kernel.py,
tests/test_pool_warmup.py). Works on compiled kernels and under the CPU interpreter alike."""

from __future__ import annotations

import inspect

import torch


class Recorder:
    """Wraps a @triton.jit kernel: records each launch's arguments, then launches it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.kernel, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _not_specialised(kernel) -> set[str]:
    params = getattr(kernel, "params", None)  # JITFunction (compiled)
    if params is not None:
        return {p.name for p in params if p.do_not_specialize}
    return set(getattr(kernel, "kwargs", {}).get("do_not_specialize") or ())  # interpreter


def _constexprs(kernel) -> set[str]:
    """The kernel's tl.constexpr parameters, from its annotations (strings under `from
    __future__ import annotations`, the class otherwise)."""
    return {name for name, p in inspect.signature(kernel.fn).parameters.items()
            if "constexpr" in str(p.annotation)}


def _spec(value, specialise: bool):
    """Triton's specialisation of one non-constexpr argument (runtime/jit.py, specialize_impl):
    a pointer by its 16-byte alignment, an int by == 1 and % 16 == 0; nothing where the kernel
    says do_not_specialize. Checked against Triton's own function where it has it."""
    if isinstance(value, torch.Tensor):
        ours = ("*" + str(value.dtype), ("D" if value.data_ptr() % 16 == 0 else "") if specialise else None)
    elif isinstance(value, bool) or isinstance(value, float):
        ours = (type(value).__name__, None)
    else:
        ty = "i32" if -2**31 <= value < 2**31 else "i64"
        ours = (ty, None) if not specialise else ("constexpr", 1) if value == 1 else \
            (ty, "D" if value % 16 == 0 else "")
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        return ours
    try:
        native = native_specialize_impl(BaseBackend, value, False, specialise, True)
    except TypeError:  # another Triton's signature: ours stands alone
        return ours
    assert native[1] == ours[1] or isinstance(value, (bool, float)), (value, native, ours)
    return ours


def compile_key(kernel, args, kwargs) -> tuple:
    """What Triton compiles a launch by: each argument's specialisation, the constexprs' values
    and the launch options (num_warps, ...)."""
    names = list(inspect.signature(kernel.fn).parameters)
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    fixed, const = _not_specialised(kernel), _constexprs(kernel)
    key = []
    for name in names:
        value = bound.get(name)
        if name in const or value is None:  # constexprs, or defaults
            key.append((name, value))
        else:
            key.append((name, _spec(value, name not in fixed)))
    return (kernel.fn.__name__, tuple(key), options)
