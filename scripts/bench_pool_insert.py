"""A phrase pool insert three ways, side by side: torch with index_put_ adds, torch with scatter_add_ adds, the Triton kernels.

    python scripts/bench_pool_insert.py [--rows 16 256] [--vocab 151936] [--phrase-len 4] [--per-key 4]
        [--pages 4096] [--calls 100] [--device cuda|cpu] [--compile-only [SM ...]]

PhrasePool.insert (vllm_ouroboros/pool.py) is ~165 launches in torch, seven of them adds at
indices: CUDA runs index_put_(accumulate=True) as a radix sort of the indices and then the add,
scatter_add_ as one kernel, so `pool.SCATTER_ADD_DEVICES` picks scatter on CUDA and index_put_ on
a CPU, where it is the faster. kernels/pool_insert.py does the whole insert in four kernels and
a topk (`insert_kernel`: "auto" picks it on CUDA). This times each form on one device, in one
run, on the same rows: ms per insert (eager, the median of `--calls` inserts timed one by one, as
bench_gpu.time_calls times; on CUDA also replayed from a CUDA graph, which the drafting round
does), each form's time over torch-scatter's, and checks that every form leaves the same pool.
The kernels are timed on CUDA only (on a CPU Triton's interpreter runs them, far slower than
anything real: they are checked for equality there, not timed). `--compile-only` compiles the
kernels for NVIDIA targets without a GPU (Triton's bundled ptxas) and prints registers and stack
(spills) per thread. Needs no vLLM.
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

FORMS = ("index_put", "scatter_add", "triton")


def make_pool(a, device, form: str) -> PhrasePool:
    pool_module.SCATTER_ADD_DEVICES = {device.type} if form == "scatter_add" else set()
    return PhrasePool(a.vocab, a.phrase_len, a.per_key,
                      PhrasePool.budget_for(a.vocab, a.phrase_len, a.per_key, a.pages), device=device,
                      insert_kernel="triton" if form == "triton" else "torch")


def compile_only(archs: list[int], L: int, W: int) -> int:
    """Compile the four kernels for NVIDIA targets (the launch's constants for phrase length L,
    W phrases per key) and print registers / stack per thread; 1 if one fails."""
    import triton

    from vllm_ouroboros.kernels import pool_insert as pi
    from vllm_ouroboros.kernels.triton_runtime import compile_for_nvidia

    if not isinstance(pi.place_kernel, triton.JITFunction):
        print("TRITON_INTERPRET is set: unset it for --compile-only")
        return 1
    types = dict(keys_ptr="*i64", phrases_ptr="*i64", valid_ptr="*i1", key_to_page_ptr="*i32", kept_ptr="*i32",
                 page_ptr="*i32", protect_ptr="*i8", rank_ptr="*i32", members_ptr="*i32", page_key_ptr="*i32",
                 page_last_used_ptr="*i64", score_ptr="*i64", owners_ptr="*i64", cand_ptr="*i64",
                 cand_score_ptr="*i64", tokens_ptr="*i32", stamp_ptr="*i64", owner_ptr="*i32", clock_ptr="*i64",
                 counters_ptr="*i64", NEVER="i64")
    consts = dict(L=L, W=W, BLOCK_W=triton.next_power_of_2(W), HAS_VALID=True)
    launches = ((pi.rows_kernel, pi._ROWS, 4), (pi.groups_kernel, pi._ROWS, 4),
                (pi.page_scores_kernel, pi._PAGES, 4), (pi.place_kernel, pi._ROWS, 1))
    rc = 0
    print(f"triton {triton.__version__}, L {L}, W {W}")
    for arch in archs:
        for kernel, block, warps in launches:
            sig = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in kernel.params}
            cs = {p.name: consts.get(p.name, block) for p in kernel.params if p.is_constexpr}
            try:
                _, usage = compile_for_nvidia(kernel, sig, cs, dict(num_warps=warps), arch)
            except Exception as e:  # noqa: BLE001 - report every kernel
                usage, rc = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:100]}", 1
            print(f"sm_{arch} {kernel.fn.__name__} BLOCK={block} num_warps={warps}: {usage}")
    return rc


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
    a = ap.parse_args()
    print("# " + " ".join(shlex.quote(x) for x in [sys.executable] + sys.argv))
    if a.compile_only is not None:
        return compile_only(a.compile_only or [80, 90], a.phrase_len, a.per_key)
    device = torch.device(a.device)
    from vllm_ouroboros.kernels.pool_insert import _TRITON_IMPORT_ERROR, pick_kernel, place_kernel

    why_not = pick_kernel(place_kernel, device, _TRITON_IMPORT_ERROR)[1]
    time_kernel = device.type == "cuda"
    print(f"# {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}, torch {torch.__version__}, "
          f"vocab {a.vocab}, L {a.phrase_len}, W {a.per_key}, {a.pages} pages")
    if why_not is not None:
        print(f"# the Triton kernels are skipped: {why_not}")
    elif not time_kernel:
        print("# the Triton kernels run under the interpreter here: checked for the same pool, not timed")
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
            for form in FORMS:
                if form == "triton" and why_not is not None:
                    continue
                pool = make_pool(a, device, form)
                fn = lambda: pool.insert(keys, phrases, owners)  # noqa: E731
                fn()
                eager = graph = None
                if form != "triton" or time_kernel:
                    eager = median(time_calls(fn, device, 3, a.calls))
                    if device.type == "cuda":
                        graph = median(time_calls(capture_graph(lambda _: fn(), device).replay, device, 3, a.calls))
                else:  # as many inserts as the timed forms made (time_calls: 3 warm-ups, then the calls)
                    for _ in range(3 + a.calls):
                        fn()
                times[form] = (eager, graph)
                states[form] = [getattr(pool, b).clone() for b in pool_module._BUFFERS if b != "clock"]
                cell = lambda t: "-" if t is None else f"{t:.3f}"  # noqa: E731
                print(f"| {n} | {form} | {cell(eager)} | {cell(graph)} |", flush=True)
            same = {f: all(torch.equal(x, y) for x, y in zip(states["scatter_add"], s)) for f, s in states.items()}
            ok &= all(same.values())
            (es, gs) = times["scatter_add"]
            ratios = []
            for f, (e, gr) in times.items():
                if f != "scatter_add" and e is not None:
                    ratios.append(f"{f} eager {e / es:.2f}x" + (f", graph {gr / gs:.2f}x" if gr else ""))
            print(f"rows {n}: over scatter_add: {'; '.join(ratios)}; "
                  f"pools equal: {all(same.values())} ({', '.join(same)})")
    finally:
        pool_module.SCATTER_ADD_DEVICES = saved
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
