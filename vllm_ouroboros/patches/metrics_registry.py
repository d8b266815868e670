"""The registry vLLM's /metrics serves gets the ouroboros collector too.

With one API server vLLM serves prometheus_client's default registry, where
metrics_export.register_collector puts the collector. With several (`--api-server-count`, which
data parallelism sets to its size by default) vLLM sets PROMETHEUS_MULTIPROC_DIR, and
`get_prometheus_registry` (v1/metrics/prometheus.py) builds a fresh registry holding only
prometheus_client's multiprocess collector: the ouroboros series were not served at all. The
wrapper adds a collector to every registry it builds; each API server reads the same counter
files, so any scrape sums the same engines.
"""

from __future__ import annotations

import sys
from typing import Callable

from vllm_ouroboros.patches._util import require

# The module that binds the name at import (`from ... import get_prometheus_registry`): it may
# be imported before the plugin registers.
_USERS = ("vllm.entrypoints.serve.instrumentator.metrics",)


def apply(make_collector: Callable[[], object]) -> None:
    """Wrap get_prometheus_registry (idempotent); make_collector() gives a collector for each
    registry it builds other than the default one."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics import prometheus

    require(prometheus, "get_prometheus_registry")
    original = prometheus.get_prometheus_registry
    if getattr(original, "__ouroboros_original__", None) is not None:
        return

    def get_prometheus_registry():
        registry = original()
        if registry is not REGISTRY:  # the default one has it (register_collector)
            registry.register(make_collector())
        return registry

    get_prometheus_registry.__ouroboros_original__ = original
    get_prometheus_registry.__doc__ = original.__doc__
    prometheus.get_prometheus_registry = get_prometheus_registry
    for name in _USERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "get_prometheus_registry", None) is original:
            module.get_prometheus_registry = get_prometheus_registry
