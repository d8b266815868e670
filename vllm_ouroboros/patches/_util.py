"""Patch helper: keep the original beside each override, refuse silently missing targets."""

from __future__ import annotations

import logging
from typing import Any, Callable

from vllm_ouroboros import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)


def require(obj: Any, *names: str) -> None:
    """Raise a clear error if vLLM lacks an attribute we hook (a vLLM version we do not know)."""
    from vllm_ouroboros.plugin import supported_vllm_range

    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        try:
            from vllm import __version__ as version
        except ImportError:  # a runner stand-in where vLLM is not installed (the GPU check)
            version = "(not installed)"
        raise RuntimeError(
            f"vllm-ouroboros cannot hook {getattr(obj, '__qualname__', obj)}.{', '.join(missing)}: "
            f"not present in vLLM {version}. Supported vLLM versions: "
            f"{supported_vllm_range()}."
        )


def patch_method(cls: type, name: str, make_override: Callable[[Callable], Callable]) -> None:
    """Replace `cls.name` by `make_override(original)`; idempotent."""
    require(cls, name)
    original = cls.__dict__.get(name, getattr(cls, name))
    # A staticmethod or classmethod wraps the override that carries the mark.
    if getattr(getattr(original, "__func__", original), "__ouroboros_original__", None) is not None:
        return
    # The class's own classmethod is a descriptor, not callable: the override gets its function
    # (called with the class it is called through first, as the method would be).
    kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
    override = make_override(original.__func__ if kind is classmethod else original)
    override.__ouroboros_original__ = original
    override.__name__ = getattr(original, "__name__", name)
    override.__doc__ = getattr(original, "__doc__", None)
    if kind is not None:
        override = kind(override)
    setattr(cls, name, override)
    logger.debug("vllm-ouroboros patched %s.%s", cls.__qualname__, name)


def require_params(fn: Callable, *names: str) -> None:
    """Raise a clear error if a vLLM function we wrap lacks a parameter the wrapper reads (the
    original where it is patched already)."""
    import inspect

    fn = getattr(fn, "__ouroboros_original__", None) or fn
    params = inspect.signature(fn).parameters
    missing = [n for n in names if n not in params]
    if missing:
        require(fn, *missing)  # names the function, the vLLM version and the supported ones
