"""Acceptance walk over the token tree (accept.py): greedy on hand-made trees, lossless sampling
by a chi-square test against the exact target distribution, and negative controls showing that
the same test fails wrong samplers.

Row convention: target_next / probs row 0 = after the root, row 1 + i = after tree node i.
"""

import random
import zlib

import numpy as np
import pytest
import torch

from conftest import DEVICE
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from vllm_ouroboros.accept import accept_greedy, accept_sampled, walk_steps
from vllm_ouroboros.tree import build_tree

T = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731


def gen(seed):
    """A seeded generator on the device accept_sampled draws its uniforms on."""
    return torch.Generator(DEVICE).manual_seed(seed)


def one_tree(draft, suffixes, D=None, L=None):
    """A one-row tree from Python lists (suffixes ragged)."""
    D = len(draft) if D is None else D
    L = max([len(s) for s in suffixes] + [1]) if L is None else L
    d = T([draft + [0] * (D - len(draft))])
    s = T([[x + [0] * (L - len(x)) for x in suffixes]]).view(1, len(suffixes), L)
    return build_tree(d, T([len(draft)]), s, T([[len(x) for x in suffixes]]))


def emitted(res, b=0):
    return res.emitted[b, :res.num_emitted[b]].tolist()


# ---- greedy ----------------------------------------------------------------------------------

# Shared tree: draft [5, 6, 7]; suffixes s0 = [1, 2], s1 = [3, 4], s2 = [8, 9].
# Nodes: 0:5 1:6 2:7 | 3:1 4:2 | 5:3 6:4 | 7:8 8:9
TREE = dict(draft=[5, 6, 7], suffixes=[[1, 2], [3, 4], [8, 9]])


def greedy(target_next, tree=None):
    tree = tree or one_tree(**TREE)
    return accept_greedy(tree, T([target_next]))


def test_greedy_rejects_mid_draft_and_ignores_suffixes():
    #            root  n0  n1  n2  n3  n4  n5  n6  n7  n8
    tn = [5, 42, 7, 8, 2, 0, 4, 0, 9, 0]  # 6 rejected (target says 42)
    res = greedy(tn)
    # Suffix 2 "matches" the target after node 2 (8, 9), but the draft was cut at node 1:
    # the suffixes hang off node 2 and are void (tempting: [5, 42] + [8, 9] or [5, 7, 8, 9]).
    assert emitted(res) == [5, 42]
    assert res.num_accepted.tolist() == [1] and res.draft_accepted.tolist() == [1]
    assert res.suffix_index.tolist() == [-1] and res.suffix_accepted.tolist() == [0]
    assert res.accepted_nodes[0].tolist() == [0] + [-1] * 8


def test_greedy_full_draft_then_suffix_2_fully_matched_emits_bonus():
    #            root  n0  n1  n2  n3  n4  n5  n6  n7  n8
    tn = [5, 6, 7, 8, 0, 0, 0, 0, 9, 77]
    res = greedy(tn)
    # Draft 5 6 7, suffix 2 (8 9) all right, then the target's token after node 8: 77.
    # Tempting wrong answers: [5, 6, 7, 8, 9] (reference code: no bonus after a full suffix);
    # [5, 6, 7, 8] + correction from suffix 0 (always taking suffix 0: 1 != 8).
    assert emitted(res) == [5, 6, 7, 8, 9, 77]
    assert res.num_emitted.tolist() == [6]
    assert res.accepted_nodes[0, :5].tolist() == [0, 1, 2, 7, 8]
    assert res.suffix_index.tolist() == [2] and res.suffix_accepted.tolist() == [2]
    # KV: accepted token j goes to slot j; suffix 2's nodes 7, 8 move to slots 3, 4.
    assert res.kv_keep_src[0].tolist() == [0, 1, 2, 7, 8, -1, -1, -1, -1]


def test_greedy_full_draft_no_suffix_match_gives_target_token():
    tn = [5, 6, 7, 11, 0, 0, 0, 0, 0, 0]
    res = greedy(tn)
    assert emitted(res) == [5, 6, 7, 11]
    assert res.suffix_index.tolist() == [-1]


def test_greedy_longest_suffix_wins_and_ties_go_to_lowest_k():
    tree = one_tree([5], [[1, 2, 3], [1, 2, 4], [1, 9, 9], [1, 2, 4]])
    # Nodes: 0:5 | 1:1 2:2 3:3 | 4:1 5:2 6:4 | 7:1 8:9 9:9 | 10:1 11:2 12:4
    tn = [0] * 14
    tn[0], tn[1] = 5, 1          # after root: 5; after draft: 1 (all heads right)
    tn[2], tn[5], tn[8], tn[11] = 2, 2, 2, 2  # after each head: 2 (suffix 2 fails here)
    tn[3], tn[6], tn[12] = 4, 4, 4  # after "1 2": 4 (suffix 0 fails; 1 and 3 tie with 3 hits)
    tn[7], tn[13] = 60, 61  # bonus after suffix 1's / suffix 3's last node
    res = accept_greedy(tree, T([tn]))
    # Suffix 1 and 3 both match fully; the tie goes to k = 1 (tempting: suffix 0, first listed,
    # or the last best). Bonus from node 6: 60.
    assert emitted(res) == [5, 1, 2, 4, 60]
    assert res.suffix_index.tolist() == [1]
    assert res.kv_keep_src[0, :4].tolist() == [0, 4, 5, 6]


def test_greedy_without_draft_suffix_from_root():
    tree = one_tree([], [[3, 4], [3, 8]], D=2)
    # Nodes: 0:3 1:4 | 2:3 3:8
    tn = [3, 7, 0, 8, 50]
    res = accept_greedy(tree, T([tn]))
    assert emitted(res) == [3, 8, 50]
    assert res.draft_accepted.tolist() == [0] and res.suffix_index.tolist() == [1]
    assert res.kv_keep_src[0, :2].tolist() == [2, 3]
    # Nothing matches: the target's token after the root only.
    res = accept_greedy(tree, T([[9, 0, 0, 0, 0]]))
    assert emitted(res) == [9] and res.accepted_nodes[0].tolist() == [-1] * 6


def ref_greedy(draft, suffixes, target_at):
    """Python reference; target_at(path_tokens) = the target's token after that context."""
    out = []
    for x in draft:
        if target_at(out) != x:
            return out + [target_at(out)], None
        out.append(x)
    best, best_h = None, 0
    for k, s in enumerate(suffixes):
        h = 0
        while h < len(s) and target_at(out + s[:h]) == s[h]:
            h += 1
        if h > best_h:
            best, best_h = k, h
    acc = out + (suffixes[best][:best_h] if best is not None else [])
    return acc + [target_at(acc)], best


def random_batch(seed, B=64, D=4, K=3, L=3, V=3):
    """Random ragged trees over a tiny vocabulary (many matches and duplicate siblings) and a
    target given as a function of the context, so duplicate nodes see the same prediction."""
    rnd = random.Random(seed)
    drafts, sufs = [], []
    for _ in range(B):
        drafts.append([rnd.randrange(V) for _ in range(rnd.randint(0, D))])
        sufs.append([[rnd.randrange(V) for _ in range(rnd.choice([0, 1, L, L]))] for _ in range(K)])
    d = T([x + [0] * (D - len(x)) for x in drafts])
    s = T([[x + [0] * (L - len(x)) for x in ss] for ss in sufs])
    tree = build_tree(d, T([len(x) for x in drafts]), s, T([[len(x) for x in ss] for ss in sufs]))

    def target_at(ctx, b):
        # Agrees with the draft two times in three, so full drafts and suffix walks occur.
        h = zlib.crc32(bytes([seed % 256, b % 256, len(ctx)] + ctx))
        if len(ctx) < len(drafts[b]) and h % 3:
            return drafts[b][len(ctx)]
        return (h >> 4) % V

    node_ctx = []  # per row: context of the root and of each node
    for b in range(B):
        par, tok = tree.parents[b].tolist(), tree.tokens[b].tolist()
        ctxs = [[]]
        for i in range(tree.N):
            path, j = [], i
            while j != -1:
                path.append(tok[j])
                j = par[j]
            ctxs.append(path[::-1])
        node_ctx.append(ctxs)
    tn = T([[target_at(c, b) for c in node_ctx[b]] for b in range(B)])
    return tree, tn, drafts, sufs, target_at


def test_greedy_random_ragged_batch_matches_reference():
    for seed in range(3):
        tree, tn, drafts, sufs, target_at = random_batch(seed)
        res = accept_greedy(tree, tn)
        for b in range(tree.B):
            exp, best = ref_greedy(drafts[b], sufs[b], lambda c: target_at(c, b))
            assert emitted(res, b) == exp, (seed, b)
            n = len(drafts[b])
            if int(res.suffix_accepted[b]):
                assert int(res.suffix_index[b]) == best
            # KV sources: identity on the draft, then the chosen suffix's own nodes.
            src = res.kv_keep_src[b, :res.num_accepted[b]].tolist()
            assert src[:min(n, len(src))] == list(range(min(n, len(src))))
            assert [int(tree.tokens[b, i]) for i in src] == exp[:-1]
            assert all(int(tree.depth[b, i]) == j + 1 for j, i in enumerate(src))


def test_sampled_with_one_hot_target_equals_greedy():
    # One-hot target distributions: sampling must reproduce greedy exactly, including the trie
    # walk over duplicate suffix heads (a head equal to an earlier one must not cut it short).
    for seed in range(3):
        tree, tn, *_ = random_batch(seed)
        probs = torch.nn.functional.one_hot(tn, 3).float()
        g = accept_greedy(tree, tn)
        s = accept_sampled(tree, probs, gen(seed))
        for f in ("accepted_nodes", "emitted", "num_emitted", "kv_keep_src", "suffix_index"):
            assert np.array_equal(getattr(g, f), getattr(s, f)), f


def test_sampled_duplicate_head_continues_on_the_later_suffix():
    tree = one_tree([5], [[1, 2], [1, 3]])  # nodes 0:5 | 1:1 2:2 | 3:1 4:3
    tn = T([[5, 1, 3, 0, 3, 70]])  # after "5 1" the target says 3: only suffix 1 continues
    probs = torch.nn.functional.one_hot(tn, 80).float()
    res = accept_sampled(tree, probs, gen(0))
    # Tempting: [5, 1, 3] + stop (walking suffix 0 only after accepting its head 1).
    assert emitted(res) == [5, 1, 3, 70]
    assert res.kv_keep_src[0, :3].tolist() == [0, 3, 4]


def test_sampled_never_emits_zero_probability_tokens():
    B = 4000
    tree = build_tree(T([[1, 2]] * B), T([2] * B), T([[[3, 4], [3, 4]]] * B), T([[2, 2]] * B))
    probs = torch.zeros(B, tree.N + 1, 6, device=DEVICE)
    probs[:, :, 0] = 0.5
    probs[:, :, 1] = 0.5  # only 0 and 1 possible anywhere (top-k style): 2, 3, 4 always rejected
    res = accept_sampled(tree, probs, gen(0))
    e = res.emitted
    assert ((e == -1) | (e == 0) | (e == 1)).all()
    assert (res.num_accepted <= 1).all()  # only the draft's 1 can be accepted


def test_sampled_placeholder_token_ids_are_rejected_not_indexed():
    # vLLM schedules -1 placeholder drafts when its runner skipped the drafter; a draft token
    # outside the vocabulary is a child no distribution can accept (tempting: gather at -1,
    # which raises, or wraps to the last token id and may accept it).
    tree = one_tree([5, -1, 7], [[1, 2]])
    probs = torch.full((1, tree.N + 1, 8), 1 / 8, device=DEVICE)
    probs[0, 0, 5] = 1000.0  # node 0 accepted (all but surely), so node 1 (-1) is tried
    # After node 0 the first and last ids are likely: a -1 clamped to 0, or wrapped to the last
    # id, would be accepted.
    probs[0, 1, 0] = probs[0, 1, 7] = 1000.0
    for seed in range(20):
        res = accept_sampled(tree, probs, gen(seed))
        e = emitted(res)
        assert res.num_accepted.tolist()[0] <= 1 and -1 not in e and all(0 <= t < 8 for t in e)


def test_edge_shapes_no_suffixes_and_empty_tree():
    # K = 0: a plain chain, as vLLM's own rejection sampler would see it.
    empty = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=DEVICE)  # noqa: E731
    tree = build_tree(T([[4, 5, 6], [4, 5, 0]]), T([3, 2]), empty(2, 0, 2), empty(2, 0))
    tn = T([[4, 5, 6, 9], [4, 1, 0, 0]])
    g = accept_greedy(tree, tn)
    assert emitted(g, 0) == [4, 5, 6, 9] and emitted(g, 1) == [4, 1]
    s = accept_sampled(tree, torch.nn.functional.one_hot(tn, 10).float(), gen(0))
    assert np.array_equal(s.emitted, g.emitted) and np.array_equal(s.kv_keep_src, g.kv_keep_src)
    # N = 0 (no draft, no suffix): just the target's token after the root.
    tree = build_tree(empty(1, 0), T([0]), empty(1, 0, 2), empty(1, 0))
    assert emitted(accept_greedy(tree, T([[7]]))) == [7]
    s = accept_sampled(tree, torch.nn.functional.one_hot(T([[7]]), 10).float())
    assert emitted(s) == [7]


def test_verify_walks_greedy_rows_of_a_sampled_batch_greedily():
    """A batch mixing greedy and sampled requests takes one (sampled) walk, the greedy rows on
    the one-hot of the raw argmax: they come out as the greedy walk's, whatever the processed
    logits and the uniforms say (tempting: walking them on their processed distribution)."""
    from vllm_ouroboros.verify import verify

    tree = build_tree(T([[5, 6, 7]] * 4), T([3] * 4), T([[[1, 2], [3, 4], [8, 9]]] * 4), T([[2] * 3] * 4))
    paths = [[5, 6, 7, 8, 0, 0, 0, 0, 9, 77], [9] * 10, [5, 6, 7, 3, 0, 0, 4, 11, 0, 0], [5, 42] + [0] * 8]
    V = 80
    logits = torch.nn.functional.one_hot(T(paths), V).float().view(-1, V) * 5
    noise = gen(1)
    def process(x, req):  # what sampling would see: random logits, with 9 (row 1's greedy token) ruled out
        out = torch.randn(x.shape, generator=noise, device=DEVICE)
        out[..., 9] = -float("inf")
        return out

    greedy = T([1, 0, 1, 1]).bool()
    got = verify(tree, logits, np.arange(4) * 10, greedy, process, generator=gen(2))
    want = accept_greedy(tree, T(paths))
    for b in (0, 2, 3):
        assert emitted(got.result, b) == emitted(want, b)
    assert emitted(got.result, 0) == [5, 6, 7, 8, 9, 77] and emitted(got.result, 2) == [5, 6, 7, 3, 4, 11]
    assert np.array_equal(got.target_next, np.array(paths)) and got.token_ids.dtype == np.int32
    # Row 1 was sampled from its processed distribution, in which 9 cannot be drawn: a real
    # token, not the greedy 9 its raw logits force.
    row1 = emitted(got.result, 1)
    assert all(0 <= t < V for t in row1) and row1 != [9], row1



class LargestOutput(TorchDispatchMode):
    """The most elements any operation run under it returned (in-place ones included)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), func
        return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("table", [False, True])
def test_verify_processes_one_row_per_request_at_a_time(seed, table):
    """A sampled step beyond max_table_rows processes the rows the walk reads, one per request
    and depth step, into the same result as the distribution at every node gives (the table
    form, used up to max_table_rows); no operation then makes anything as large as the logits
    (tempting: always the table: 2-4 float32 copies of [R, V], gigabytes at 256 requests)."""
    from vllm_ouroboros.verify import node_rows, verify

    g = gen(seed)
    B, D, K, L, V = 6, 4, 3, 2, 64
    draft = torch.randint(0, 2, (B, D), generator=g, device=DEVICE)
    tree = build_tree(draft, torch.randint(0, D + 1, (B,), generator=g, device=DEVICE),
                      torch.randint(0, 2, (B, K, L), generator=g, device=DEVICE),
                      torch.randint(0, L + 1, (B, K), generator=g, device=DEVICE))
    row_start = np.arange(B) * (tree.N + 1)
    logits = torch.randn(B * (tree.N + 1), V, generator=g, device=DEVICE)
    logits[:, :2] += 4.0  # the tree's tokens are likely: deep walks
    greedy = T([1, 0, 0, 1, 0, 0]).bool()
    temp = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0], device=DEVICE)
    u = torch.rand(B, walk_steps(tree), K + 1, generator=g, device=DEVICE)

    def process(x, req):  # temperature and a top-2 cut, per request
        x.div_((temp if req is None else temp[req])[:, None])
        return x.masked_fill_(x < x.topk(2, dim=-1).values[:, -1:], float("-inf"))

    with LargestOutput() as seen:
        got = verify(tree, logits, row_start, greedy, process, uniforms=u,
                     max_table_rows=B * (tree.N + 1) if table else B * tree.N)
    if table:
        assert seen.numel >= logits.numel()
    else:
        assert seen.numel <= B * V, f"{seen.op} made {seen.numel} elements (logits: {logits.numel()})"
    # Reference: the processed distribution at every node, greedy rows one-hot on the raw argmax.
    rows = torch.as_tensor(node_rows(tree, row_start), device=DEVICE)
    x = logits[rows] / temp[:, None, None]
    ref = torch.softmax(x.masked_fill(x < x.topk(2, dim=-1).values[..., -1:], float("-inf")), -1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1)[rows], V).float()
    want = accept_sampled(tree, torch.where(greedy[:, None, None], one_hot, ref), uniforms=u)
    assert np.array_equal(got.result.emitted, want.emitted)
    assert np.array_equal(got.result.num_emitted, want.num_emitted)
    assert np.array_equal(got.result.kv_keep_src, want.kv_keep_src)
    assert want.num_accepted.max() >= 2  # the walks went past the root

# ---- lossless sampling: chi-square against the exact target ----------------------------------
#
# Test design. The target is a fixed table p(. | context) over V = 6 tokens, a different
# distribution for every context (Dirichlet draws seeded by the context, plus extra mass on the
# tree's tokens so that deep nodes are reached often). The emitted sequence of one round,
# extended by exact sampling after the round, has the target's distribution iff for every
# context c the next token of the sequences that start with c is distributed p(. | c). Outside
# the tree the next token always comes from the exact extension, so only tree contexts (the root
# and every node's path) can be wrong; for those a correct round emits the next token itself (a
# prefix equal to a tree path was reached by acceptances: a correction is never a tried child).
# Per tree context: Pearson's chi-square of the next emitted token against n_c * p(. | c) (cells
# expecting < 5 pooled). The check passes iff the sum over contexts (chi-square with the summed
# degrees of freedom under H0: conditional multinomials are independent given their counts) has
# p > ALPHA / 2 and every context has p > ALPHA / (2 * contexts) (Bonferroni): family-wise
# false alarm <= ALPHA; the per-context tests keep the power for a shift local to one context.
#
# Power, from the per-context tests alone (counts n_c as observed with N_TRIALS; numpy noncentral
# chi-square, df 5, 10^5 draws; noncentrality n_c * delta^2 * (1/p_a + 1/p_b) for the least
# detectable pair of cells a, b): moving delta = 0.05 of probability between any two cells of any
# tree context is detected with probability >= 0.998 (the smallest context has n_c ~ 3600);
# delta = 0.02 at every context with n_c >= 24000 (tree A: root, "1", "1 2"; tree B: root, "2")
# with probability >= 0.987. The negative controls below shift 0.1 to 0.5 and fail by far.

V = 6
N_TRIALS = 50000  # per tree; the scalar negative controls use N_REF
N_REF = 5000
ALPHA = 1e-3


# Tiny tensors: thread wake-ups cost more than the work (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


# Tree A: draft [1, 2]; suffixes with a repeated head (3 in k = 0, 1, 3), a fully duplicated
# suffix (k = 3 == k = 0) and a distinct one.
TREE_A = dict(draft=[1, 2], suffixes=[[3, 4], [3, 5], [0, 1], [3, 4]])
BOOST_A = {(): {1: 1.0}, (1,): {2: 1.0}, (1, 2): {3: 0.8, 0: 0.4}, (1, 2, 3): {4: 0.4, 5: 0.6},
           (1, 2, 0): {1: 0.5}}
# Tree B: no draft, suffixes from the root, ragged lengths, repeated head 2.
TREE_B = dict(draft=[], suffixes=[[2, 3, 4], [2, 5, 1], [4, 4], []])
BOOST_B = {(): {2: 0.8, 4: 0.4}, (2,): {3: 0.5, 5: 0.5}, (2, 3): {4: 0.8}, (2, 5): {1: 0.6},
           (4,): {4: 0.8}}


def make_target(boost, seed):
    cache = {}

    def p_of(ctx):
        ctx = tuple(ctx)
        if ctx not in cache:
            g = np.random.default_rng([seed, len(ctx), *ctx])
            p = 0.5 * g.dirichlet(np.ones(V))
            for x, w in boost.get(ctx, {}).items():
                p[x] += w
            cache[ctx] = p / p.sum()
        return cache[ctx]
    return p_of


def tree_contexts(draft, suffixes):
    ctxs = {()}
    for j in range(len(draft)):
        ctxs.add(tuple(draft[:j + 1]))
    for s in suffixes:
        for j in range(len(s)):
            ctxs.add(tuple(draft + s[:j + 1]))
    return sorted(ctxs, key=lambda c: (len(c), c))


def chi2_sf(stat, df):
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def context_chi2(seqs, lens, contexts, p_of, seed=0):
    """Pearson chi-square of the next token after each tree context.

    seqs [M, W] int64 (-1 padded), lens [M]. A sequence that ends at a tree context is extended
    by one exact draw from p_of (a correct sampler never ends there; a wrong one may, and is then
    judged on the token it emitted). Returns [(context, n_c, stat, df, p)]."""
    rng = np.random.default_rng(seed)
    seqs = np.concatenate([seqs, np.full((len(seqs), 1), -1, np.int64)], axis=1)
    lens = lens.copy()
    per = []
    for c in contexts:  # shortest first, so extensions are seen by longer contexts
        m = len(c)
        starts = (lens >= m) & np.all(seqs[:, :m] == np.array(c, np.int64)[None, :], axis=1)
        end = np.nonzero(starts & (lens == m))[0]
        if len(end) and m < seqs.shape[1]:
            seqs[end, m] = rng.choice(V, size=len(end), p=p_of(c))
            lens[end] += 1
        obs = np.bincount(seqs[starts, m], minlength=V).astype(float)
        exp = starts.sum() * p_of(c)
        # Pool the smallest cells until every bin expects >= 5.
        order = np.argsort(exp)
        o, e = list(obs[order]), list(exp[order])
        while len(e) > 1 and e[0] < 5:
            e0, o0 = e.pop(0), o.pop(0)
            e[0] += e0
            o[0] += o0
        if len(e) < 2:
            continue
        stat = float(sum((oi - ei) ** 2 / ei for oi, ei in zip(o, e)))
        per.append((c, int(starts.sum()), stat, len(e) - 1, chi2_sf(stat, len(e) - 1)))
    return per


def lossless_check(seqs, lens, cfg, p_of):
    """(passed, summary) of the test described above for one tree config."""
    per = context_chi2(seqs, lens, tree_contexts(**cfg), p_of)
    stat, df = sum(x[2] for x in per), sum(x[3] for x in per)
    p_sum, p_min = chi2_sf(stat, df), min(x[4] for x in per)
    passed = p_sum > ALPHA / 2 and p_min > ALPHA / (2 * len(per))
    summary = (f"sum chi2 = {stat:.1f} (df {df}, p = {p_sum:.3g}); min context p = {p_min:.3g}; "
               + ", ".join(f"{''.join(map(str, c)) or 'root'}: n={n} chi2={s:.1f}/{d}"
                           for c, n, s, d, _ in per))
    return passed, summary


def ends_at_tree_context(seqs, lens, contexts):
    """Rows whose round ended exactly on a tree path (impossible for a correct sampler: the
    final token is drawn with every tried child removed)."""
    bad = np.zeros(len(lens), bool)
    for c in contexts:
        m = len(c)
        if m:
            bad |= (lens == m) & np.all(seqs[:, :m] == np.array(c, np.int64)[None, :], axis=1)
    return bad


def run_production(configs, seed):
    """Vectorised sampler over one ragged batch holding N_TRIALS rows of each tree config."""
    B = N_TRIALS * len(configs)
    D = max(len(c[0]["draft"]) for c in configs)
    K = max(len(c[0]["suffixes"]) for c in configs)
    L = max(len(s) for c in configs for s in c[0]["suffixes"])
    which = np.arange(B) % len(configs)  # interleaved rows of different trees
    d, n, s, sl = [], [], [], []
    for cfg, _ in configs:
        dr, sf = cfg["draft"], cfg["suffixes"] + [[]] * (K - len(cfg["suffixes"]))
        d.append(dr + [0] * (D - len(dr)))
        n.append(len(dr))
        s.append([x + [0] * (L - len(x)) for x in sf])
        sl.append([len(x) for x in sf])
    w = torch.from_numpy(which).to(DEVICE)
    tree = build_tree(T(d)[w], T(n)[w], T(s)[w], T(sl)[w])
    # probs per config: row 0 = p(. | root), row 1 + i = p(. | path to node i).
    rows = []
    for ci, (cfg, p_of) in enumerate(configs):
        par, tok = tree.parents[ci].tolist(), tree.tokens[ci].tolist()
        r = [p_of(())]
        for i in range(tree.N):
            path, j = [], i
            while j != -1:
                path.append(tok[j])
                j = par[j]
            r.append(p_of(path[::-1]) if i < int(tree.num_nodes[ci]) else np.zeros(V))
        rows.append(r)
    probs = torch.tensor(np.array(rows), dtype=torch.float32, device=DEVICE)[w]
    res = accept_sampled(tree, probs, gen(seed))
    return res, which


def test_sampling_is_lossless_chi_square():
    pa, pb = make_target(BOOST_A, 1), make_target(BOOST_B, 2)
    configs = [(TREE_A, pa), (TREE_B, pb)]
    res, which = run_production(configs, seed=1234)
    seqs, lens = res.emitted, res.num_emitted
    for ci, (cfg, p_of) in enumerate(configs):
        rows = which == ci
        assert not ends_at_tree_context(seqs[rows], lens[rows], tree_contexts(**cfg)).any()
        passed, summary = lossless_check(seqs[rows], lens[rows], cfg, p_of)
        print(f"tree {'AB'[ci]}: {summary}")
        assert passed, summary
        # Deep nodes are reached (the test exercises suffixes and duplicate heads).
        assert (lens[rows] >= len(cfg["draft"]) + 3).mean() > 0.05


def test_sampled_accepted_tokens_lie_on_reported_nodes():
    pa, pb = make_target(BOOST_A, 1), make_target(BOOST_B, 2)
    res, which = run_production([(TREE_A, pa), (TREE_B, pb)], seed=7)
    tree_tokens = {0: one_tree(**TREE_A), 1: one_tree(**TREE_B, D=2, L=3)}
    src, na = res.kv_keep_src, res.num_accepted
    for b in range(0, len(which), 2501):
        t = tree_tokens[int(which[b])]
        nodes = src[b, :na[b]].tolist()
        assert [int(t.tokens[0, i]) for i in nodes] == res.emitted[b, :na[b]].tolist()
        assert [int(t.depth[0, i]) for i in nodes] == list(range(1, na[b] + 1))


def test_uniforms_argument_reproduces_generator_draws():
    tree = one_tree(**TREE_A)
    probs = torch.rand(1, tree.N + 1, V, device=DEVICE)
    u = torch.rand(1, walk_steps(tree), tree.K + 1, generator=gen(3), device=DEVICE,
                   dtype=torch.float64)  # as the walk draws them
    a = accept_sampled(tree, probs, gen(3))
    b = accept_sampled(tree, probs, uniforms=u)
    assert np.array_equal(a.emitted, b.emitted)


# ---- negative controls: the same check must reject wrong samplers ----------------------------

def reference_walk(draft, suffixes, p_of, rng, bug=None):
    """One round of the multi-candidate walk in plain Python, optionally with a known bug."""
    out, live, n = [], [s for s in suffixes if s], len(draft)
    t = 0
    while True:
        p = p_of(out)
        cands = [draft[t]] if t < n else [s[t - n] for s in live if len(s) > t - n]
        r = p.copy()
        tried = 0.0
        chosen = None
        for x in cands:
            if bug == "accept_if_positive":
                ok = r[x] > 0
            elif bug == "no_residual":  # each child judged on p alone, not on the residual
                ok = rng.random() < p[x]
            elif bug == "dup_reaccept":  # textbook p(x) / (1 - tried mass), duplicates counted again
                ok = tried >= 1 or rng.random() < p[x] / (1 - tried)
                tried += p[x]
            else:
                ok = rng.random() * r.sum() < r[x]
            if ok:
                chosen = x
                break
            r[x] = 0
        if chosen is None:
            dist = p if bug == "correction_from_p" else r
            out.append(int(rng.choice(V, p=dist / dist.sum())))
            return out
        out.append(chosen)
        if t >= n:
            live = [s for s in live if len(s) > t - n and s[t - n] == chosen]
        t += 1


def run_reference(cfg, p_of, bug, seed, trials=N_REF):
    rng = np.random.default_rng(seed)
    seqs = np.full((trials, len(cfg["draft"]) + max(map(len, cfg["suffixes"])) + 1), -1, np.int64)
    lens = np.zeros(trials, np.int64)
    for i in range(trials):
        o = reference_walk(cfg["draft"], cfg["suffixes"], p_of, rng, bug)
        seqs[i, :len(o)] = o
        lens[i] = len(o)
    return seqs, lens


def test_reference_walk_passes_and_known_bugs_fail():
    pa = make_target(BOOST_A, 1)
    passed, summary = lossless_check(*run_reference(TREE_A, pa, None, 5), TREE_A, pa)
    print(f"reference walk: {summary}")
    assert passed, summary
    # Each known bug fails the same check, even with a tenth of the production test's trials.
    for bug in ("accept_if_positive", "no_residual", "dup_reaccept", "correction_from_p"):
        passed, summary = lossless_check(*run_reference(TREE_A, pa, bug, 5), TREE_A, pa)
        print(f"{bug}: {summary}")
        assert not passed, bug
