"""DraftRuntime.run_round drafts exactly the draft model's own greedy continuation.

The reference is Hugging Face transformers (float32, eager attention) decoding greedily on the
current context. Between rounds a simulated target accepts a random prefix of each draft and
appends a correction (or accepts everything plus a bonus), which exercises rollback of the
draft's KV, the prefill path, ragged batching and the phrase pool.
"""

import copy

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from vllm_ouroboros.draft import DraftModel  # noqa: E402
from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings  # noqa: E402
from vllm_ouroboros.pool import PhrasePool  # noqa: E402

GAMMA, BETA, W, G, K = 5, 4, 4, 4, 2
L = BETA - 1
MAX_LEN = 512
# Contexts per slot; 100 tokens is above the prefill threshold gamma + 2 beta + 2 = 15.
CONTEXT_LENS = [1, 3, 100, 17, 9]


# Tiny tensors: thread wake-ups cost more than the work (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def draft_path(tiny_models):
    return str(tiny_models["draft"])


@pytest.fixture(scope="module")
def greedy(draft_path):
    """greedy(ctx, n): the first n tokens HF greedy decoding of the draft model produces."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        draft_path, dtype=torch.float32, attn_implementation="eager").eval()
    memo: dict[tuple, list[int]] = {}

    @torch.no_grad()
    def run(ctx, n):
        ctx = tuple(int(x) for x in ctx)
        have = memo.get(ctx, [])
        if len(have) < n:
            out = hf(torch.tensor([ctx]), use_cache=True)
            have = []
            while True:
                have.append(int(out.logits[0, -1].argmax()))
                if len(have) == n:
                    break
                out = hf(torch.tensor([[have[-1]]]), past_key_values=out.past_key_values,
                         use_cache=True)
            memo[ctx] = have
        return have[:n]

    return run


def make_runtime(draft_path, device, num_slots, shared=True, cache_tokens=None, cache_limit=None, **kw):
    """A fresh draft model (its own KV cache), pool and runtime, all on `device`. cache_tokens:
    the cache's pages at the start (default: the runtime's own sizing); cache_limit: bytes."""
    model = DraftModel.from_pretrained(draft_path, dtype=torch.float32, device=device)
    if cache_tokens is not None:
        model.allocate_cache(num_slots + 1, MAX_LEN, num_tokens=cache_tokens, limit_bytes=cache_limit)
    V = model.vocab_size
    pool = PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, V), device=device, shared=shared)
    settings = DraftSettings(**{**dict(gamma=GAMMA, beta=BETA, window_size=W, num_guesses=G,
                                       num_suffixes=K), **kw})
    return DraftRuntime(model, pool, settings, num_slots, MAX_LEN, device), pool


def table(contexts, order, width=None, fill=-7):
    """vLLM-style host token table: request b's context in row order[b]; junk after each."""
    width = width or max(len(c) for c in contexts) + 5
    tab = np.full((len(contexts), width), fill, np.int64)
    rows = np.zeros(len(contexts), np.int64)
    for b, (c, r) in enumerate(zip(contexts, order)):
        tab[r, : len(c)] = c
        rows[b] = r
    return tab, rows


def draft_round(rt, slots, contexts, rng):
    """One round over `contexts` (rows of the table shuffled); returns the drafts as lists."""
    order = rng.permutation(len(contexts))
    tab, rows = table(contexts, order)
    lens = np.array([len(c) for c in contexts], np.int64)
    out = rt.run_round(np.asarray(slots, np.int64), tab, rows, lens)
    drafts = [out.drafts[b, : out.draft_lens[b]].tolist() for b in range(len(contexts))]
    return out, drafts


def simulate_target(ctx, draft, rng, greedy, vocab):
    """Accept a random prefix plus a correction, or (1 in 4) everything plus a bonus."""
    if rng.random() < 0.25:
        bonus = greedy(ctx + draft, 1)[0] if rng.random() < 0.5 else int(rng.integers(vocab))
        return ctx + draft + [bonus]
    k = int(rng.integers(len(draft)))
    wrong = int(rng.integers(vocab - 1))
    return ctx + draft[:k] + [wrong + (wrong >= draft[k])]  # never equal to draft[k]


def seed_phrase(pool, ctx, slot, rng, greedy, vocab):
    """Stand-in for the feedback writers: a phrase for the context's last token that is right
    for its first 0..L tokens (the draft's own continuation), then wrong; owned by this request
    or (shared pool) by another one."""
    if rng.random() < 0.3:
        return
    phrase = greedy(ctx, L)
    right = int(rng.integers(L + 1))
    for k in range(right, L):
        wrong = int(rng.integers(vocab - 1))
        phrase[k] = wrong + (wrong >= phrase[k])
    owner = slot if rng.random() < 0.7 else -1
    pool.insert(torch.tensor([ctx[-1]]), torch.tensor([phrase]), torch.tensor([owner]))


def check_round(out, drafts, contexts, greedy, rt=None, slots=None):
    B = len(contexts)
    if rt is not None:
        # The slot's KV covers the context and the draft except the last forward's new tokens
        # (1..beta of them), and the runtime's record of those tokens is right.
        for b, s in enumerate(slots):
            seq = contexts[b] + drafts[b]
            kv = int(rt.kv_len[s])
            assert len(seq) - BETA <= kv <= len(seq) - 1, (b, kv, len(seq))
            assert rt.cached[s, :kv].tolist() == seq[:kv]
        # Candidate suffixes: the pool's K best phrases for the draft's last token.
        phr, valid = rt.pool.lookup(torch.tensor([d[-1] for d in drafts]), torch.tensor(slots), K)
        assert (out.suffix_valid == valid.cpu().numpy()).all()
        assert (out.suffixes == phr.cpu().numpy()).all()
    assert (out.draft_lens >= GAMMA).all() and (out.draft_lens < GAMMA + BETA).all()
    for b in range(B):
        assert drafts[b] == greedy(contexts[b], len(drafts[b])), (b, len(contexts[b]))
    # every row takes part in every forward until it has gamma tokens; none waits for another
    assert out.forwards == out.row_forwards.max()
    assert (out.row_forwards >= 1).all()
    assert (out.guess_tokens == out.draft_lens - out.row_forwards).all()
    assert out.suffixes.shape == (B, K, L) and out.suffix_valid.shape == (B, K)


CONFIGS = {
    "lookahead+guesses": dict(),
    "no-guesses": dict(use_guesses=False),
    "no-lookahead": dict(use_lookahead=False),
    "neither": dict(use_lookahead=False, use_guesses=False),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_drafts_are_the_draft_models_greedy_continuation(config, draft_path, greedy, device):
    rng = np.random.default_rng(sorted(CONFIGS).index(config))
    rt, pool = make_runtime(draft_path, device, num_slots=2, **CONFIGS[config])  # grows to 8 slots
    V = rt.model.vocab_size
    slots = [4, 0, 7, 2, 5]
    contexts = [rng.integers(2, V, n).tolist() for n in CONTEXT_LENS]
    prefills = guessed = 0
    for _ in range(8):
        # Now and then a request sits a round out while its context still grows (a chunked
        # prefill elsewhere): its cache then holds drafts from two rounds back.
        live = [b for b in range(len(slots)) if rng.random() > 0.15] or [0]
        out, drafts = draft_round(rt, [slots[b] for b in live], [contexts[b] for b in live], rng)
        check_round(out, drafts, [contexts[b] for b in live], greedy, rt, [slots[b] for b in live])
        prefills += out.prefill_forwards
        guessed += int(out.guess_tokens.sum())
        for i, b in enumerate(live):
            contexts[b] = simulate_target(contexts[b], drafts[i], rng, greedy, V)
            seed_phrase(pool, contexts[b], slots[b], rng, greedy, V)
        for b in set(range(len(slots))) - set(live):
            contexts[b] = contexts[b] + rng.integers(2, V, 3).tolist()
    assert prefills >= 1  # the 100-token prompt went through the prefill path
    assert (guessed > 0) == (rt.G > 0)


def test_one_forward_yields_beta_tokens_from_a_right_phrase(draft_path, greedy, device):
    """With the draft's own continuation in the pool, one forward drafts beta tokens."""
    rng = np.random.default_rng(10)
    rt, pool = make_runtime(draft_path, device, num_slots=3, gamma=BETA, use_lookahead=False)
    V = rt.model.vocab_size
    contexts = [rng.integers(2, V, n).tolist() for n in (6, 40, 11)]
    for s in (0, 1):  # rows 0, 1 get their continuation as a phrase; row 2 gets nothing
        pool.insert(torch.tensor([contexts[s][-1]]), torch.tensor([greedy(contexts[s], L)]),
                    torch.tensor([s]))
    out, drafts = draft_round(rt, [0, 1, 2], contexts, rng)
    for b in range(3):
        assert drafts[b] == greedy(contexts[b], len(drafts[b]))
    assert out.row_forwards[:2].tolist() == [1, 1]
    assert out.draft_lens[:2].tolist() == [BETA, BETA]
    assert out.guess_tokens[:2].tolist() == [L, L]
    assert out.guess_hit_forwards[:2].tolist() == [1, 1]
    # row 2 found nothing to verify at first: it needs more forwards, and the batch waits for it
    # only as long as it needs
    assert out.row_forwards[2] > 1
    assert out.forwards == out.row_forwards[2]


def test_guesses_save_forwards_on_a_repetitive_context(draft_path, greedy, device):
    """The target agrees with the draft: the Jacobi window and the pool then find phrases the
    draft confirms, so over the rounds it drafts more tokens than it runs forwards."""
    rng = np.random.default_rng(11)
    rt, pool = make_runtime(draft_path, device, num_slots=1)
    V = rt.model.vocab_size
    ctx = (rng.integers(2, V, 4).tolist() * 6)[:21]
    tokens = forwards = guessed = 0
    for _ in range(8):
        out, drafts = draft_round(rt, [0], [ctx], rng)
        assert drafts[0] == greedy(ctx, len(drafts[0]))
        tokens += int(out.draft_lens[0])
        forwards += out.forwards
        guessed += int(out.guess_tokens[0])
        ctx = ctx + drafts[0] + greedy(ctx + drafts[0], 1)
    assert pool.num_phrases() > 0
    assert guessed > 0
    assert forwards < tokens


def test_batching_shares_forwards(draft_path, greedy, device):
    """8 requests with the same contexts as 1 request: the same drafts with the same number of
    batched forwards per round (not 8 times as many, not more than the 1-request run)."""
    rng = np.random.default_rng(12)
    solo, _ = make_runtime(draft_path, device, num_slots=1)
    batch, _ = make_runtime(draft_path, device, num_slots=8)
    V = solo.model.vocab_size
    ctx = rng.integers(2, V, 30).tolist()
    slots = [3, 0, 6, 1, 7, 2, 5, 4]
    for _ in range(6):
        out1, d1 = draft_round(solo, [0], [ctx], rng)
        out8, d8 = draft_round(batch, slots, [ctx] * 8, rng)
        assert d1[0] == greedy(ctx, len(d1[0]))
        assert all(d == d1[0] for d in d8)
        assert out8.forwards == out8.row_forwards.max() == out1.forwards
        assert (out8.row_forwards == out1.row_forwards[0]).all()
        assert out8.prefill_forwards == out1.prefill_forwards
        ctx = simulate_target(ctx, d1[0], rng, greedy, V)


def test_ragged_batch_forwards_follow_the_slowest_row(draft_path, greedy, device):
    """Without guesses each forward gives exactly one token per row: gamma forwards per round
    whatever the batch size and context lengths."""
    rng = np.random.default_rng(13)
    rt, _ = make_runtime(draft_path, device, num_slots=8, use_guesses=False)
    V = rt.model.vocab_size
    contexts = [rng.integers(2, V, n).tolist() for n in (1, 2, 5, 13, 20, 33, 60, 7)]
    for _ in range(3):
        out, drafts = draft_round(rt, list(range(8)), contexts, rng)
        check_round(out, drafts, contexts, greedy, rt, list(range(8)))
        assert out.forwards == GAMMA and (out.row_forwards == GAMMA).all()
        assert (out.draft_lens == GAMMA).all()
        contexts = [simulate_target(c, d, rng, greedy, V) for c, d in zip(contexts, drafts)]


def test_a_cut_round_drafts_a_chain_of_the_same_tokens(draft_path, greedy, device):
    """max_tokens below gamma (the back-off's shorter draft under load): that many forwards, one
    token each, no window and no guesses, and the draft model's greedy continuation still; a
    whole round after it drafts as before, window and pool included."""
    rng = np.random.default_rng(16)
    rt, pool = make_runtime(draft_path, device, num_slots=3)
    V = rt.model.vocab_size
    contexts = [rng.integers(2, V, n).tolist() for n in (5, 40, 12)]
    for c in contexts:  # a right phrase the cut round must not take
        pool.insert(torch.tensor([c[-1]]), torch.tensor([greedy(c, L)]), torch.tensor([-1]))
    lens = np.array([len(c) for c in contexts], np.int64)
    for cut in (1, 3):
        tab, rows = table(contexts, [2, 0, 1])
        before = pool.num_phrases()
        out = rt.run_round(np.arange(3), tab, rows, lens, max_tokens=cut)
        assert out.forwards == cut and (out.row_forwards == cut).all()
        assert (out.draft_lens == cut).all() and (out.guess_tokens == 0).all()
        assert pool.num_phrases() == before  # no window, so nothing inserted
        for b in range(3):
            assert out.drafts[b, :cut].tolist() == greedy(contexts[b], cut)
    out, drafts = draft_round(rt, [0, 1, 2], contexts, rng)  # whole again
    check_round(out, drafts, contexts, greedy, rt, [0, 1, 2])
    assert out.guess_tokens.sum() > 0


def test_a_cut_at_gamma_or_above_ends_the_draft_there(draft_path, greedy, device):
    """max_tokens at or above gamma: phrase drafting as usual, but the last forward takes no
    token past the cut (it would overshoot to gamma + beta - 1 where the pool's phrases are
    right), and the suffixes are the pool's phrases after the cut draft's last token."""
    rng = np.random.default_rng(17)
    rt, pool = make_runtime(draft_path, device, num_slots=3)
    V = rt.model.vocab_size
    contexts = [rng.integers(2, V, n).tolist() for n in (5, 40, 12)]
    for c in contexts:  # right phrases all along: every forward takes a whole one
        seq = list(c)
        for _ in range(4):
            nxt = greedy(seq, L)
            pool.insert(torch.tensor([seq[-1]]), torch.tensor([nxt]), torch.tensor([-1]))
            seq += nxt
    lens = np.array([len(c) for c in contexts], np.int64)
    phrases = copy.deepcopy(pool.state_dict())  # each round below starts from these
    whole = rt.run_round(np.arange(3), *table(contexts, [2, 0, 1]), lens)
    assert (whole.draft_lens > GAMMA).any()  # the overshoot a cut must not take
    for cut in (GAMMA, GAMMA + 1):
        rt2, pool2 = make_runtime(draft_path, device, num_slots=3)
        pool2.load_state_dict(copy.deepcopy(phrases))
        out = rt2.run_round(np.arange(3), *table(contexts, [2, 0, 1]), lens, max_tokens=cut)
        assert (out.draft_lens <= cut).all() and (out.draft_lens == np.minimum(whole.draft_lens, cut)).all()
        drafts = [out.drafts[b, :out.draft_lens[b]].tolist() for b in range(3)]
        for b in range(3):
            assert drafts[b] == greedy(contexts[b], len(drafts[b]))
        phr, valid = pool2.lookup(torch.tensor([d[-1] for d in drafts]), torch.tensor([0, 1, 2]), K)
        assert (out.suffix_valid == valid.cpu().numpy()).all() and (out.suffixes == phr.cpu().numpy()).all()


def test_reused_slot_after_reset_drafts_for_the_new_context(draft_path, greedy, device):
    rng = np.random.default_rng(14)
    rt, _ = make_runtime(draft_path, device, num_slots=2)
    V = rt.model.vocab_size
    old, other = rng.integers(2, V, 50).tolist(), rng.integers(2, V, 8).tolist()
    for _ in range(3):
        out, (d_old, d_other) = draft_round(rt, [1, 0], [old, other], rng)
        old = simulate_target(old, d_old, rng, greedy, V)
        other = simulate_target(other, d_other, rng, greedy, V)
    rt.reset_slots([1])
    # A new request in slot 1, longer than the old one at first, then shorter.
    for new in (rng.integers(2, V, 90).tolist(), rng.integers(2, V, 4).tolist()):
        for _ in range(3):
            out, drafts = draft_round(rt, [1, 0], [new, other], rng)
            check_round(out, drafts, [new, other], greedy, rt, [1, 0])
            new = simulate_target(new, drafts[0], rng, greedy, V)
            other = simulate_target(other, drafts[1], rng, greedy, V)
        rt.reset_slots([1])


def test_a_context_cut_back_and_regrown_is_drafted_from_the_new_tokens(draft_path, greedy, device):
    """vLLM may cut a request's output back (a failed KV load) and grow other tokens in their
    place, as long as before: the round trusts the cache up to what it confirmed, so `rewind`
    must lower that, or the draft continues from the old tokens' KV."""
    rng = np.random.default_rng(21)
    stale, mended = (make_runtime(draft_path, device, num_slots=1)[0] for _ in range(2))
    V = stale.model.vocab_size
    ctx = rng.integers(2, V, 40).tolist()
    for rt in (stale, mended):
        draft_round(rt, [0], [ctx], np.random.default_rng(0))
        assert rt.confirmed[0] == len(ctx)
    regrown = ctx[:35] + [(t + 1) % V for t in ctx[35:]]
    mended.rewind(np.array([0]), np.array([35]))
    assert mended.confirmed[0] == 35
    for rt in (stale, mended):
        out, drafts = draft_round(rt, [0], [regrown], np.random.default_rng(0))
        n = min(int(rt.kv_len[0]), len(regrown))  # the cache holds the draft after the context
        same = rt.cached[0, :n].tolist() == regrown[:n]
        if rt is stale:
            assert not same, "the cut went unnoticed anyway: the test no longer tests rewind"
        else:
            assert same
            check_round(out, drafts, [regrown], greedy, rt, [0])
    before = mended.confirmed.copy()
    mended.rewind(np.array([5]), np.array([0]))  # a slot the cache never grew to: nothing
    mended.rewind(np.array([5, 0]), np.array([0, 30]))  # beside one it holds: that one alone
    assert before[0] > 30 and mended.confirmed[0] == 30 and np.array_equal(mended.confirmed[1:], before[1:])


def test_cache_bytes_and_the_growth_warning(draft_path, device):
    """The draft cache's size (k and v pages, every layer) and the load-time warning when growing
    it on demand could outrun the memory vLLM leaves free."""
    from vllm_ouroboros.draft.runtime import cache_growth_warning

    model = DraftModel.from_pretrained(draft_path, dtype=torch.float32, device=device)
    model.allocate_cache(3, 40)  # 3 pages of 16 tokens per slot, and the null page
    assert model.kv.num_pages == 10 and model.kv.stats() == {
        "memory_bytes": model.kv.bytes, "pages": 9, "pages_used": 9}
    assert model.kv.bytes == model.k_cache.numel() * 4 * 2 == model.cache_bytes(10 * 16)
    assert model.cache_bytes(40) == model.cache_bytes(48) == 3 * 16 * model.token_bytes
    GiB = 2**30
    # The real 0.5B draft in bf16 (12,288 bytes a token): 17 slots of 2,048 tokens fit easily in
    # 80 GiB x 8%; 257 slots of 32k do not.
    tok = 12288
    assert cache_growth_warning(17 * 2048 * tok, 17 * 2048 * tok, 0.08 * 80 * GiB, 16, 2048) is None
    msg = cache_growth_warning(257 * 32768 * tok, 65 * 2048 * tok, 0.08 * 80 * GiB, 256, 32768)
    assert msg is not None and "256 requests of 32768 tokens" in msg and "it would reach 96.4 GiB" in msg
    assert "lower max_num_seqs" in msg


def _runtime_state(rt):
    kv = rt.kv
    return (rt._slots, rt._cap, rt.generation, rt.cached.copy(), rt.kv_len.copy(),
            rt.confirmed.copy(), rt.window_ready.copy(), kv.table.copy(), kv.held.copy(),
            kv.free.copy(), rt.window.clone(), kv.block_table.clone(), kv.k, kv.v)


def _assert_same_state(a, b):
    assert a[:3] == b[:3]
    for x, y in zip(a[3:10], b[3:10]):
        assert x.shape == y.shape and (x == y).all()
    assert torch.equal(a[10], b[10]) and torch.equal(a[11], b[11])
    assert a[12] is b[12] and a[13] is b[13]  # the page store was not replaced


def test_one_long_request_takes_pages_not_every_slot(draft_path, greedy, device):
    """Paged: a request far longer than the others takes pages for its own length; the short
    ones hold a few pages each, a finished request's pages go to the next one, and the drafts
    are the draft's greedy continuation throughout."""
    rng = np.random.default_rng(20)
    rt, _ = make_runtime(draft_path, device, num_slots=4, cache_tokens=64 * 16)
    V = rt.model.vocab_size
    kv = rt.kv
    shorts = [rng.integers(2, V, 10).tolist() for _ in range(3)]
    long = rng.integers(2, V, 400).tolist()
    ctxs = [long] + shorts
    out, drafts = draft_round(rt, [0, 1, 2, 3], ctxs, rng)
    check_round(out, drafts, ctxs, greedy, rt, [0, 1, 2, 3])
    room = rt._round_room
    expect = [-(-(len(c) + room) // 16) for c in ctxs]
    assert kv.held[:4].tolist() == expect
    assert kv.num_pages == 65  # no growth: the long one fit in the store with the others
    used = sum(expect)
    assert kv.stats()["pages_used"] == used
    rt.reset_slots([0])  # the long request finished: its pages are free again
    assert kv.stats()["pages_used"] == used - expect[0] and kv.held[0] == 0
    assert (kv.block_table[0] == 0).all()
    uploads = []
    upload = kv._upload
    kv._upload = lambda seqs: (uploads.append(seqs.tolist()), upload(seqs))
    rt.reset_slots([1, 3, 7])  # a step's finished requests: one upload of the table's rows
    kv._upload = upload
    assert uploads == [[1, 3]] and kv.held[[1, 3]].tolist() == [0, 0]
    assert kv.stats()["pages_used"] == expect[2] and rt.kv_len[[1, 3]].tolist() == [0, 0]
    nxt = rng.integers(2, V, 300).tolist()
    out, drafts = draft_round(rt, [0, 2], [nxt, shorts[1]], rng)
    check_round(out, drafts, [nxt, shorts[1]], greedy, rt, [0, 2])
    assert kv.num_pages == 65


def test_a_cache_that_cannot_grow_changes_nothing(draft_path, greedy, device, monkeypatch):
    """Growing the draft cache's page store fails for want of device memory: run_round raises
    DraftCacheFull with the runtime and the cache as they were; `fits` says which rows can
    still draft, a round of those is the draft's greedy continuation, and once the memory is
    there the long request drafts too."""
    from vllm_ouroboros.draft.runtime import DraftCacheFull

    rng = np.random.default_rng(21)
    rt, _ = make_runtime(draft_path, device, num_slots=2, cache_tokens=12 * 16)
    V = rt.model.vocab_size
    short = rng.integers(2, V, 20).tolist()
    draft_round(rt, [0], [short], rng)
    before = _runtime_state(rt)
    long = rng.integers(2, V, 300).tolist()  # past the free pages, in a new slot

    def no_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(rt.kv, "_new_store", no_memory)
    with pytest.raises(DraftCacheFull, match=r"\d+ pages of 16 tokens \([\d.]+ MiB\): CUDA out of memory"):
        draft_round(rt, [3, 0], [long, short], rng)
    _assert_same_state(before, _runtime_state(rt))
    assert rt.fits(np.array([3, 0, 1, 1]), np.array([300, 20, 20, 300])).tolist() == [False, True, True, False]
    out, drafts = draft_round(rt, [0], [short], rng)
    check_round(out, drafts, [short], greedy, rt, [0])
    monkeypatch.undo()
    out, drafts = draft_round(rt, [3, 0], [long, short], rng)
    check_round(out, drafts, [long, short], greedy, rt, [3, 0])
    assert rt._slots == 4 and rt._cap >= 300 and rt.kv.num_pages > 13


def test_cache_budget(draft_path, greedy, device):
    """The cache's byte limit (draft_cache_max_mb): the page store grows within it, to the limit
    where doubling would pass it, and a round needing more raises DraftCacheFull with nothing
    changed."""
    from vllm_ouroboros.draft.runtime import DraftCacheFull

    rng = np.random.default_rng(22)
    model = DraftModel.from_pretrained(draft_path, dtype=torch.float32, device=device)
    limit = model.cache_bytes(50 * 16)
    rt, _ = make_runtime(draft_path, device, num_slots=2, cache_tokens=16 * 16, cache_limit=limit)
    V = rt.model.vocab_size
    a, b = rng.integers(2, V, 30).tolist(), rng.integers(2, V, 300).tolist()
    out, drafts = draft_round(rt, [0, 1], [a, b], rng)  # 17 -> 34 pages (doubling fits)
    check_round(out, drafts, [a, b], greedy, rt, [0, 1])
    assert rt.kv.num_pages == 34
    c = rng.integers(2, V, 200).tolist()
    out, drafts = draft_round(rt, [2, 0], [c, a], rng)  # 68 would not fit: up to the limit
    check_round(out, drafts, [c, a], greedy, rt, [2, 0])
    assert rt.kv.num_pages == 50 and rt.kv.bytes == limit
    before = _runtime_state(rt)
    with pytest.raises(DraftCacheFull, match="over draft_cache_max_mb"):
        draft_round(rt, [3, 0], [b, a], rng)  # another long one does not fit
    _assert_same_state(before, _runtime_state(rt))
    assert rt.fits(np.array([3, 0, 1]), np.array([300, 30, 300])).tolist() == [False, True, True]


def test_initial_cache_tokens_within_the_budget():
    from vllm_ouroboros.proposer import ROUND_ROOM_BOUND, initial_cache_tokens

    page = 16 * 1024  # bytes of one page of 16 tokens
    assert initial_cache_tokens(page, 16 * 1024, None) == 16 * 1024
    assert initial_cache_tokens(page, 16 * 1024, 1025 * page) == 16 * 1024  # + the null page
    assert initial_cache_tokens(page, 16 * 1024, 101 * page) == 100 * 16
    least = 64 + ROUND_ROOM_BOUND
    assert initial_cache_tokens(page, 16 * 1024, (least // 16 + 1) * page) == least
    with pytest.raises(ValueError, match="holds less than one request of 64 tokens"):
        initial_cache_tokens(page, 16 * 1024, (least // 16) * page)


def test_pages_of_requests_out_of_the_batch_go_to_the_requests_in_it(draft_path, greedy, device):
    """The proposer's answer to a full cache (_rows_that_fit): where a row of this step does
    not fit, the requests that hold a slot but are out of the batch (preempted) give their pages
    back, keep their slot, and draft again from a prefill when they return."""
    from conftest import bare_proposer
    from vllm_ouroboros.request_slots import RequestSlots

    rng = np.random.default_rng(23)
    model = DraftModel.from_pretrained(draft_path, dtype=torch.float32, device=device)
    rt, _ = make_runtime(draft_path, device, num_slots=3, cache_tokens=40 * 16,
                         cache_limit=model.cache_bytes(41 * 16))  # 40 pages, no growth
    V = rt.model.vocab_size
    p = bare_proposer()  # the proposer reduced to what the path reads
    p.runtime, p._slot_of, p._caches_dropped = rt, RequestSlots(3), 0
    ctx = {r: rng.integers(2, V, 150).tolist() for r in "abc"}
    p._slot_of.sync(["a", "b"])
    draft_round(rt, [0, 1], [ctx["a"], ctx["b"]], rng)  # 14 pages each
    p._slot_of.sync(["a", "c"])  # b is preempted: it keeps slot 1 and its pages
    slots, lens = np.array([0, 2]), np.array([150, 150])
    assert rt.fits(slots, lens).tolist() == [True, False]
    assert p._rows_that_fit(["a", "c"], slots, lens).tolist() == [True, True]
    assert p._caches_dropped == 1 and rt.kv.held[1] == 0 and p._slot_of.get("b") == 1
    out, drafts = draft_round(rt, [0, 2], [ctx["a"], ctx["c"]], rng)
    check_round(out, drafts, [ctx["a"], ctx["c"]], greedy, rt, [0, 2])
    # b returns (a finished): it drafts again, from a prefill of its whole context
    p._slot_of.finished(["a"])
    p._slot_of.sync(["b", "c"])
    rt.reset_slots([0])
    out, drafts = draft_round(rt, [1, 2], [ctx["b"], ctx["c"]], rng)
    check_round(out, drafts, [ctx["b"], ctx["c"]], greedy, rt, [1, 2])
    assert out.row_prefills[0] >= 1


def test_prefill_grouped_by_cost_drafts_the_same(draft_path, greedy, device):
    """New prompts of very different lengths: with a prefill curve where padding costs more
    than a forward (cost_model.prefill_groups splits them) the draft caches and drafts are
    those of one padded forward per pass, the draft model's greedy continuation; a flat curve
    keeps one forward. Chunks of 64 tokens: the long prompt takes several passes."""
    from vllm_ouroboros.cost_model import CostCurve

    rng = np.random.default_rng(31)
    V = DraftModel.from_pretrained(draft_path, dtype=torch.float32, device=device).vocab_size
    contexts = [rng.integers(2, V, n).tolist() for n in (300, 30, 150, 40)]
    slots = [0, 1, 2, 3]
    runs = {}
    for name, curve in (("one", None), ("flat", CostCurve((1, 512), (1.0, 1.0))),
                        ("linear", CostCurve((1, 2), (0.001, 0.002)))):
        rt, _ = make_runtime(draft_path, device, num_slots=4, prefill_chunk=64)
        rt.prefill_cost = curve
        out, drafts = draft_round(rt, slots, contexts, np.random.default_rng(0))
        check_round(out, drafts, contexts, greedy, rt, slots)
        runs[name] = out, drafts, rt.cached[:4].copy(), rt.kv_len[:4].copy()
    for name in ("flat", "linear"):
        assert runs[name][1] == runs["one"][1]
        assert (runs[name][2] == runs["one"][2]).all() and (runs[name][3] == runs["one"][3]).all()
    one, flat, linear = (runs[n][0] for n in ("one", "flat", "linear"))
    assert flat.prefill_forwards == one.prefill_forwards == 5  # ceil(299 / 64) passes
    assert linear.prefill_forwards > one.prefill_forwards
    assert (linear.row_prefills == one.row_prefills).all()
    # What the back-off calibrates with: every prefill forward's padded size, and their time.
    assert len(one.prefill_sizes) == one.prefill_forwards and one.prefill_sizes[0] == 4 * 64
    assert len(linear.prefill_sizes) == linear.prefill_forwards
    assert sum(linear.prefill_sizes) < sum(one.prefill_sizes)  # less padding
    assert one.prefill_seconds > 0 and linear.prefill_seconds > 0
    # A round with nothing to prefill reports none.
    rt, _ = make_runtime(draft_path, device, num_slots=1)
    out, _ = draft_round(rt, [0], [contexts[1][:10]], np.random.default_rng(0))
    assert out.prefill_forwards == 0 and out.prefill_sizes == () and out.prefill_seconds == 0.0


def test_a_prefill_beside_a_long_prompt_stays_inside_a_full_rows_pages(draft_path, greedy, device):
    """One eager prefill forward pads its rows to the longest (a new prompt's 500 tokens); a
    request near max_model_len catching up in the same pass would have been padded past its
    block table (the forward failed: "The size of tensor a ... must match"). It takes its own
    forward; the caches and drafts are the draft model's, as ever."""
    rng = np.random.default_rng(5)
    rt, _ = make_runtime(draft_path, device, num_slots=2)
    V = rt.model.vocab_size
    near_end = rng.integers(2, V, MAX_LEN - 10).tolist()
    draft_round(rt, [0], [near_end[:150]], rng)  # cached up to ~150 tokens
    contexts = [near_end, rng.integers(2, V, 500).tolist()]
    assert int(rt.kv_len[0]) + 499 > rt.kv.max_seq_len  # one padded forward would overrun row 0
    out, drafts = draft_round(rt, [0, 1], contexts, rng)
    check_round(out, drafts, contexts, greedy, rt, [0, 1])
    assert out.prefill_forwards == 2 and out.row_prefills.tolist() == [1, 1]


def test_slots_grow_geometrically(draft_path, greedy, device):
    """A slot above the runtime's rows grows them to twice as many (at least the slot): each
    growth reallocates the window and block table and drops every captured graph, so growing
    by one per new concurrency peak would recapture them all at every new request."""
    rng = np.random.default_rng(3)
    rt, _ = make_runtime(draft_path, device, num_slots=2)
    V = rt.model.vocab_size
    contexts = {s: rng.integers(2, V, 20).tolist() for s in range(9)}
    gens = []
    for top in range(2, 9):
        out, drafts = draft_round(rt, list(range(top + 1)), [contexts[s] for s in range(top + 1)], rng)
        check_round(out, drafts, [contexts[s] for s in range(top + 1)], greedy, rt, list(range(top + 1)))
        gens.append(rt.generation)
    assert rt._slots == 16 and rt.pad_slot == 16 and rt.kv.num_seqs >= 17
    assert len(set(gens)) == 3  # 2 -> 4 -> 8 -> 16 slots: three growths for slots 2..8
    capped, _ = make_runtime(draft_path, device, num_slots=2)
    capped.max_slots = 6  # max_num_seqs: the doubling stops there
    for top in (2, 4, 5):
        draft_round(capped, list(range(top + 1)), [contexts[s] for s in range(top + 1)], rng)
    assert capped._slots == 6
