"""The phrase pool's insert and lookup in each form, side by side: torch (inserts with index_put_ or scatter_add_ adds) and the Triton kernels.

    python scripts/bench_pool_ops.py [--rows 16 256] [--vocab 151936] [--phrase-len 4] [--per-key 4]
        [--pages 4096] [--calls 100] [--device cuda|cpu] [--compile-only [SM ...]] [--launches]

(Named bench_pool_insert.py until 2026-11-27; the same flags.) PhrasePool.insert
(vllm_ouroboros/pool.py) is 159 launches in torch (`--launches`), seven of them adds at indices: CUDA runs
index_put_(accumulate=True) as a radix sort of the indices and then the add, scatter_add_ as one
kernel, so `pool.SCATTER_ADD_DEVICES` picks scatter on CUDA and index_put_ on a CPU, where it is
the faster. kernels/pool_insert.py does the whole insert in four kernels and a topk;
PhrasePool.lookup is 39 launches in torch, one kernel in kernels/pool_lookup.py
(`PhrasePool(kernels=...)`: "auto" takes the kernels on CUDA).

This times each form on one device, in one run, on the same rows: ms per call (eager, the median
of `--calls` calls timed one by one, as bench_gpu.time_calls times; on CUDA also replayed from a
CUDA graph, as the drafting round runs them), each form's time over torch's (scatter_add for
inserts), and checks that every form leaves the same pool (and, for lookups, returns the same
phrases). Lookups: n keys, half of them stored, into a pool filled by inserts of 4n rows.
The kernels are timed on CUDA only (on a CPU Triton's interpreter runs them, far slower than
anything real: they are checked for equality there, not timed). `--compile-only` compiles the
kernels for NVIDIA targets without a GPU (Triton's bundled ptxas) and prints registers and stack
(spills) per thread. `--launches` counts, per call and form, the ATen calls that are not views
or allocations and the Triton launches (what a GPU's host launches one by one outside a graph;
on a CPU the kernels need TRITON_INTERPRET=1 for this). Needs no vLLM.
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

INSERT_FORMS = ("index_put", "scatter_add", "triton")
LOOKUP_FORMS = ("torch", "triton")


def make_pool(a, device, form: str) -> PhrasePool:
    pool_module.SCATTER_ADD_DEVICES = {device.type} if form == "scatter_add" else set()
    return PhrasePool(a.vocab, a.phrase_len, a.per_key,
                      PhrasePool.budget_for(a.vocab, a.phrase_len, a.per_key, a.pages), device=device,
                      kernels="triton" if form == "triton" else "torch")


def compile_only(archs: list[int], L: int, W: int) -> int:
    """Compile the pool's kernels for NVIDIA targets (the launches' constants for phrase length
    L, W phrases per key, a 4-phrase lookup) and print registers / stack per thread; 1 if one fails."""
    import triton

    from vllm_ouroboros.kernels import pool_insert as pi
    from vllm_ouroboros.kernels import pool_lookup as pl
    from vllm_ouroboros.kernels.triton_runtime import compile_report, not_compilable_reason, signature_of

    if why := not_compilable_reason(pi.place_kernel):
        print(why)
        return 1
    types = dict(keys_ptr="*i64", phrases_ptr="*i64", valid_ptr="*i1", key_to_page_ptr="*i32", kept_ptr="*i32",
                 page_ptr="*i32", protect_ptr="*i8", rank_ptr="*i32", members_ptr="*i32", page_key_ptr="*i32",
                 page_last_used_ptr="*i64", score_ptr="*i64", owners_ptr="*i64", cand_ptr="*i64",
                 cand_score_ptr="*i64", tokens_ptr="*i32", stamp_ptr="*i64", owner_ptr="*i32", clock_ptr="*i64",
                 counters_ptr="*i64", NEVER="i64", OWN="i64", slots_ptr="*i64", rows_ptr="*i1", out_ptr="*i64")
    n = min(4, W)
    consts = dict(L=L, W=W, BLOCK_W=triton.next_power_of_2(W), HAS_VALID=True, HAS_ROWS=True, SHARED=True, OWNED=False, n=n,
                  BLOCK_N=triton.next_power_of_2(n), BLOCK_L=triton.next_power_of_2(L))
    launches = ((pi.rows_kernel, pi._ROWS, 4), (pi.groups_kernel, pi._ROWS, 4),
                (pi.page_scores_kernel, pi._PAGES, 4), (pi.place_kernel, pi._ROWS, 1), (pl.lookup_kernel, None, 1))
    rc = 0
    print(f"triton {triton.__version__}, L {L}, W {W}")
    for arch in archs:
        for kernel, block, warps in launches:
            sig = signature_of(kernel, types)
            cs = {p.name: consts.get(p.name, block) for p in kernel.params if p.is_constexpr}
            _, usage, failed = compile_report(kernel, sig, cs, dict(num_warps=warps), arch)
            rc |= failed
            print(f"sm_{arch} {kernel.fn.__name__} BLOCK={block or '-'} num_warps={warps}: {usage}")
    return rc


# ATen calls that launch nothing: views and allocations
_NO_LAUNCH = {"view", "expand", "slice", "select", "unsqueeze", "squeeze", "alias", "_unsafe_view", "t",
              "permute", "detach", "unbind", "scalar_tensor", "empty", "empty_like", "empty_strided"}


def launches(fn) -> tuple[int, int]:
    """(ATen calls that launch, Triton kernel launches) of one fn() call. A Triton launch is
    counted once and what runs inside it (the interpreter's own tensor calls) not at all."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from vllm_ouroboros.kernels import pool_insert as pi
    from vllm_ouroboros.kernels import pool_lookup as pl

    counts = {"aten": 0, "triton": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ not in _NO_LAUNCH:
                counts["aten"] += 1
            return func(*args, **(kwargs or {}))

    class Counted:  # a @triton.jit kernel whose launches are counted and run outside the count
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                counts["triton"] += 1
                with torch.utils._python_dispatch._disable_current_modes():
                    return self.kernel[grid](*args, **kwargs)
            return launch

    def pick(kernel, device, error, _pick=pi.pick_kernel):  # whether Triton runs the counted kernel
        ok, why = _pick(getattr(kernel, "kernel", kernel), device, error)
        return (kernel if ok is not None else None), why

    names = [(pi, n) for n in ("rows_kernel", "groups_kernel", "page_scores_kernel", "place_kernel",
                               "pick_kernel")] + [(pl, "lookup_kernel"), (pl, "pick_kernel")]
    saved = [(m, n, getattr(m, n)) for m, n in names]
    try:
        for m, n, k in saved:
            setattr(m, n, pick if n == "pick_kernel" else Counted(k))
        with Count():
            fn()
    finally:
        for m, n, k in saved:
            setattr(m, n, k)
    return counts["aten"], counts["triton"]


def count_section(a, device, why_not: str | None) -> None:
    """Launches per insert and per lookup of each row count, in torch and through the kernels."""
    print("| op | rows | form | ATen calls (launching) | Triton launches |")
    print("|---|---:|---|---:|---:|")
    for n in a.rows:
        g = torch.Generator(device).manual_seed(n)
        keys = torch.randint(0, a.vocab, (n,), generator=g, device=device)
        phrases = torch.randint(0, a.vocab, (n, a.phrase_len), generator=g, device=device)
        owners = torch.zeros(n, dtype=torch.long, device=device)
        valid = torch.ones(n, dtype=torch.bool, device=device)
        for form in ("torch", "triton"):
            if form == "triton" and why_not is not None:
                print(f"| - | {n} | triton | skipped: {why_not} | - |")
                continue
            pool = make_pool(a, device, "scatter_add" if form == "torch" else form)
            pool.insert(keys, phrases, owners, valid)  # pages taken: the counted insert is a steady one
            for op, fn in (("insert", lambda: pool.insert(keys, phrases, owners, valid)),
                           ("lookup", lambda: pool.lookup(keys, owners, a.per_key, valid))):
                aten, kern = launches(fn)
                print(f"| {op} | {n} | {form} | {aten} | {kern} |", flush=True)


def timed(fn, device, a, untimed: bool):
    """(eager ms, graph ms or None) of fn; untimed: the same number of calls, no times."""
    if untimed:  # as many calls as a timed form makes (time_calls: 3 warm-ups, then the calls)
        for _ in range(3 + a.calls):
            fn()
        return None, None
    eager = median(time_calls(fn, device, 3, a.calls))
    graph = None
    if device.type == "cuda":
        graph = median(time_calls(capture_graph(lambda _: fn(), device).replay, device, 3, a.calls))
    return eager, graph


def report(op: str, n: int, times: dict, same: dict, base: str) -> bool:
    cell = lambda t: "-" if t is None else f"{t:.3f}"  # noqa: E731
    for form, (eager, graph) in times.items():
        print(f"| {op} | {n} | {form} | {cell(eager)} | {cell(graph)} |", flush=True)
    es, gs = times[base]
    ratios = [f"{f} eager {e / es:.2f}x" + (f", graph {g / gs:.2f}x" if g else "")
              for f, (e, g) in times.items() if f != base and e is not None]
    print(f"{op} {n} rows: over {base}: {'; '.join(ratios) or '-'}; "
          f"equal: {all(same.values())} ({', '.join(same)})")
    return all(same.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--phrase-len", type=int, default=4)
    ap.add_argument("--per-key", type=int, default=4)
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile-only", type=int, nargs="*", metavar="SM",
                    help="compile the kernels for these NVIDIA archs (default 80 90) without a GPU")
    ap.add_argument("--launches", action="store_true",
                    help="count the launches per call of each form instead of timing them")
    a = ap.parse_args()
    print("# " + " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv))
    if a.compile_only is not None:
        return compile_only(a.compile_only or [80, 90], a.phrase_len, a.per_key)
    device = torch.device(a.device)
    from vllm_ouroboros.kernels import pool_insert as pi
    from vllm_ouroboros.kernels import pool_lookup as pl

    why_not = (pi.pick_kernel(pi.place_kernel, device, pi._TRITON_IMPORT_ERROR)[1]
               or pl.pick_kernel(pl.lookup_kernel, device, pl._TRITON_IMPORT_ERROR)[1])
    untimed = device.type != "cuda"
    print(f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
          f"vocab {a.vocab}, L {a.phrase_len}, W {a.per_key}, {a.pages} pages")
    if a.launches:
        count_section(a, device, why_not)
        return 0
    if why_not is not None:
        print(f"# the Triton kernels are skipped: {why_not}")
    elif untimed:
        print("# the Triton kernels run under the interpreter here: checked for the same results, not timed")
    print("| op | rows | form | eager ms / call | graph ms / call |")
    print("|---|---:|---|---:|---:|")
    saved, ok = pool_module.SCATTER_ADD_DEVICES, True
    state = lambda p: [getattr(p, b).clone() for b in pool_module._BUFFERS if b != "clock"]  # noqa: E731
    try:
        for n in a.rows:
            g = torch.Generator(device).manual_seed(n)
            keys = torch.randint(0, a.vocab, (n,), generator=g, device=device)
            phrases = torch.randint(0, a.vocab, (n, a.phrase_len), generator=g, device=device)
            owners = torch.zeros(n, dtype=torch.long, device=device)
            times, states = {}, {}
            for form in INSERT_FORMS:
                if form == "triton" and why_not is not None:
                    continue
                pool = make_pool(a, device, form)
                fn = lambda: pool.insert(keys, phrases, owners)  # noqa: E731
                fn()
                times[form] = timed(fn, device, a, untimed and form == "triton")
                states[form] = state(pool)
            ok &= report("insert", n, times, {f: all(map(torch.equal, states["scatter_add"], s))
                                              for f, s in states.items()}, "scatter_add")

            stored = torch.randint(0, a.vocab, (4 * n,), generator=g, device=device)
            fill = (stored, torch.randint(0, a.vocab, (4 * n, a.phrase_len), generator=g, device=device),
                    torch.randint(-1, 4, (4 * n,), generator=g, device=device))
            q = torch.where(torch.arange(n, device=device) % 2 == 0, stored[:n],
                            torch.randint(0, a.vocab, (n,), generator=g, device=device))
            slots = torch.randint(-1, 4, (n,), generator=g, device=device)
            times, states, outs = {}, {}, {}
            for form in LOOKUP_FORMS:
                if form == "triton" and why_not is not None:
                    continue
                pool = make_pool(a, device, form)
                pool.insert(*fill)
                fn = lambda: pool.lookup(q, slots, a.per_key)  # noqa: E731
                outs[form] = fn()
                times[form] = timed(fn, device, a, untimed and form == "triton")
                states[form] = state(pool)
            same = {f: all(map(torch.equal, states["torch"] + list(outs["torch"]), s + list(outs[f])))
                    for f, s in states.items()}
            ok &= report("lookup", n, times, same, "torch")
    finally:
        pool_module.SCATTER_ADD_DEVICES = saved
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
