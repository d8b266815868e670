"""A phrase pool insert, its adds at indices as index_put_ (accumulate) and as scatter_add_, side by side.

    python scripts/bench_pool_insert.py [--rows 16 256] [--vocab 151936] [--phrase-len 4] [--per-key 4]
        [--pages 4096] [--calls 100] [--device cuda|cpu]

PhrasePool.insert adds to its tables at indices seven times a call (vllm_ouroboros/pool.py). CUDA
runs index_put_(accumulate=True) as a radix sort of the indices and then the add; scatter_add_
is one kernel. `pool.SCATTER_ADD_DEVICES` picks the form per device (scatter on CUDA, index_put_
on a CPU, where it is the faster). This times both on one device, in one run, on the same rows:
ms per insert (eager, the median of `--calls` inserts timed one by one, as bench_gpu.time_calls
times; on CUDA also replayed from a CUDA graph, which the drafting round does), the ratio scatter / index_put, and checks
that both forms leave the pools equal. Needs no vLLM.
"""

from __future__ import annotations

import argparse
import shlex
import sys

import torch
from bench_gpu import median, time_calls  # the benchmarks' one timer (scripts/ is on sys.path)

from vllm_ouroboros import pool as pool_module
from vllm_ouroboros.cuda_graph import capture_graph
from vllm_ouroboros.pool import PhrasePool


def make_pool(a, device, form: str) -> PhrasePool:
    pool_module.SCATTER_ADD_DEVICES = {device.type} if form == "scatter_add" else set()
    return PhrasePool(a.vocab, a.phrase_len, a.per_key,
                      PhrasePool.budget_for(a.vocab, a.phrase_len, a.per_key, a.pages), device=device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--phrase-len", type=int, default=4)
    ap.add_argument("--per-key", type=int, default=4)
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    device = torch.device(a.device)
    print("# " + " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv))
    print(f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
          f"vocab {a.vocab}, L {a.phrase_len}, W {a.per_key}, {a.pages} pages")
    print("| rows | form | eager ms / insert | graph ms / insert |")
    print("|---:|---|---:|---:|")
    saved, ok = pool_module.SCATTER_ADD_DEVICES, True
    try:
        for n in a.rows:
            g = torch.Generator(device).manual_seed(n)
            keys = torch.randint(0, a.vocab, (n,), generator=g, device=device)
            phrases = torch.randint(0, a.vocab, (n, a.phrase_len), generator=g, device=device)
            owners = torch.zeros(n, dtype=torch.long, device=device)
            times, states = {}, {}
            for form in ("index_put", "scatter_add"):
                pool = make_pool(a, device, form)
                fn = lambda: pool.insert(keys, phrases, owners)  # noqa: E731
                fn()
                eager = median(time_calls(fn, device, 3, a.calls))
                graph = None
                if device.type == "cuda":
                    graph = median(time_calls(capture_graph(lambda _: fn(), device).replay, device, 3, a.calls))
                times[form] = (eager, graph)
                states[form] = [getattr(pool, b).clone() for b in pool_module._BUFFERS if b != "clock"]
                print(f"| {n} | {form} | {eager:.3f} | {'-' if graph is None else f'{graph:.3f}'} |", flush=True)
            same = all(torch.equal(x, y) for x, y in zip(states["index_put"], states["scatter_add"]))
            ok &= same
            (ei, gi), (es, gs) = times["index_put"], times["scatter_add"]
            ratio = f"eager {es / ei:.2f}x" + (f", graph {gs / gi:.2f}x" if gi else "")
            print(f"rows {n}: scatter_add / index_put: {ratio}; pools equal: {same}")
    finally:
        pool_module.SCATTER_ADD_DEVICES = saved
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
