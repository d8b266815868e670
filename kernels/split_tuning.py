"""Where the tree-attention kernel cuts a prefix into splits, measured on the device that serves it.

`tree_attention.choose_num_splits` splits a request's prefix (flash-decoding) when the single-pass
grid leaves SMs idle. Two of its thresholds are a GPU's to say, not a formula's: below how many
prefix tokens a split is not worth the merge's launch and the partial states (`min_prefix`), and
the shortest chunk one program may get (`min_chunk`). The shipped values (1024 and 256 tokens)
are guesses. On an H200, one request's 16-node tree over a 512-token prefix took 13.6 us in a
single pass, replayed from a CUDA graph. The same tree over a 2048-token prefix, cut into eight
splits, took 12.8 us (results/gpu_h200_2026-11-28/bench_gpu.md). So the kernel's fixed latency,
not its key tiles, bounds the short prefixes, and their splits were never tried. The answer also
differs between a call replayed from a graph (device time alone: the draft's forwards) and one
launched eagerly (the target's attention between vLLM's piecewise graphs, where the merge's
second launch also costs host time).

`measure_split_rule` times a single request, where the fewest programs run and a split matters
most. At each prefix of 128..2048 tokens it times the single pass against the split the
heuristic picks under each candidate `min_chunk`. `rule_from_timings` turns these times into a
SplitRule. `tune_splits` measures both launch modes and registers both rules
(`tree_attention.register_split_rule`), so every later plan for those shapes on that device
splits by them. A plan made while a CUDA graph is captured takes the graph rule.
Where nothing was measured (a CPU, the interpreter, a failed measurement) the shipped
thresholds hold.

Called where the kernel is checked before serving: the draft model's load (draft/model.py) and
the target's attention patch (patches/tree_attention.py).

A known bias, left for a GPU to size: the measured calls read the same few scratch pages again
and again, so on a GPU their keys come from L2, where a serving forward's come from HBM (the
weights streamed through since the last forward evicted them). A split pays by spreading those
reads over more SMs, so here it is measured at its least, and the rule errs toward the single
pass (a later min_prefix), never toward a wrong result.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence

import torch

from .tree_attention import (MAX_SPLITS, SplitKey, SplitRule, TreeAttentionPlan, _launch_plan, _num_sms,
                             ancestor_bitmask, choose_num_splits, register_split_rule,
                             registered_split_rule)

logger = logging.getLogger("vllm.ouroboros")

PREFIXES = (128, 256, 512, 1024, 2048)  # tokens; the H200's worst kernel rows had 512
CHUNKS = (64, 128, 256)  # candidate min_chunk, tokens
# A split is priced at 1 / (1 - MARGIN) of its measured time: it must save this fraction of the
# single pass's to be chosen (a tie keeps the one launch; timing noise does not tip it).
MARGIN = 0.03

# timer(run, (nodes, prefix, S)) -> seconds per call of run
Timer = Callable[[Callable[[], object], tuple[int, int, int]], float]


def rule_from_timings(times: dict[tuple[int, int, int], float],
                      splits: dict[tuple[int, int, int], int],
                      nodes: Sequence[int], prefixes: Sequence[int], chunks: Sequence[int],
                      measured: str = "") -> SplitRule:
    """The SplitRule these timings call for.

    times {(nodes, prefix, S): seconds per call} holds S = 1 and every S in `splits`;
    splits {(nodes, prefix, min_chunk): the S choose_num_splits picks with that chunk floor and
    no prefix floor}. Every pair (min_chunk among `chunks`, min_prefix among `prefixes` and
    twice the longest) is priced as the measured calls would run under it: the single pass below
    min_prefix, the chunk's split from there on, every tree size and prefix summed, each split
    charged 1 / (1 - MARGIN) of its time so that it must save MARGIN to be chosen. The cheapest
    pair wins; ties go to the later start, then the longer chunk (fewer launches, fewer
    partials). Twice the longest prefix means no measured prefix gained: splits start past
    them, where nothing was measured."""
    def single(p: int) -> float:
        return sum(times[n, p, 1] for n in nodes)

    def split(p: int, chunk: int) -> float:
        return sum(times[n, p, splits[n, p, chunk]] for n in nodes) / (1 - MARGIN)

    ps = sorted(prefixes)
    starts = ps + [2 * ps[-1]]
    best = min(((sum(single(p) if p < m else split(p, c) for p in ps), -m, -c) for m in starts for c in chunks))
    return SplitRule(min_prefix=-best[1], min_chunk=-best[2], measured=measured)


def _graph_timer(calls: int = 10, rounds: int = 3) -> Timer:
    from vllm_ouroboros.cuda_graph import time_graph_ms

    return lambda run, _label: time_graph_ms(run, calls, rounds) / 1e3


def _eager_timer(calls: int = 10, rounds: int = 3) -> Timer:
    from vllm_ouroboros.cuda_graph import time_calls_ms

    # The merge's second launch costs host time too: back-to-back launches show it.
    return lambda run, _label: time_calls_ms(run, 2, calls, rounds) / 1e3


def measure_split_rule(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                       nodes: Sequence[int] = (16,), graphed: bool = True, timer: Timer | None = None,
                       prefixes: Sequence[int] = PREFIXES, chunks: Sequence[int] = CHUNKS,
                       seed: int = 0) -> tuple[SplitRule, dict]:
    """Time one request's tree attention at each prefix and tree size, single pass against the
    splits each candidate chunk floor gives, and return (the SplitRule, {"times": {(nodes,
    prefix, S): seconds}, "splits": {(nodes, prefix, chunk): S}}).

    Shape: k_cache, v_cache [num_blocks, block_size, Hkv, D], the serving caches' dtype, layout
        and device, filled with any values (only read; every logical page of the measured
        prefixes maps onto these few blocks, so a check's scratch suffices).
    nodes: tree sizes to time (each <= 64; the rule serves all of them: times are summed).
    graphed: time replays of a CUDA graph (device time), else eager back-to-back launches.
    timer(run, (nodes, prefix, S)) -> seconds per call: default CUDA events (graph replays or
    eager calls); tests give their own. Raises what the kernel or the timer raises."""
    device = k_cache.device
    if timer is None:
        if device.type != "cuda":
            raise ValueError(f"measuring splits needs CUDA (or a timer), got {device}")
        timer = _graph_timer() if graphed else _eager_timer()
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():  # the timers' device
        times, splits = _measure(k_cache, v_cache, num_heads, nodes, prefixes, chunks, timer, seed)
    how = (f"{'graph-replayed' if graphed else 'eager'}, 1 request, trees of {'/'.join(map(str, nodes))}"
           f" nodes, prefixes {prefixes[0]}..{prefixes[-1]}")
    return rule_from_timings(times, splits, nodes, prefixes, chunks, how), {"times": times, "splits": splits}


def _measure(k_cache, v_cache, num_heads, nodes, prefixes, chunks, timer, seed) -> tuple[dict, dict]:
    """measure_split_rule's (times, splits)."""
    device, dtype = k_cache.device, k_cache.dtype
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    gen = torch.Generator().manual_seed(seed)
    times, splits = {}, {}
    for n in nodes:
        q = torch.randn(n, num_heads, head_dim, generator=gen).to(device, dtype)
        mask = ancestor_bitmask(torch.arange(-1, n - 1).view(1, n), torch.tensor([n])).to(device)
        out = torch.empty_like(q)
        for p in prefixes:
            pages = -(-(p + n) // block_size)
            meta = (torch.arange(pages, dtype=torch.int32).remainder(num_blocks).view(1, pages).to(device),
                    torch.tensor([p], dtype=torch.int32, device=device),
                    torch.tensor([0, n], dtype=torch.int32, device=device), mask)
            cfg, num_q_blocks, _ = _launch_plan(dtype, num_heads, num_kv_heads, head_dim, 1, n, p, device, 1,
                                                None, block_size)
            for chunk in chunks:
                splits[n, p, chunk] = choose_num_splits(1, num_kv_heads, num_q_blocks, _num_sms(device), p,
                                                        cfg["BLOCK_N"], MAX_SPLITS, 0, chunk)
            for s in sorted({1, *(splits[n, p, c] for c in chunks)}):
                plan = TreeAttentionPlan(q, k_cache, v_cache, *meta, head_dim ** -0.5, max_query_len=n,
                                         backend="triton", num_splits=s, max_prefix_len=p)
                times[n, p, s] = timer(lambda plan=plan: plan.run(q, k_cache, v_cache, out), (n, p, s))
    return times, splits


def describe(rule: SplitRule, found: dict, nodes: Sequence[int]) -> str:
    """One log line: the rule, and at each measured prefix the single pass against the rule's
    split (us per call, tree sizes summed)."""
    def us(p, s_of):
        return sum(found["times"][n, p, s_of(n)] for n in nodes) * 1e6

    prefixes = sorted({p for _, p, _ in found["times"]})
    pts = ", ".join(f"{p}: {us(p, lambda n: 1):.1f} vs {us(p, lambda n, p=p: found['splits'][n, p, rule.min_chunk]):.1f}"
                    for p in prefixes)
    return (f"splits from {rule.min_prefix} prefix tokens, chunks of >= {rule.min_chunk} ({rule.measured}; "
            f"single pass vs split, us: {pts})")


def tune_splits(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, nodes: Sequence[int] = (16,),
                modes: Sequence[bool] = (True, False), timer: Timer | None = None,
                prefixes: Sequence[int] = PREFIXES, chunks: Sequence[int] = CHUNKS) -> dict[bool, SplitRule]:
    """Measure and register the SplitRule of these caches' shapes on their device for each
    launch mode in `modes` (True: graph-replayed, False: eager); {mode: rule} of those measured
    or registered before. A key measured once in the process is not measured again (the draft
    is checked again where its fusions are chosen; a target checks each distinct layer shape):
    every measurement captures graphs and compiles split variants. A mode whose measurement
    fails keeps the shipped thresholds, logged: a slower split, never a wrong result. Only on
    CUDA, or with a `timer` (tests): elsewhere nothing is measured."""
    device = k_cache.device
    if device.type != "cuda" and timer is None:
        return {}
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    rules = {}
    for graphed in modes:
        key = SplitKey(str(device), k_cache.dtype, num_heads, num_kv_heads, head_dim, block_size, graphed)
        known = registered_split_rule(key)
        if known is not None:
            rules[graphed] = known
            continue
        try:
            rule, found = measure_split_rule(k_cache, v_cache, num_heads, nodes, graphed, timer, prefixes, chunks)
        except Exception as e:  # noqa: BLE001 - the shipped thresholds still serve
            logger.warning("ouroboros: tree attention's splits on %s (%s) stay at the shipped thresholds: "
                           "measuring them failed: %s: %s", device, key, type(e).__name__, e)
            if device.type == "cuda":
                # A failed capture can leave the error for the next sync: it must not escape here.
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(device)
            continue
        register_split_rule(key, rule)
        rules[graphed] = rule
        logger.info("ouroboros: tree attention on %s (%s, %d/%d heads, D %d, pages of %d): %s", device,
                    str(k_cache.dtype).removeprefix("torch."), num_heads, num_kv_heads, head_dim, block_size,
                    describe(rule, found, nodes))
    return rules
