"""Every registry vLLM's /metrics serves gets the ouroboros collector too.

With one API server vLLM serves prometheus_client's default registry, where
metrics_export.register_collector puts the collector. With several (`--api-server-count`, which
data parallelism sets to its size by default) vLLM sets PROMETHEUS_MULTIPROC_DIR, and each
registry it serves is a fresh one holding only prometheus_client's multiprocess collector: the
one `get_prometheus_registry` (v1/metrics/prometheus.py) builds for the `/metrics/` mount, and
the one the Instrumentator's `/metrics` route (attach_router,
entrypoints/serve/instrumentator/metrics.py) builds at every scrape. The ouroboros series were
in neither. Both are built by `MultiProcessCollector(registry)`, so its constructor (wrapped)
adds the collector to the registry it joins. One collector object serves them all: its memory
of exited writers (metrics_export.read_totals) must outlive each scrape's registry. Every API
server reads the same counter files, so any scrape sums the same engines.
"""

from __future__ import annotations

from vllm_ouroboros.patches._util import patch_method, require_params


def apply(collector: object) -> None:
    """Wrap MultiProcessCollector's constructor (idempotent): each registry it joins, other than
    the default one (which has `collector` already), gets `collector` too."""
    from prometheus_client import REGISTRY, multiprocess

    cls = multiprocess.MultiProcessCollector
    require_params(cls.__init__, "registry")

    def make_override(original):
        def init(self, registry, *args, **kwargs):
            original(self, registry, *args, **kwargs)
            if registry is not None and registry is not REGISTRY:
                try:
                    registry.register(collector)
                except ValueError:  # a second multiprocess collector in one registry: it has ours
                    pass

        return init

    patch_method(cls, "__init__", make_override)
