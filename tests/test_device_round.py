"""The fixed-shape drafting round (draft/device_round.py) against the host loop it replaces.

Two runtimes over the same draft model weights, one drafting with the host loop and one with the
device round, go through the same rounds: a simulated target accepts a random prefix of each
draft (or all of it plus a bonus), phrases are seeded into both pools alike, some requests sit a
round out, a slot is reset and reused. With F at its bound the device round must give the same
drafts, counters, suffixes, slot bookkeeping and pool, token for token. A counting hook asserts
that nothing inside the round reads a tensor back to the host.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_ouroboros import LOGGER_NAME
from vllm_ouroboros.draft import DraftModel
from vllm_ouroboros.draft.device_round import DeviceRound
from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings
from vllm_ouroboros.pool import PhrasePool

from conftest import import_kernel_module
from tiny_models import acceptance_head

# Imported before anything here imports triton, so that Triton's interpreter can run the pool's
# kernels where there is no CUDA device (test_device_round_with_the_pool_kernels).
pi = import_kernel_module("vllm_ouroboros.kernels.pool_insert")
import_kernel_module("vllm_ouroboros.kernels.pool_lookup")
rs = import_kernel_module("vllm_ouroboros.kernels.round_steps")
import_kernel_module("vllm_ouroboros.kernels.tree_attention")

GAMMA, BETA, W, G, K = 4, 4, 3, 3, 2
L = BETA - 1
MAX_LEN = 400
CONTEXT_LENS = [1, 3, 70, 17, 9, 5]

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = {
    "phrases": dict(),
    "decode-only": dict(use_lookahead=False, use_guesses=False),
    "guesses-only": dict(use_lookahead=False),
    "window-only": dict(use_guesses=False),
    "no-suffixes": dict(num_suffixes=0),
    "adaptive": dict(draft_length="adaptive", acceptance_threshold=0.5, max_draft_length=7),
}


def make(draft_path, device, draft_round, shared=True, pool_kernels="auto", **kw):
    model = DraftModel.from_pretrained(draft_path, dtype=torch.float32, device=device)
    V = model.vocab_size
    pool = PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, 48), device=device, shared=shared,
                      kernels=pool_kernels)
    settings = DraftSettings(**{**dict(gamma=GAMMA, beta=BETA, window_size=W, num_guesses=G,
                                       num_suffixes=K, draft_round=draft_round), **kw})
    head = acceptance_head(model.hidden_size).to(device) if kw.get("draft_length") == "adaptive" else None
    return DraftRuntime(model, pool, settings, 2, MAX_LEN, device, head=head)


def table(contexts, rng):
    order = rng.permutation(len(contexts))
    tab = np.full((len(contexts), max(len(c) for c in contexts) + 3), -7, np.int64)
    for c, r in zip(contexts, order):
        tab[r, :len(c)] = c
    return tab, order.astype(np.int64), np.array([len(c) for c in contexts], np.int64)


def pool_view(pool: PhrasePool, slots) -> list:
    """What a reader can see of the pool: every key's phrases, ranked, for every owner."""
    V = pool.vocab_size
    keys = torch.arange(V, device=pool.device).repeat(len(slots))
    owners = torch.tensor(slots, device=pool.device).repeat_interleave(V)
    before = pool.counters.clone(), pool.page_last_used.clone(), pool.clock.clone()
    phr, valid = pool.lookup(keys, owners, pool.W)
    pool.counters.copy_(before[0]), pool.page_last_used.copy_(before[1]), pool.clock.copy_(before[2])
    return [phr.cpu(), valid.cpu(), pool.page_key.cpu(), pool.owner.cpu(), pool.counters.cpu()]


def compare(a, b, what):
    for name in ("drafts", "draft_lens", "suffixes", "suffix_valid", "row_forwards", "guess_tokens",
                 "guess_hit_forwards", "row_prefills", "prefill_forwards", "stopped_by_rule"):
        x, y = getattr(a, name), getattr(b, name)
        if name == "drafts":
            x = [r[:n].tolist() for r, n in zip(x, a.draft_lens)]
            y = [r[:n].tolist() for r, n in zip(y, b.draft_lens)]
            assert x == y, f"{what}: drafts differ: {x} vs {y}"
        else:
            assert np.array_equal(np.asarray(x), np.asarray(y)), f"{what}: {name} differs: {x} vs {y}"


def drive(runtimes, rounds, rng, V, forwards_check=None, cuts=None):
    """Run `runtimes` (host first) through the same rounds; yields (outputs, live contexts).
    cuts: per runtime, a function of the round index giving its max_tokens (None: no cut)."""
    slots = [4, 0, 7, 2, 5, 1]
    contexts = [rng.integers(2, V, n).tolist() for n in CONTEXT_LENS]
    for r in range(rounds):
        live = [b for b in range(len(slots)) if rng.random() > 0.15] or [0]
        ctx = [contexts[b] for b in live]
        tab, rows, lens = table(ctx, rng)
        s = np.array([slots[b] for b in live], np.int64)
        outs = [rt.run_round(s, tab, rows, lens, max_tokens=None if cuts is None else cuts[i](r))
                for i, rt in enumerate(runtimes)]
        yield outs, s
        for i, b in enumerate(live):
            d = outs[0].drafts[i, :outs[0].draft_lens[i]].tolist()
            if rng.random() < 0.25:
                contexts[b] = contexts[b] + d + [int(rng.integers(2, V))]
            else:
                k = int(rng.integers(len(d)))
                contexts[b] = contexts[b] + d[:k] + [(d[k] + 1 + int(rng.integers(V - 3))) % (V - 2) + 2]
            if rng.random() < 0.5:  # a phrase for the new last token, as the feedback writers add
                key = torch.tensor([contexts[b][-1]])
                phrase = torch.from_numpy(rng.integers(2, V, (1, L)))
                owner = torch.tensor([slots[b] if rng.random() < 0.7 else -1])
                for rt in runtimes:
                    rt.pool.insert(key, phrase, owner)
        for b in set(range(len(slots))) - set(live):
            contexts[b] = contexts[b] + rng.integers(2, V, 3).tolist()
        if r == rounds // 2:  # a request ends; its slot is reused by a new one
            for rt in runtimes:
                rt.reset_slots([slots[1]])
                rt.pool.release(torch.tensor([slots[1]]))
            contexts[1] = rng.integers(2, V, 40).tolist()


def test_device_round_with_the_pool_kernels(tiny_models, device, request):
    """The round's inserts through kernels/pool_insert.py (as a CUDA device runs them; here under
    Triton's interpreter) leave every table of the pool as the torch insert does, the round's
    drafts included."""
    why = pi.pick_kernel(pi.place_kernel, torch.device(device), pi._TRITON_IMPORT_ERROR)[1]
    if why is not None:
        pytest.skip(f"Triton cannot run the pool's kernels in this process: {why}")
    request.getfixturevalue("triton_interpreter")
    path = str(tiny_models["draft"])
    ref = make(path, device, "device", round_forwards=99, pool_kernels="torch")
    got = make(path, device, "device", round_forwards=99, pool_kernels="triton")
    assert got.pool.insert_backend == got.pool.lookup_backend == "triton"
    rng = np.random.default_rng(11)
    for outs, _ in drive([ref, got], 6, rng, ref.model.vocab_size):
        compare(outs[0], outs[1], "pool kernels")
        for name in ("key_to_page", "page_key", "page_last_used", "tokens", "stamp", "owner", "counters", "clock"):
            assert torch.equal(getattr(ref.pool, name), getattr(got.pool, name)), name
    assert ref.pool.num_phrases() > 0


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_device_round_with_the_round_kernels(config, tiny_models, device, request):
    """The work around each forward through kernels/round_steps.py (as a CUDA device runs it;
    here under Triton's interpreter) gives the torch path's drafts, counters, windows, cache
    bookkeeping and pool, token for token. Both attend through the same path (the tree-attention
    kernel on CUDA, SDPA on a CPU, from the prepared bitmasks). Adaptive rounds prepare in the
    kernel and commit in torch."""
    why = rs.pick_kernel(rs.commit_kernel, torch.device(device), rs._TRITON_IMPORT_ERROR)[1]
    if why is not None:
        pytest.skip(f"Triton cannot run the round's kernels in this process: {why}")
    request.getfixturevalue("triton_interpreter")
    path, kw = str(tiny_models["draft"]), CONFIGS[config]
    ref = make(path, device, "device", round_forwards=99, round_kernels="torch", **kw)
    got = make(path, device, "device", round_forwards=99, round_kernels="triton", **kw)
    assert got.device_round.kernels == "triton" and ref.device_round.kernels == "torch"
    assert (got.device_round._commit is None) == (config == "adaptive")
    prepared = []
    real_prepare = got.device_round._prepare
    got.device_round._prepare = lambda *a: prepared.append(1) or real_prepare(*a)
    rng = np.random.default_rng(23 + sorted(CONFIGS).index(config))
    for outs, slots in drive([ref, got], 5, rng, ref.model.vocab_size):
        compare(outs[0], outs[1], config)
        assert np.array_equal(ref.kv_len[slots], got.kv_len[slots])
        for s in slots:
            assert torch.equal(ref.window[s], got.window[s])
        for a, b in zip(pool_view(ref.pool, [-1, *slots.tolist()]), pool_view(got.pool, [-1, *slots.tolist()])):
            assert torch.equal(a, b), config
    assert prepared, "no forward went through the prepared inputs"


def test_round_kernels_refuse_where_triton_cannot_run(tiny_models, device, monkeypatch):
    """round_kernels='triton' where Triton cannot run raises, saying why (the pool's kernels
    too); 'auto' on a CPU and 'torch' keep the torch path; a bad name is refused."""
    from vllm_ouroboros.kernels import triton_runtime

    path = str(tiny_models["draft"])
    assert make(path, device, "device", round_kernels="torch").device_round.kernels == "torch"
    if device == "cpu":
        assert make(path, device, "device").device_round.kernels == "torch"
    with pytest.raises(ValueError, match="round_kernels must be"):
        make(path, device, "device", round_kernels="cuda")
    # Where Triton cannot run (no triton, or no interpreter): asked for, refused rather than
    # quietly left on the torch path.
    monkeypatch.setattr(triton_runtime, "pick_kernel", lambda *a: (None, "no triton (test)"))
    with pytest.raises(ValueError, match="round_kernels.*cannot run here: no triton"):
        make(path, device, "device", round_kernels="triton")
    with pytest.raises(ValueError, match="cannot run here: no triton"):
        PhrasePool(20, 2, 2, PhrasePool.budget_for(20, 2, 2, 4), device=device, kernels="triton")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_device_round_equals_the_host_loop(config, tiny_models, device):
    path = str(tiny_models["draft"])
    kw = CONFIGS[config]
    # F pinned at its bound (forwards that always suffice); by default it adapts to recent rounds.
    host, dev = make(path, device, "host", **kw), make(path, device, "device", round_forwards=99, **kw)
    V = host.model.vocab_size
    rng = np.random.default_rng(sorted(CONFIGS).index(config))
    for outs, slots in drive([host, dev], 10, rng, V):
        compare(outs[0], outs[1], config)
        assert outs[1].forwards == dev.device_round.max_forwards
        assert np.array_equal(host.kv_len[slots], dev.kv_len[slots])
        for s in slots:
            n = int(host.kv_len[s])
            assert host.cached[s, :n].tolist() == dev.cached[s, :n].tolist()
            assert torch.equal(host.window[s], dev.window[s])
        for a, b in zip(pool_view(host.pool, [-1, *slots.tolist()]),
                        pool_view(dev.pool, [-1, *slots.tolist()])):
            assert torch.equal(a, b), config
    if config == "adaptive":
        assert outs[1].stopped_by_rule is not None


def test_a_cut_at_the_round_length_or_above_is_the_host_loops(tiny_models, device):
    """The back-off's cut (max_tokens) at gamma or above: the device round ends each draft where
    the host loop does (its last forward takes no token past the cut), with the same counters,
    suffixes (looked up after the draft's last token), caches, windows and pool."""
    path = str(tiny_models["draft"])
    host, dev = make(path, device, "host"), make(path, device, "device", round_forwards=99)
    V = host.model.vocab_size
    rng = np.random.default_rng(11)
    plan = [GAMMA, GAMMA + 1, None, GAMMA + 2, GAMMA, GAMMA + BETA, GAMMA + 1, GAMMA]
    cut = lambda r: plan[r % len(plan)]  # noqa: E731
    binding = 0
    for r, (outs, slots) in enumerate(drive([host, dev], len(plan), rng, V, cuts=[cut, cut])):
        compare(outs[0], outs[1], f"cut {cut(r)}")
        if cut(r) is not None:
            assert (outs[1].draft_lens <= cut(r)).all()
            binding += int((outs[1].draft_lens == cut(r)).sum())
        assert np.array_equal(host.kv_len[slots], dev.kv_len[slots])
        for a, b in zip(pool_view(host.pool, [-1, *slots.tolist()]),
                        pool_view(dev.pool, [-1, *slots.tolist()])):
            assert torch.equal(a, b), f"cut {cut(r)}"
    assert binding > 0, "no cut bound a draft"


def test_a_chain_is_drafted_only_within_the_forward_bound(tiny_models, device):
    """max_draft_forwards below the round's room: a cut the forward bound lets a chain reach is
    drafted as a chain (one token a forward, exactly the cut); a longer one as the round drafts,
    as the device round does (a chain stopped at the bound, short of the cut)."""
    path = str(tiny_models["draft"])
    host = make(path, device, "host", max_draft_forwards=2)
    dev = make(path, device, "device", round_forwards=99, max_draft_forwards=2)
    assert host.chain_below == 3 and host.drafts_chain(2) and not host.drafts_chain(3)
    V = host.model.vocab_size
    three = lambda r: 3  # noqa: E731
    for (a, b), _ in drive([host, dev], 6, np.random.default_rng(13), V, cuts=[three, three]):
        compare(a, b, "cut 3")
    chain = make(path, device, "host", max_draft_forwards=2)
    two = lambda r: 2  # noqa: E731
    for (a,), _ in drive([chain], 4, np.random.default_rng(14), V, cuts=[two]):
        assert (a.draft_lens == 2).all() and (a.row_forwards == 2).all() and (a.guess_tokens == 0).all()


@pytest.mark.parametrize("config", ["phrases", "adaptive"])
def test_a_cut_below_the_round_length_ends_the_draft_there(config, tiny_models, device):
    """A cut below gamma (below max_draft_length in adaptive mode): the host loop drafts a chain
    (no window or guesses), the device round keeps its shapes; both draft the model's greedy
    tokens and end at the cut, and the device round's suffixes are the pool's after the draft
    it sends (so that they follow it: proposal_layout.py)."""
    path, kw = str(tiny_models["draft"]), CONFIGS[config]
    host, dev = make(path, device, "host", **kw), make(path, device, "device", round_forwards=99, **kw)
    V = host.model.vocab_size
    rng = np.random.default_rng(12)
    top = dev.s.draft_room
    cuts = [lambda r: None, lambda r: 1 + r % (top - 1)]
    seen, found = set(), 0
    for r, ((a, b), slots) in enumerate(drive([host, dev], 8, rng, V, cuts=cuts)):
        c = cuts[1](r)
        assert (b.draft_lens >= 1).all() and (b.draft_lens <= c).all(), (c, b.draft_lens)
        if config == "phrases":  # the host loop's whole draft is gamma or more tokens long
            assert (b.draft_lens == c).all(), (c, b.draft_lens)
        for i, n in enumerate(b.draft_lens):
            assert b.drafts[i, :n].tolist() == a.drafts[i, :n].tolist(), (c, i)
            seen.add(int(n))
        last = torch.tensor(b.drafts[np.arange(len(slots)), b.draft_lens - 1], device=dev.device)
        owners = torch.tensor(slots, device=dev.device)
        pool = dev.pool
        before = pool.counters.clone(), pool.page_last_used.clone(), pool.clock.clone()
        phr, valid = pool.lookup(last, owners, K)
        pool.counters.copy_(before[0]), pool.page_last_used.copy_(before[1]), pool.clock.copy_(before[2])
        assert np.array_equal(valid.cpu().numpy(), b.suffix_valid), c
        assert np.array_equal(np.where(b.suffix_valid[..., None], phr.cpu().numpy(), 0),
                              np.where(b.suffix_valid[..., None], b.suffixes, 0)), c
        found += int(b.suffix_valid.sum())
    assert len(seen) > 1 and found > 0, (seen, found)


def test_fewer_forwards_draft_a_prefix(tiny_models, device):
    """With F = 1 every row drafts what the host loop's first forward gives: a prefix of its
    draft (shorter, still the draft model's own continuation); F adapts back up."""
    path = str(tiny_models["draft"])
    host, dev = make(path, device, "host"), make(path, device, "device", round_forwards=1)
    V = host.model.vocab_size
    rng = np.random.default_rng(7)
    for (a, b), _ in drive([host, dev], 4, rng, V):
        assert b.forwards == 1 and (b.row_forwards == 1).all()
        for i in range(len(a.draft_lens)):
            assert 1 <= b.draft_lens[i] <= a.draft_lens[i]
            assert b.drafts[i, :b.draft_lens[i]].tolist() == a.drafts[i, :b.draft_lens[i]].tolist()
        break
    dr = dev.device_round
    dr._recent = [dr.max_forwards + 1] * 3
    assert dr.forwards_for_next_round() == dr.max_forwards
    dr._recent = [2, 1]
    assert dr.forwards_for_next_round() == 2


def test_rounds_the_cut_shortened_do_not_shorten_the_next_whole_round(tiny_models, device):
    """Without early exit F follows what recent rounds needed: a round the back-off cut ran as
    many forwards as its cut needed, not its rows, so it says nothing of F (it set F to the cut
    and the next whole round drafted one token of gamma). F below 1 runs one forward, said so."""
    path = str(tiny_models["draft"])
    rt = make(path, device, "device", **CONFIGS["decode-only"])
    dr = rt.device_round
    assert not dr.early_exit
    rng = np.random.default_rng(3)
    context = rng.integers(2, rt.model.vocab_size, 30).tolist()
    slots = np.zeros(1, np.int64)
    for cut in [1] * 4 + [None]:
        out = rt.run_round(slots, np.array([context]), slots, np.array([len(context)]), None, cut)
        context += out.drafts[0, :out.draft_lens[0]].tolist() + [int(rng.integers(2, rt.model.vocab_size))]
    assert out.forwards == GAMMA and out.draft_lens[0] == GAMMA, (out.forwards, dr._recent)
    out = rt.run_round(slots, np.array([context]), slots, np.array([len(context)]), 0)
    assert out.forwards == 1 and out.row_forwards[0] == 1


@pytest.mark.parametrize("config", ["decode-only", "window-only", "phrases", "adaptive"])
def test_later_forwards_carry_what_one_forward_drafts(config, tiny_models, device):
    """Every forward after a round's first carries as many uncached columns as a forward may
    draft: one without guesses (t1 alone), L + 1 with them; each forward's width is that plus
    the window and guess columns. Without guesses L padding columns per row would otherwise
    ride in every decode forward. The drafts stay the host loop's (the other tests)."""
    kw = CONFIGS[config]
    host, dev = make(str(tiny_models["draft"]), device, "host", **kw), \
        make(str(tiny_models["draft"]), device, "device", round_forwards=99, **kw)
    dr, model = dev.device_round, dev.model
    Wc = W if kw.get("use_lookahead", True) else 0
    Gc = G if kw.get("use_guesses", True) else 0
    assert dr.step_width == (L + 1 if Gc else 1)
    widths: list[list[int]] = []
    real_run, real_forward = dr.run, model.forward

    def run(*a, **k):  # the round's forwards (the prefill before it is the runtime's)
        widths.append([])
        model.forward = lambda ids, *fa, **fk: widths[-1].append(ids.shape[1]) or real_forward(ids, *fa, **fk)
        try:
            return real_run(*a, **k)
        finally:
            model.forward = real_forward

    dr.run = run
    # The old shape (bench_gpu times it beside): L + 1 columns, the same drafts.
    padded = make(str(tiny_models["draft"]), device, "device", round_forwards=99, **kw)
    padded.device_round = DeviceRound(padded, padded_steps=True)
    assert padded.device_round.step_width == L + 1
    for outs, _ in drive([host, dev, padded], 3, np.random.default_rng(5), model.vocab_size):
        compare(outs[0], outs[1], config)
        compare(outs[0], outs[2], config + ", padded steps")
    assert len(widths) == 3
    for per_round in widths:
        assert len(per_round) == dr.max_forwards > 1
        assert per_round[1:] == [dr.step_width + (Wc + Gc) * L] * (dr.max_forwards - 1), per_round


aten = torch.ops.aten
# ATen ops that read the device from the host on a GPU (a scalar read, an output whose shape
# depends on the data) or copy host data to the device (illegal inside a CUDA graph capture),
# whoever calls them: Python code or another op's implementation.
SYNCING_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_numpy.default,
               aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
               aten.unique_consecutive.default, aten.bincount.default, aten.equal.default,
               aten.is_nonzero.default, aten.allclose.default, aten.lift_fresh.default}
INDEXING_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                aten._index_put_impl_.default}


class _SyncingOps(TorchDispatchMode):
    """Counts the ATen calls of SYNCING_OPS, boolean-mask indexing (a nonzero on a GPU) and
    repeat_interleave by a tensor without output_size (its length is read back)."""

    def __init__(self, counts: dict):
        super().__init__()
        self.counts = counts

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING_OPS:
            self._count(str(func))
        elif func in INDEXING_OPS and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self._count(f"{func} by a bool mask")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self._count(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_reads(counts: dict):
    """Count every way the code can read a tensor back to the host (a device sync on a GPU) or
    copy host data in: at the Python level item/tolist/cpu/numpy, bool/int/float/index
    conversions, data-dependent shapes and boolean indexing; and at the ATen level the same
    ops wherever they are called from (`_SyncingOps`)."""
    patched = {}

    def hook(cls, name):
        orig = getattr(cls, name)

        def counted(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return orig(*a, **k)

        patched[(cls, name)] = orig
        setattr(cls, name, counted)

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
                 "nonzero", "unique", "masked_select", "__array__"):
        hook(torch.Tensor, name)
    for name in ("nonzero", "unique", "masked_select", "argwhere"):
        hook(torch, name)
    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def bool_index(idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)

    def get(self, idx):
        if bool_index(idx):
            counts["bool index"] = counts.get("bool index", 0) + 1
        return getitem(self, idx)

    def set_(self, idx, value):
        if bool_index(idx):
            counts["bool index"] = counts.get("bool index", 0) + 1
        return setitem(self, idx, value)

    torch.Tensor.__getitem__, torch.Tensor.__setitem__ = get, set_
    try:
        with _SyncingOps(counts):
            yield counts
    finally:
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem
        for (cls, name), orig in patched.items():
            setattr(cls, name, orig)


@pytest.mark.parametrize("config", ["phrases", "adaptive"])
def test_no_host_read_inside_a_round(config, tiny_models, device):
    """Nothing between the round's input copy and its one output copy reads the device: the
    first forward, every later one and the suffix lookup (what a CUDA graph captures)."""
    dev = make(str(tiny_models["draft"]), device, "device", **CONFIGS[config])
    dr = dev.device_round
    inside: dict = {}
    wrapped = {}
    for name in ("_start", "_step", "_finish"):
        orig = getattr(dr, name)

        def run(*a, _orig=orig, **k):
            with no_host_reads(inside):
                return _orig(*a, **k)

        wrapped[name] = run
    for name, fn in wrapped.items():
        setattr(dr, name, fn)
    outer: dict = {}
    orig_cpu = torch.Tensor.cpu
    V = dev.model.vocab_size
    rng = np.random.default_rng(3)
    calls = 0
    for _ in drive([dev], 3, rng, V):
        calls += 1
    assert calls == 3
    assert inside == {}, f"host reads inside the round: {inside}"
    # The hook itself catches a read: it is not vacuous.
    with no_host_reads(outer):
        torch.ones(2, device=device).sum().item()
        x = torch.arange(3, device=device)
        x[x > 0]
        torch.where(x > 0)  # no Python-level hook sees these three
        x.repeat_interleave(x)
        x[1:] = torch.tensor([5, 6])
    assert outer.get("item") == 1 and outer.get("bool index") == 1
    assert outer.get(str(aten._local_scalar_dense.default)) == 1
    assert outer.get(str(aten.nonzero.default)) == 1, outer
    assert outer.get(str(aten.repeat_interleave.Tensor)) == 1
    assert outer.get(str(aten.lift_fresh.default)) == 1
    assert outer.get(f"{aten.index.Tensor} by a bool mask") == 1
    assert torch.Tensor.cpu is orig_cpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("recapture", [False, True], ids=["captured-once", "recaptured"])
@pytest.mark.parametrize("config", ["phrases", "adaptive"])
def test_graph_replay_equals_eager_device_round(config, recapture, tiny_models, device):
    """Captured and replayed (graph) vs run eagerly (device): the same rounds, some cut by the
    back-off (the cut goes in with the inbox). "recaptured": graphs that read 48 cache tokens
    per row, so the 70-token context drops them and captures again in a new memory pool (torch
    asserts on a capture into a pool whose graphs were all freed: the first H200 run crashed
    there)."""
    if device != "cuda":
        pytest.skip("the test device is not CUDA (OUROBOROS_TEST_DEVICE)")
    path = str(tiny_models["draft"])
    eager = make(path, device, "device", round_forwards=99, **CONFIGS[config])
    graph = make(path, device, "graph", round_forwards=99, **CONFIGS[config])
    dr = graph.device_round
    if recapture:
        dr.bounds.graph_len = 48
        assert dr.capture([1, 3]) > 0  # graphs in the pool before the drop
    V = eager.model.vocab_size
    rng = np.random.default_rng(5)
    cut = lambda r: (None, 2, GAMMA + 1, 1)[r % 4]  # noqa: E731
    for (a, b), slots in drive([eager, graph], 8, rng, V, cuts=[cut, cut]):
        compare(a, b, config)
        assert np.array_equal(eager.kv_len[slots], graph.kv_len[slots])
    assert dr._states and all(st.graphs for st in dr._states.values())
    if recapture:
        assert dr.bounds.graph_len >= 128, "the graphs were never captured again"


def _syncs(fn):
    """(fn(), the CUDA synchronisations it made) under torch's sync debug mode "warn", which
    warns at every host-device synchronisation (blocking copies, item(), stream waits)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations: needs a CUDA device")
@pytest.mark.parametrize("config", ["phrases", "adaptive"])
def test_graph_round_synchronises_once(config, tiny_models, device):
    """The issue's "no host synchronisation inside the round, one device->host copy per round at
    most", counted by CUDA itself: a graph round whose graphs are captured (no capture, no
    cache regrowth, no prefill in it) synchronises at most once, where the host loop, the
    counter's check, synchronises at every forward. A round that prefills first (eager, which
    the issue allows; timed by CUDA events read after the round's copy) adds no more than one
    per prefill forward."""
    if device != "cuda":
        pytest.skip("the test device is not CUDA (OUROBOROS_TEST_DEVICE)")
    path = str(tiny_models["draft"])
    host = make(path, device, "host", **CONFIGS[config])
    graph = make(path, device, "graph", round_forwards=99, **CONFIGS[config])
    dr = graph.device_round
    runs = {"host": [], "graph": []}
    prefills = {"host": [], "graph": []}  # (prefill forwards, syncs) of rounds that prefilled
    for rt, name in ((host, "host"), (graph, "graph")):
        orig = rt.run_round

        def counted(*a, _orig=orig, _name=name, _rt=rt, **k):
            captured = lambda: (_rt.generation, sum(len(st.graphs) for st in dr._states.values()))  # noqa: E731
            before = captured()
            out, syncs = _syncs(lambda: _orig(*a, **k))
            same_graphs = _name == "host" or captured() == before
            runs[_name].append((out.prefill_forwards == 0 and same_graphs, syncs, out.forwards))
            if out.prefill_forwards and same_graphs:
                prefills[_name].append((out.prefill_forwards, syncs))
            return out

        rt.run_round = counted
    rng = np.random.default_rng(23)
    for _ in drive([host, graph], 10, rng, host.model.vocab_size):
        pass
    steady = [syncs for ok, syncs, _ in runs["graph"][3:] if ok]
    assert steady, "no steady-state graph round to count"
    assert all(len(s) <= 1 for s in steady), steady
    host_steady = [(len(syncs), f) for ok, syncs, f in runs["host"] if ok]
    assert host_steady and all(n >= f for n, f in host_steady), host_steady
    assert prefills["graph"], "no graph round with a prefill to count"
    assert all(len(syncs) <= 1 + p for p, syncs in prefills["graph"]), prefills["graph"]


@pytest.mark.parametrize("early_exit", [True, False], ids=["early-exit", "fixed-F"])
@pytest.mark.parametrize("config", ["phrases", "adaptive"])
def test_capture_and_replay_bookkeeping(config, early_exit, tiny_models, device):
    """The graph path's orchestration on any machine, with recorded stand-ins for CUDA graphs
    (a capture records, a replay runs): captures happen on a neutral state before a round's
    inputs go in, lazily per width bucket and batch bucket and ahead of time via capture(), and
    are dropped when the cache is reallocated; the rounds equal the host loop's. With early
    exit the round runs the forwards the host loop ran (the host evaluates the conditions a
    conditional node would); without, all F."""
    from vllm_ouroboros.draft.device_round import DeviceRound

    path = str(tiny_models["draft"])
    host = make(path, device, "host", **CONFIGS[config])
    rec = make(path, device, "device", round_forwards=99, **CONFIGS[config])
    rec.device_round = DeviceRound(rec, graphs=True, emulate_graphs=True, early_exit=early_exit)
    dr = rec.device_round
    # Graphs that read 48 cache tokens per row: the 70-token context needs more, a recapture.
    dr.bounds.graph_len = 48
    assert dr.capture([1, 3]) > 0  # ahead of time: buckets 1 and 4, all widths
    captured = {A: set(st.graphs) for A, st in dr._states.items()}
    rest = {"rest"} if early_exit else {"step", "finish"}
    assert set(captured) == {1, 4} and all(rest <= g for g in captured.values())
    assert not any({"step", "finish", "rest"} - rest & g for g in captured.values())
    V = host.model.vocab_size
    rng = np.random.default_rng(9)
    generations = {rec.generation}  # the first round adds slots: a new cache, graphs again
    for outs, slots in drive([host, rec], 10, rng, V):
        compare(outs[0], outs[1], config)
        assert outs[1].forwards == (outs[0].forwards if early_exit else dr.max_forwards)
        assert np.array_equal(host.kv_len[slots], rec.kv_len[slots])
        generations.add(rec.generation)
        assert dr.bounds.generation == rec.generation, "states and graphs kept from a moved cache"
    assert len(generations) > 1, "the cache never grew: the recapture path went untested"
    assert dr.bounds.graph_len >= 128  # doubled for the long context, then again
    assert all(st.graphs for st in dr._states.values())


def test_states_and_graphs_go_when_the_cache_moves(tiny_models, device):
    """A round's state and graphs hold the cache's and the window's addresses: after they are
    reallocated (more slots), the next round of that bucket builds a new state, with new
    graphs; until then the same state serves every round of the bucket."""
    from vllm_ouroboros.draft.device_round import DeviceRound

    rec = make(str(tiny_models["draft"]), device, "device", round_forwards=99)
    rec.device_round = dr = DeviceRound(rec, graphs=True, emulate_graphs=True)
    dr.capture([1])
    first = dr._state(1)
    assert first.graphs and dr._state(1) is first and dr.bounds.generation == rec.generation
    before = rec.generation
    rec._grow(rec._slots + 4)
    assert rec.generation != before
    again = dr._state(1)
    assert again is not first and not again.graphs and dr.bounds.generation == rec.generation


@pytest.mark.parametrize("graphs", ["emulated", "cuda"])
def test_early_exit_stops_where_rows_are_done(graphs, tiny_models, device):
    """Rows whose pool holds the draft's own continuation finish in one forward (a guess
    accepted whole): with early exit the round stops there, as the host loop does, where a
    fixed-F round runs all its F; all three draft the same. "cuda": real conditional nodes."""
    from vllm_ouroboros.draft.device_round import DeviceRound, conditional_nodes_supported

    if graphs == "cuda" and device != "cuda":
        pytest.skip("CUDA graph conditional nodes need the CUDA test device (OUROBOROS_TEST_DEVICE)")
    if graphs == "cuda" and not conditional_nodes_supported():
        pytest.skip(f"this torch ({torch.__version__}, CUDA {torch.version.cuda}) has no conditional nodes")
    path = str(tiny_models["draft"])
    probe, host = make(path, device, "host"), make(path, device, "host")
    fixed = make(path, device, "device", round_forwards=99)
    if graphs == "cuda":
        early = make(path, device, "graph", round_forwards=99)
        assert early.device_round.early_exit
    else:
        early = make(path, device, "device", round_forwards=99)
        early.device_round = DeviceRound(early, graphs=True, emulate_graphs=True, early_exit=True)
    rng = np.random.default_rng(17)
    V = host.model.vocab_size
    contexts = [rng.integers(2, V, n).tolist() for n in (5, 12, 30)]
    slots = np.arange(3, dtype=np.int64)
    mine = probe.run_round(slots, *table(contexts, rng))
    for rt in (host, fixed, early):  # each row's guess: what the draft drafts after its context
        rt.pool.insert(torch.tensor([c[-1] for c in contexts]),
                       torch.from_numpy(np.ascontiguousarray(mine.drafts[:, :L])),
                       torch.from_numpy(slots))
    tab = table(contexts, np.random.default_rng(1))
    a, b, c = (rt.run_round(slots, *tab) for rt in (host, fixed, early))
    compare(a, b, "fixed F")
    compare(a, c, "early exit")
    assert a.forwards == 1 and (a.guess_tokens == L).all(), "the guesses missed: nothing to exit early from"
    assert b.forwards == fixed.device_round.max_forwards > 1
    assert c.forwards == 1
    assert early.device_round.early_exit  # a capture that failed would have fallen back


@pytest.mark.parametrize("graphs", ["emulated", "cuda"])
def test_early_exit_stops_at_the_cut(graphs, tiny_models, device):
    """A round cut to c tokens (the back-off's shorter draft) with early exit runs at most c
    forwards (each drafts >= 1 token per row) and drafts the host loop's first c tokens; a
    fixed-F round runs min(F, the cut). "cuda": real conditional nodes."""
    from vllm_ouroboros.draft.device_round import DeviceRound, conditional_nodes_supported

    if graphs == "cuda" and device != "cuda":
        pytest.skip("CUDA graph conditional nodes need the CUDA test device (OUROBOROS_TEST_DEVICE)")
    if graphs == "cuda" and not conditional_nodes_supported():
        pytest.skip(f"this torch ({torch.__version__}, CUDA {torch.version.cuda}) has no conditional nodes")
    path = str(tiny_models["draft"])
    # Decode only: one token per forward, so an uncut round runs gamma forwards.
    kw = CONFIGS["decode-only"]
    host, fixed = make(path, device, "host", **kw), make(path, device, "device", round_forwards=99, **kw)
    if graphs == "cuda":
        early = make(path, device, "graph", round_forwards=99, **kw)
    else:
        early = make(path, device, "device", round_forwards=99, **kw)
        early.device_round = DeviceRound(early, graphs=True, emulate_graphs=True, early_exit=True)
    rng = np.random.default_rng(23)
    V = host.model.vocab_size
    contexts = [rng.integers(2, V, n).tolist() for n in (5, 12, 30)]
    slots = np.arange(3, dtype=np.int64)
    for c in (2, 1, None):
        tab = table(contexts, rng)
        a = host.run_round(slots, *tab)
        b, e = fixed.run_round(slots, *tab, max_tokens=c), early.run_round(slots, *tab, max_tokens=c)
        want = GAMMA if c is None else c
        assert (e.draft_lens == want).all() and (b.draft_lens == want).all(), (c, e.draft_lens, b.draft_lens)
        for i in range(len(slots)):
            assert e.drafts[i, :want].tolist() == a.drafts[i, :want].tolist() == b.drafts[i, :want].tolist()
        # the fixed-F round stops after the cut's forwards too: the rest would run with no row active
        assert e.forwards == want == b.forwards and fixed.device_round.max_forwards == GAMMA, (c, e.forwards)
        contexts = [ctx + a.drafts[i, :2].tolist() for i, ctx in enumerate(contexts)]
    assert early.device_round.early_exit


def test_failed_conditional_capture_falls_back_to_fixed_forwards(tiny_models, device, caplog):
    """A capture of the conditional nodes that fails (an old driver, a torch that refuses them)
    leaves the round on fixed-F graphs, logged, drafting the same."""
    from vllm_ouroboros.draft.device_round import DeviceRound

    path = str(tiny_models["draft"])
    host = make(path, device, "host")
    rec = make(path, device, "device", round_forwards=99)
    rec.device_round = dr = DeviceRound(rec, graphs=True, emulate_graphs=True, early_exit=True)
    capture = dr._capture

    def failing(st, name, U):
        if name == "rest":
            raise RuntimeError("CUDA Graphs conditional nodes are not supported (test)")
        capture(st, name, U)

    dr._capture = failing
    log = logging.getLogger(LOGGER_NAME)  # vLLM's logging config may stop it propagating
    log.addHandler(caplog.handler)
    try:
        for (a, b), _ in drive([host, rec], 3, np.random.default_rng(19), host.model.vocab_size):
            compare(a, b, "fallback")
            assert b.forwards == dr.max_forwards
    finally:
        log.removeHandler(caplog.handler)
    assert not dr.early_exit and "conditional nodes failed" in caplog.text
    assert all({"step", "finish"} <= set(st.graphs) and "rest" not in st.graphs for st in dr._states.values())


def test_early_exit_keeps_a_forward_limit(tiny_models, device):
    """With early exit a round given F forwards still stops at F (the limit rides in the inbox):
    the same drafts as the fixed-F round of that F."""
    from vllm_ouroboros.draft.device_round import DeviceRound

    path = str(tiny_models["draft"])
    fixed, early = (make(path, device, "device", round_forwards=2) for _ in range(2))
    early.device_round = DeviceRound(early, graphs=True, emulate_graphs=True, early_exit=True)
    V = fixed.model.vocab_size
    rng = np.random.default_rng(11)
    for (a, b), _ in drive([fixed, early], 4, rng, V):
        compare(a, b, "F = 2")
        assert a.forwards == 2 and b.forwards == int(b.row_forwards.max()) <= 2


def test_conditions_read_nothing(tiny_models, device):
    """What a conditional node is given: a 0-dim bool tensor on the draft's device, computed
    without reading the device (as the rest of the round); and the round after the first
    forward reads nothing either."""
    from vllm_ouroboros.draft.device_round import DeviceRound

    path = str(tiny_models["draft"])
    rt = make(path, device, "device", round_forwards=99)
    rt.device_round = dr = DeviceRound(rt, graphs=True, emulate_graphs=True)
    V = rt.model.vocab_size
    for _ in drive([rt], 2, np.random.default_rng(13), V):
        pass
    preds = []

    def when(pred, fn):
        preds.append(pred)
        fn()

    st = next(iter(dr._states.values()))
    inside: dict = {}
    with no_host_reads(inside):
        dr._rest(st, dr.bounds.graph_len, when)
    assert inside == {}, f"host reads in the conditional steps: {inside}"
    assert len(preds) == dr.max_forwards - 1
    assert all(p.dtype == torch.bool and p.dim() == 0 and p.device.type == rt.device.type for p in preds)


def test_early_exit_needs_graphs(tiny_models):
    from vllm_ouroboros.draft.device_round import DeviceRound, conditional_nodes_supported

    rt = make(str(tiny_models["draft"]), "cpu", "device")
    with pytest.raises(ValueError, match="early_exit needs graphs"):
        DeviceRound(rt, graphs=False, early_exit=True)
    assert not DeviceRound(rt).early_exit  # eager rounds run their F
    if not torch.cuda.is_available():
        assert not conditional_nodes_supported()


def test_graph_mode_needs_cuda(tiny_models):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for CPU-only machines")
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        make(str(tiny_models["draft"]), "cpu", "graph")


@pytest.mark.parametrize("A", [1, 2, 3, 5, 8])
def test_round_state_views_share_one_buffer_each_aligned(A, device):
    """RoundState.per_round: dlen, row_forwards, guess_tokens, guess_hits, last_take and drafts
    are disjoint views of one buffer (a round's start zeroes them in one launch), each at a
    16-byte-aligned address whatever A is, so that Triton compiles the round's kernels once for
    every batch bucket, not again for odd ones."""
    from vllm_ouroboros.draft.device_round import RoundState

    st = RoundState.empty(A, L=4, Dw=9, width=12, device=device)
    views = [st.dlen, st.row_forwards, st.guess_tokens, st.guess_hits, st.last_take, st.drafts]
    base, end = st.per_round.data_ptr(), st.per_round.data_ptr() + st.per_round.numel() * 8
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * 8) for v in views)
    assert all(v.is_contiguous() for v in views) and [v.shape[0] for v in views] == [A] * 6
    assert all((lo - base) % 16 == 0 and base <= lo and hi <= end for lo, hi in spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # disjoint
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert [int(v.min()) for v in views] == [1, 2, 3, 4, 5, 6]  # no view wrote into another
    st.per_round.zero_()
    assert not any(bool(v.any()) for v in views)


def test_batch_buckets_past_the_largest_step_by_its_last_gap():
    from vllm_ouroboros.draft.device_round import BATCH_BUCKETS, bucket

    assert [bucket(n, BATCH_BUCKETS) for n in (1, 3, 17, 500, 512)] == [1, 4, 24, 512, 512]
    assert [bucket(n, BATCH_BUCKETS) for n in (513, 640, 641, 1024, 1025)] == [640, 640, 768, 1024, 1152]
    assert bucket(5, (4,)) == 8
