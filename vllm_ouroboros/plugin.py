"""vLLM general plugin entry point: `register()` runs in every vLLM process.

It checks the installed vLLM against the supported range declared in setup.py (read back from
this package's metadata, so the range lives in one place), then applies the patches. Calling it
twice is harmless. `OUROBOROS_DISABLE=1` turns the plugin off (no variable of ours starts with
`VLLM_`: vLLM warns about every such name it does not know, and refuses to start with them under
`--fail-on-environ-validation`; the old `VLLM_OUROBOROS_DISABLE` still works).
"""

from __future__ import annotations

import logging
import os

from vllm_ouroboros import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

_registered = False

# Used when the package runs from a source tree without installed metadata.
_FALLBACK_RANGE = ">=0.32.0,<0.34"


def supported_vllm_range() -> str:
    """The vLLM version specifier this build supports, e.g. '>=0.32.0,<0.34'."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        for line in metadata.requires("vllm-ouroboros") or []:
            req = Requirement(line)
            if req.name == "vllm" and req.marker is None:
                return str(req.specifier)
    except metadata.PackageNotFoundError:
        pass
    return _FALLBACK_RANGE


def check_vllm_version(version: str | None = None) -> str:
    """Raise RuntimeError unless `version` (default: installed vLLM) is in the supported range."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    if version is None:
        import vllm

        version = vllm.__version__
    spec = SpecifierSet(supported_vllm_range())
    # Local builds such as 0.32.0+cpu count as their public version; a nightly or release
    # candidate in the range (0.32.1.dev3) is in it whatever packaging's default on those.
    try:
        ok = spec.contains(Version(Version(version).public), prereleases=True)
    except InvalidVersion:  # a source build's "dev"
        ok = False
    if not ok:
        raise RuntimeError(
            f"vllm-ouroboros supports vLLM {spec} (tested: 0.32.0 CPU build); "
            f"found vLLM {version}. Install a supported vLLM or set OUROBOROS_DISABLE=1."
        )
    return version


def register() -> None:
    """Check the vLLM version and apply all patches (idempotent)."""
    global _registered
    if _registered:
        return
    disabled = [n for n in ("OUROBOROS_DISABLE", "VLLM_OUROBOROS_DISABLE") if os.environ.get(n, "0") == "1"]
    if disabled:
        logger.info("vllm-ouroboros disabled by %s=1", disabled[0])
        _registered = True
        return
    check_vllm_version()
    from vllm_ouroboros import metrics_export
    from vllm_ouroboros.patches import apply_all

    apply_all()
    # Before engine processes are spawned, so they inherit the metrics directory.
    metrics_export.register_collector()
    from vllm_ouroboros.patches import metrics_registry

    metrics_registry.apply(metrics_export.process_collector())
    _registered = True
