"""Seeded requests under speculation sample the tokens vLLM samples without it (seeded_sampling.py).

A bigram target (the logits after a token depend on that token alone) is decoded twice per seed:
plainly, one token and one draw of the request's generator a step, as vLLM's sampler does without
speculation; and speculatively, a tree a step (drafts partly right, partly wrong, K suffixes)
verified by verify.verify with the seeded requests' draws. The tokens must be the same, and the
generators end where the plain run leaves them. Three samplers stand for vLLM's: its own
TopKTopPSampler (on CPU a Gumbel argmax seeded by one randint draw), a native-style one (an
exponential row per draw) and one that draws a different amount per call.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

from conftest import DEVICE
from vllm_ouroboros.seeded_sampling import SeededDraws
from vllm_ouroboros.tree import build_tree
from vllm_ouroboros.verify import verify

V, D, K, L = 48, 4, 3, 3
TOP_K = 12


def exponential_sampler(x, generators, req):
    """vLLM's native random_sample after a top-k cut: an exponential row per seeded row."""
    x = x.masked_fill(x < x.topk(TOP_K, dim=-1).values[:, -1:], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    q = torch.empty_like(probs).exponential_()
    for i, g in generators.items():
        q[i].exponential_(generator=g)
    return probs.div_(q).argmax(dim=-1)


def seed_sampler(x, generators, req):
    """A sampler that draws a seed (one randint) per seeded row, then its own Gumbel noise: a
    draw whose size has nothing to do with the vocabulary."""
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    for i, g in generators.items():
        seed = int(torch.randint(0, 2**31, (1,), generator=g, device=g.device))
        noise = torch.rand(x.shape[1], generator=torch.Generator(x.device).manual_seed(seed), device=x.device)
        out[i] = (x[i] - torch.log(-torch.log(noise.clamp_min(1e-12)))).argmax()
    return out


def vllm_sampler():
    """vLLM's own top-k / top-p sampler (the platform's forward), top_k = TOP_K for every row."""
    pytest.importorskip("vllm", reason="vLLM's sampler is the reference; vLLM is not installed here")
    if DEVICE == "cpu":
        importlib.import_module("vllm._C")  # registers the CPU sampler's fused_gumbel_argmax op
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    s = TopKTopPSampler()

    def sample(x, generators, req):
        return s(x, generators, torch.full((x.shape[0],), TOP_K, dtype=torch.int64, device=x.device), None)[0]

    return sample


SAMPLERS = {"vllm": vllm_sampler, "exponential": lambda: exponential_sampler, "seed": lambda: seed_sampler}


def bigram(seed: int) -> torch.Tensor:
    """[V, V] logits after each token, peaked enough that drafts are often accepted."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    t = torch.randn(V, V, generator=g, device=DEVICE)
    t[torch.arange(V, device=DEVICE), torch.randint(0, V, (V,), generator=g, device=DEVICE)] += 3.0
    return t


TEMP = torch.tensor([0.8, 1.0, 0.6, 1.0], device=DEVICE)  # per request; request 3 is greedy


def prepare(x, req):
    return x.div_(TEMP[req][:, None])


def plain(table, sample, first: int, seed: int, temp_row: int, n: int) -> tuple[list[int], torch.Tensor]:
    """n tokens decoded one a step (one draw each); the generator's state after them."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    out, prev = [], first
    req = torch.tensor([temp_row], device=DEVICE)
    for _ in range(n):
        prev = int(sample(prepare(table[prev][None].clone(), req), {0: g}, req)[0])
        out.append(prev)
    return out, g.get_state()


def speculative(table, sample, firsts, seeds, want, n: int, rng, walk="torch", max_rows=64, draws=SeededDraws):
    """Requests 0..3 decoded a tree a step: 0 and 1 seeded (seeds), 2 sampled unseeded, 3
    greedy. Drafts follow `want` (the plain runs' tokens, a list per request; None: random) for
    a random length, then go wrong; suffixes are random or the continuation. Returns the tokens
    per request, the generators, the steps taken and the seeded requests' accepted tokens."""
    B = 4
    gens = {b: torch.Generator(DEVICE).manual_seed(s) for b, s in enumerate(seeds)}
    outs = [[] for _ in range(B)]
    last = list(firsts)
    steps = accepted = 0
    while min(len(o) for o in outs[:2]) < n:
        draft = np.zeros((B, D), np.int64)
        dlen = rng.integers(0, D + 1, B)
        suf = rng.integers(0, V, (B, K, L))
        slen = rng.integers(0, L + 1, (B, K))
        for b in range(B):
            ref = want[b][len(outs[b]):] if want[b] is not None else []
            good = rng.integers(0, D + L + 1)
            for i in range(D):
                draft[b, i] = ref[i] if i < min(good, len(ref)) else rng.integers(0, V)
            k = rng.integers(0, K)
            for j in range(L):
                if dlen[b] + j < len(ref) and rng.random() < 0.8:
                    suf[b, k, j] = ref[dlen[b] + j]
        tree = build_tree(*(torch.as_tensor(a, device=DEVICE) for a in (draft, dlen, suf, slen)))
        nodes = tree.tokens.cpu().numpy()
        rows = np.concatenate([np.array(last)[:, None], nodes], 1)  # each row's last token
        logits = table[torch.as_tensor(rows.reshape(-1), device=DEVICE)]
        greedy = torch.tensor([False, False, False, True], device=DEVICE)
        seeded = draws(gens, prepare, sample, max_rows)
        got = verify(tree, logits, np.arange(B) * (tree.N + 1), greedy,
                     lambda x, req: prepare(x, torch.arange(B, device=DEVICE) if req is None else req),
                     generator=torch.Generator(DEVICE).manual_seed(steps), walk=walk, seeded=seeded)
        res = got.result
        for b in range(B):
            toks = res.emitted[b, :res.num_emitted[b]].tolist()
            outs[b] += toks
            last[b] = toks[-1]
        accepted += int(res.num_accepted[:2].sum())
        steps += 1
    return outs, gens, steps, accepted


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("walk,max_rows", [("torch", 64), ("torch", 3), ("triton", 64)])
def test_seeded_requests_sample_the_tokens_of_plain_decoding(sampler, walk, max_rows):
    """Every seeded request's tokens are those of plain decoding with its seed, whatever the
    drafts, the other requests and the rows per sampler call (max_rows 3 splits a position's
    rows); its generator ends where plain decoding leaves it after the same tokens. Drafts were
    accepted (tokens came several a step), so the tree's rows past the root were sampled."""
    if walk == "triton" and DEVICE != "cuda":
        pytest.skip("the kernel walk runs on CUDA; on CPU verify(walk='triton') takes the torch walk, "
                    "which the other cases test")
    sample = SAMPLERS[sampler]()
    table, n = bigram(0), 40
    rng = np.random.default_rng(1)
    firsts, seeds = [3, 7, 11, 5], [11, 12]
    ref = [plain(table, sample, firsts[b], seeds[b], b, n + D + L + 1) for b in range(2)]
    outs, gens, steps, accepted = speculative(
        table, sample, firsts, seeds, [ref[0][0], ref[1][0], None, None], n, rng, walk, max_rows)
    print(f"{sampler}: {steps} steps, {accepted} drafted tokens accepted for the seeded requests")
    assert accepted >= 10 and steps < n
    for b in range(2):
        m = len(outs[b])
        assert outs[b] == ref[b][0][:m], f"seeded request {b} differs from plain decoding"
        _, state = plain(table, sample, firsts[b], seeds[b], b, m)
        assert torch.equal(gens[b].get_state(), state), f"request {b}'s generator is not where {m} draws leave it"
    # The greedy request followed the argmax.
    prev = firsts[3]
    for t in outs[3]:
        assert t == int(table[prev].argmax()), "the greedy request left the argmax"
        prev = t


class Unseeded(SeededDraws):
    """The seeded requests on the rejection walk with the global generator (as before)."""

    def choices(self, *args):
        return None


class SharedCopy(SeededDraws):
    """One generator copy per request and position, shared by its rows: the second row of a
    position takes the draw after."""

    def choices(self, tree, logits, rows, target_next):
        sample = self.sample

        def one_copy(x, copies, req):
            first = {}
            for i, b in enumerate(req.tolist()):
                copies[i] = first.setdefault(b, copies[i])
            return sample(x, copies, req)

        self.sample = one_copy
        try:
            return super().choices(tree, logits, rows, target_next)
        finally:
            self.sample = sample


class NotAdvanced(SeededDraws):
    """The generators left where they were before the step."""

    def advance(self, num_emitted):
        self._after = {}


@pytest.mark.parametrize("draws", [Unseeded, SharedCopy, NotAdvanced])
def test_the_seeded_run_fails_without_each_part(draws):
    """Negative controls: the same run without the seeded draws (the rejection walk), with one
    generator copy for a position's rows, or without moving the generators on, does not give
    plain decoding's tokens."""
    table, n = bigram(0), 40
    firsts, seeds = [3, 7, 11, 5], [11, 12]
    ref = [plain(table, exponential_sampler, firsts[b], seeds[b], b, n + D + L + 1)[0] for b in range(2)]
    outs, _, _, _ = speculative(table, exponential_sampler, firsts, seeds, [ref[0], ref[1], None, None], n,
                                np.random.default_rng(1), draws=draws)
    same = [outs[b] == ref[b][:len(outs[b])] for b in range(2)]
    assert not all(same), f"{draws.__name__}: the seeded requests still matched plain decoding"


@pytest.mark.parametrize("table", [True, False])
def test_other_requests_walk_as_without_seeded_ones(table):
    """The unseeded sampled and the greedy requests of a batch come out as they do with no
    request seeded (same uniforms), in the table form and row by row: the seeded requests' rows
    are left unprocessed, not anyone else's (tempting: a row mask off by a request)."""
    from vllm_ouroboros.accept import walk_steps

    g = torch.Generator(DEVICE).manual_seed(3)
    B = 6
    tree = build_tree(torch.randint(0, 3, (B, D), generator=g, device=DEVICE),
                      torch.randint(0, D + 1, (B,), generator=g, device=DEVICE),
                      torch.randint(0, 3, (B, K, L), generator=g, device=DEVICE),
                      torch.randint(0, L + 1, (B, K), generator=g, device=DEVICE))
    logits = torch.randn(B * (tree.N + 1), V, generator=g, device=DEVICE)
    logits[:, :3] += 3.0
    temp = torch.tensor([0.7, 1.0, 1.3, 0.5, 1.0, 0.9], device=DEVICE)
    greedy = torch.tensor([False, False, False, True, False, False], device=DEVICE)
    u = torch.rand(B, walk_steps(tree), K + 1, generator=g, device=DEVICE, dtype=torch.float64)
    calls = []

    def process(x, req):
        calls.append(x.shape[0])
        x.div_((temp if req is None else temp[req])[:, None])
        return x.masked_fill_(x < x.topk(TOP_K, dim=-1).values[:, -1:], float("-inf"))

    rows = B * (tree.N + 1) if table else 0
    plain_run = verify(tree, logits, np.arange(B) * (tree.N + 1), greedy, process, uniforms=u,
                       max_table_rows=rows).result
    gens = {1: torch.Generator(DEVICE).manual_seed(1), 4: torch.Generator(DEVICE).manual_seed(4)}
    calls.clear()
    seeded = SeededDraws(gens, lambda x, req: x.div_(temp[req][:, None]), exponential_sampler, 64)
    mixed = verify(tree, logits, np.arange(B) * (tree.N + 1), greedy, process, uniforms=u,
                   max_table_rows=rows, seeded=seeded).result
    for b in (0, 2, 3, 5):
        assert mixed.emitted[b].tolist() == plain_run.emitted[b].tolist(), f"request {b} changed"
    # Only the four other requests' rows were processed (all at once, or one per request a step).
    assert calls and all(n == (4 * (tree.N + 1) if table else 4) for n in calls), calls
