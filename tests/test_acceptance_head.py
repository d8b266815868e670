"""Adaptive draft length (SpecDec++): the acceptance head's file, the stopping rule, and the
drafting round that applies it (tiny models, no vLLM).

The round's reference: the draft model's own greedy continuation of the context, computed with
full causal forwards, and the head applied to the hidden state that produced each token; the
adaptive draft must be exactly its prefix up to where 1 - prod(P(accept)) first exceeds h.
"""

import copy
import json

import numpy as np
import pytest
import torch

from vllm_ouroboros.draft import DraftModel
from vllm_ouroboros.draft.acceptance_head import (
    AcceptanceHeadError,
    draft_identity,
    load_head,
    read_head,
    stop_rule,
)
from vllm_ouroboros.draft.runtime import DraftRuntime, DraftSettings
from vllm_ouroboros.pool import PhrasePool

from conftest import DEVICE
from tiny_models import acceptance_head

BETA, W, G = 4, 4, 4
L = BETA - 1
CAP = 9
pytestmark = pytest.mark.usefixtures("one_thread")


# ---- file ------------------------------------------------------------------------------------

def test_head_file_round_trip_and_identity(tiny_models, tmp_path):
    draft = str(tiny_models["draft"])
    head = acceptance_head(128)
    path = str(tmp_path / "head.safetensors")
    head.save(path, draft_identity(draft), 0.65, extra={"note": 1})
    loaded = load_head(path, draft)
    assert loaded.threshold == 0.65 and loaded.extra == {"note": 1}
    x = torch.randn(5, 3, 128)
    assert torch.equal(loaded.head(x), head(x))
    assert ((head(x) > 0) & (head(x) < 1)).all() and head(x).dtype == torch.float32
    # Reformatting config.json (same settings) keeps the identity; another model does not.
    cfg = json.loads((tiny_models["draft"] / "config.json").read_text())
    other = tmp_path / "reformatted"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(cfg, indent=4, sort_keys=False))
    assert draft_identity(str(other)) == draft_identity(draft)
    llama = str(tiny_models["llama"])
    with pytest.raises(AcceptanceHeadError) as e:
        load_head(path, llama)
    msg = str(e.value)
    assert "'acceptance_head'" in msg and draft_identity(draft) in msg and draft_identity(llama) in msg


def test_head_file_refusals(tiny_models, tmp_path):
    draft = str(tiny_models["draft"])
    with pytest.raises(AcceptanceHeadError, match="'acceptance_head' .* does not exist"):
        read_head(str(tmp_path / "nope.safetensors"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a head")
    with pytest.raises(AcceptanceHeadError, match="'acceptance_head' .* not a readable head file"):
        load_head(str(bad), draft)
    path = str(tmp_path / "h.safetensors")
    acceptance_head(128).save(path, draft_identity(draft), 0.7)
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])  # truncated
    with pytest.raises(AcceptanceHeadError, match="not a readable head file"):
        load_head(path, draft)


def test_a_head_for_a_draft_with_the_same_config_but_other_weights_is_refused(tiny_models, tmp_path):
    """The draft (noise 0.15) and the close draft (0.02) share a config.json, so one identity:
    a head records the weights' fingerprint too and refuses the other; a head saved without one
    (trained before it was recorded, results/acceptance_head.safetensors) loads on identity."""
    from safetensors.torch import load_file, save_file

    from vllm_ouroboros.draft.acceptance_head import draft_weights_fingerprint

    draft, close = str(tiny_models["draft"]), str(tiny_models["close_draft"])
    assert draft_identity(draft) == draft_identity(close)
    assert draft_weights_fingerprint(draft) != draft_weights_fingerprint(close)
    assert draft_weights_fingerprint(draft) == draft_weights_fingerprint(draft)
    path = str(tmp_path / "head.safetensors")
    acceptance_head(128).save(path, draft_identity(draft), 0.6, draft_weights=draft_weights_fingerprint(draft))
    assert load_head(path, draft).draft_weights == draft_weights_fingerprint(draft)
    with pytest.raises(AcceptanceHeadError, match="trained for a draft with this config but other weights"):
        load_head(path, close)
    older = str(tmp_path / "older.safetensors")
    acceptance_head(128).save(older, draft_identity(draft), 0.6)
    assert load_head(older, close).draft_weights is None
    # A file of another version (its params another shape) or missing a tensor: refused by name.
    from safetensors import safe_open

    with safe_open(older, framework="pt") as f:
        meta = dict(f.metadata())
    tensors = load_file(older)
    for name, (m, t) in {"params": ({**meta, "params": '{"hidden_size": 128, "heads": 2}'}, tensors),
                         "tensor": (meta, dict(list(tensors.items())[1:]))}.items():
        bad = str(tmp_path / f"bad_{name}.safetensors")
        save_file(t, bad, metadata=m)
        with pytest.raises(AcceptanceHeadError, match="is a head file this version cannot read"):
            load_head(bad, draft)
    # A threshold the rule could not use (never or always stopping): refused, not run unseen.
    for h in ("nan", "1.0", "0", "-0.5"):
        bad = str(tmp_path / "bad_threshold.safetensors")
        save_file(tensors, bad, metadata={**meta, "threshold": h})
        with pytest.raises(AcceptanceHeadError, match=r"threshold .* is not in \(0, 1\)"):
            load_head(bad, draft)


def test_a_head_saved_in_its_drafts_folder_loads_and_can_be_replaced(tiny_models, tmp_path):
    """The weights' fingerprint leaves head files out: a head kept beside the draft's weights
    (written after the fingerprint was taken) matched no draft, nor could a retrained one."""
    import shutil

    from vllm_ouroboros.draft.acceptance_head import draft_weights_fingerprint

    draft = tmp_path / "draft"
    shutil.copytree(tiny_models["draft"], draft)
    path = str(draft / "acceptance_head.safetensors")
    for threshold in (0.6, 0.7):  # trained, then retrained into the same file
        fingerprint = draft_weights_fingerprint(str(draft))  # as the training script: before saving
        acceptance_head(128).save(path, draft_identity(str(draft)), threshold, draft_weights=fingerprint)
        assert load_head(path, str(draft)).threshold == threshold
    assert draft_weights_fingerprint(str(draft)) == draft_weights_fingerprint(str(tiny_models["draft"]))


# ---- the rule on hand-made probabilities ------------------------------------------------------

def test_stop_rule_hand_made():
    p = torch.tensor([[0.9, 0.9, 0.9, 0.9],   # prods .9 .81 .729 .656: 1 - prod > .3 first at index 3
                      [0.5, 0.9, 0.9, 0.9],   # fires at once
                      [0.99, 0.99, 0.99, 0.99],  # never fires: all real tokens kept
                      [0.9, 0.9, 0.1, 0.1]])  # only 2 real tokens: the .1s do not count
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    before = torch.tensor([1.0, 1.0, 1.0, 0.8])  # row 3 drafted earlier: .72, .648 -> fires at 1
    take, fired, after = stop_rule(p, valid, before, 0.3)
    assert take.tolist() == [4, 1, 3, 2]
    assert fired.tolist() == [True, True, False, True]
    assert torch.allclose(after, torch.tensor([0.9 ** 4, 0.5, 0.99 ** 3, 0.648]))
    # exactly at the threshold does not fire (strict >)
    take, fired, _ = stop_rule(torch.tensor([[0.5, 0.5]]), torch.ones(1, 2, dtype=torch.bool),
                               torch.ones(1), 0.5)
    assert take.tolist() == [2] and fired.tolist() == [True]


# ---- the drafting round ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_path(tiny_models):
    return str(tiny_models["draft"])


@pytest.fixture(scope="module")
def ref_model(draft_path):
    m = DraftModel.from_pretrained(draft_path, dtype=torch.float32, device="cpu")
    m.allocate_cache(1, 256)
    return m


def reference(model, head, ctx, n):
    """Greedy continuation (n tokens) and P(accept) of each token, from full causal forwards."""
    seq, probs = list(ctx), []
    for _ in range(n):
        k = len(seq)
        h = model.forward(torch.tensor([seq]), torch.arange(k)[None], torch.tensor([0]),
                          torch.tensor([0]), torch.ones(k, k, dtype=torch.bool).tril()[None],
                          max_cache_len=0)[0, -1]
        seq.append(int(model.greedy_tokens(h)))
        probs.append(float(head(h)))
    return seq[len(ctx):], np.array(probs)


def expected_len(probs, h, cap):
    over = np.nonzero(1 - np.cumprod(probs[:cap]) > h)[0]
    return (int(over[0]) + 1, True) if len(over) else (cap, False)


def make_runtime(draft_path, head, h, adaptive=True, **kw):
    """Model, pool, runtime and a copy of the head on the test device (the references above
    stay on the host)."""
    model = DraftModel.from_pretrained(draft_path, dtype=torch.float32, device=DEVICE)
    V = model.vocab_size
    pool = PhrasePool(V, L, W, PhrasePool.budget_for(V, L, W, V), device=DEVICE, shared=True)
    settings = DraftSettings(gamma=4, beta=BETA, window_size=W, num_guesses=G, num_suffixes=1,
                             draft_length="adaptive" if adaptive else "fixed",
                             acceptance_threshold=h, max_draft_length=CAP, **kw)
    head = copy.deepcopy(head).to(DEVICE) if head is not None else None
    return DraftRuntime(model, pool, settings, 4, 512, DEVICE, head=head), pool


def run(rt, slots, contexts):
    tab = np.zeros((len(contexts), max(map(len, contexts)) + 3), np.int64)
    for b, c in enumerate(contexts):
        tab[b, :len(c)] = c
    out = rt.run_round(np.asarray(slots, np.int64), tab, np.arange(len(contexts)),
                       np.array([len(c) for c in contexts], np.int64))
    return out, [out.drafts[b, :out.draft_lens[b]].tolist() for b in range(len(contexts))]


def margin_ok(probs, h):
    """The rule's decisions are not within float noise of the threshold."""
    return np.abs(1 - np.cumprod(probs) - h).min() > 1e-4


@pytest.mark.parametrize("phrases", [False, True])
def test_adaptive_round_stops_where_the_rule_fires(draft_path, ref_model, phrases):
    """Rows stop independently, exactly where 1 - prod > h (or at the cap); the draft is the draft
    model's own greedy continuation, a prefix of what fixed mode drafts; with the draft's own
    continuation in the pool, one forward brings several tokens and is cut at the right one."""
    head = acceptance_head(ref_model.hidden_size)
    rng = np.random.default_rng(3)
    h = 0.5
    V = ref_model.vocab_size
    contexts, refs = [], []
    while len(contexts) < 4:
        ctx = rng.integers(2, V, int(rng.integers(3, 40))).tolist()
        toks, probs = reference(ref_model, head, ctx, CAP + BETA)
        if margin_ok(probs[:CAP], h):
            contexts.append(ctx)
            refs.append((toks, probs))
    def seed(pool):
        # Every row's continuation, phrase by phrase, as right guesses; each key's newest phrase,
        # the first guess, a wrong one (a right guess ranked below a wrong one: the head must read
        # the right guess's outputs, not the first guess's).
        for b, (toks, _) in enumerate(refs):
            seq = contexts[b] + toks
            for i in range(len(contexts[b]) - 1, len(seq) - L):
                right = seq[i + 1:i + 1 + L]
                wrong = [(t - 1) % (V - 2) + 2 for t in right]  # each token another
                for phrase in (right, wrong):
                    pool.insert(torch.tensor([seq[i]]), torch.tensor([phrase]), torch.tensor([b]))

    rt, pool = make_runtime(draft_path, head, h, use_lookahead=phrases, use_guesses=phrases)
    if phrases:
        seed(pool)
    cuts = []  # forwards whose phrase the rule cut: (tokens brought, tokens kept)
    forward = rt._lookahead_forward

    def spy(*a, **k):
        new, num, rule = forward(*a, **k)
        cuts.extend((n, t) for n, t, f in zip(num, *rule[:2]) if f and t < n)
        return new, num, rule

    rt._lookahead_forward = spy
    out, drafts = run(rt, [0, 1, 2, 3], contexts)
    assert bool(cuts) == phrases, cuts  # one token per forward without phrases: nothing to cut
    want = [expected_len(p, h, CAP) for _, p in refs]
    lens = [n for n, _ in want]
    assert len(set(lens)) > 1, lens  # the round really has rows of different lengths
    for b in range(4):
        assert drafts[b] == refs[b][0][:lens[b]], b
        assert bool(out.stopped_by_rule[b]) == want[b][1]
    assert out.forwards == out.row_forwards.max()
    if phrases:
        assert out.guess_tokens.sum() > 0 and (out.row_forwards < out.draft_lens).any()
    else:  # one token per forward: a row that stopped took no further forward
        assert out.row_forwards.tolist() == lens
    # Each row alone drafts the same as in the batch.
    for b in range(4):
        rt1, pool1 = make_runtime(draft_path, head, h, use_lookahead=phrases, use_guesses=phrases)
        if phrases:
            seed(pool1)
        _, d1 = run(rt1, [b], [contexts[b]])
        assert d1[0] == drafts[b]
    # Fixed mode drafts the same tokens, only a fixed number of them.
    rt_f, _ = make_runtime(draft_path, None, h, adaptive=False, use_lookahead=phrases, use_guesses=False)
    _, fixed = run(rt_f, [0, 1, 2, 3], contexts)
    for b in range(4):
        n = min(len(fixed[b]), len(drafts[b]))
        assert fixed[b][:n] == drafts[b][:n] == refs[b][0][:n]


def test_cap_and_rule_counts(draft_path, ref_model):
    """A head that always predicts acceptance drafts to the cap (cap stops); one that always
    predicts rejection drafts a single token (rule stops)."""
    ctx = [[5, 9, 17, 33], [7, 8, 9]]
    for bias, n, by_rule in ((30.0, CAP, False), (-30.0, 1, True)):
        head = acceptance_head(ref_model.hidden_size, bias=bias, scale=0.0)
        rt, _ = make_runtime(draft_path, head, 0.5, use_lookahead=True, use_guesses=True)
        out, drafts = run(rt, [0, 1], ctx)
        assert out.draft_lens.tolist() == [n, n]
        assert out.stopped_by_rule.tolist() == [by_rule, by_rule]
        for b in range(2):
            assert drafts[b] == reference(ref_model, head, ctx[b], n)[0]


# ---- training script -----------------------------------------------------------------------

def test_training_script_on_tiny_models(tiny_models, tmp_path):
    """scripts/train_acceptance_head.py end to end on the tiny pair: a head that loads for its
    draft, held-out metrics in range, h from the grid; a refit reads the features cache."""
    import gzip
    import subprocess
    import sys
    from pathlib import Path

    from tiny_models import _CORPUS_LINES

    (tmp_path / "data").mkdir()
    with gzip.open(tmp_path / "data" / "HumanEval.jsonl.gz", "wt") as f:
        for i in range(24):
            f.write(json.dumps({"prompt": _CORPUS_LINES[i % 8] * (1 + i % 3)}) + "\n")
    repo = Path(__file__).resolve().parents[1]
    out, metrics, cache = tmp_path / "head.safetensors", tmp_path / "m.json", tmp_path / "cache.npz"
    cmd = [sys.executable, str(repo / "scripts" / "train_acceptance_head.py"),
           "--draft", str(tiny_models["draft"]), "--target", str(tiny_models["target"]),
           "--models-dir", str(tmp_path), "--humaneval", "24", "--mtbench", "0", "--gen-tokens", "12",
           "--width", "16", "--threads", "1", "--out", str(out), "--metrics", str(metrics),
           "--data-cache", str(cache)]
    for epochs in ("40", "20"):
        proc = subprocess.run(cmd + ["--epochs", epochs], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        m = json.loads(metrics.read_text())
        assert m["data_from_cache"] == (epochs == "20"), "the refit must read the features cache"
        assert 0 < m["early_stop_epoch"] <= int(epochs)
        assert 0.0 <= m["held_out_auc"] <= 1.0 and 0.0 <= m["ece"] <= 1.0
        assert m["held_out_tokens"] > 0 and m["calibration_tokens"] > 0 and m["train_tokens"] > 0
        loaded = load_head(str(out), str(tiny_models["draft"]))
        assert loaded.threshold == m["threshold"] and 0.0 < loaded.threshold < 1.0
        assert "held-out AUC" in proc.stdout and "picked h" in proc.stdout
    with pytest.raises(AcceptanceHeadError, match="acceptance_head"):
        load_head(str(out), str(tiny_models["target"]))


@pytest.mark.parametrize("wider", ["target", "draft"])
def test_training_features_for_a_draft_with_another_vocabulary_size(tiny_models, tmp_path, wider):
    """The training script's features (collect) for a pair with one tokenizer and embeddings of
    other sizes, either way round: the draft fitted as the proposer fits it (load_model's
    fit_to), where unfitted the target's ids past the draft's rows, or the draft's past the
    target's, read past an embedding (IndexError)."""
    import sys
    from pathlib import Path

    import numpy as np

    from tiny_models import padded_vocab_copy

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import train_acceptance_head as tah

    wide = padded_vocab_copy(tiny_models["target" if wider == "target" else "close_draft"],
                             tmp_path / "wide", 512, scale=3.0, seed=4)
    t_path, d_path = (wide, tiny_models["close_draft"]) if wider == "target" else (tiny_models["target"], wide)
    target = tah.load_model(str(t_path))
    prompts = [[5, 17, 40, 9, 33, 2, 71], [101, 7, 250, 13]]
    gens = [[int(t) for t in np.random.default_rng(i).integers(300, 512 if wider == "target" else 384, 6)]
            for i in range(2)]
    if wider == "target":  # the target's own continuation holds ids past the draft's rows
        assert max(max(g) for g in gens) >= 384
    unfitted = tah.load_model(str(d_path))
    with pytest.raises(IndexError):
        tah.collect(unfitted, target, prompts, gens, 0.5 if wider == "target" else 1.0,
                    np.random.default_rng(0), _NoBar())
    draft = tah.load_model(str(d_path), fit_to=target.cfg.vocab_size)
    data = tah.collect(draft, target, prompts, gens, 1.0, np.random.default_rng(0), _NoBar())
    assert len(data) == 2 and all(d["hA"].shape == (6, draft.hidden_size) for d in data)


class _NoBar:
    def update(self, n):
        pass


def test_the_trainer_reads_the_models_where_setup_put_them(tmp_path, monkeypatch):
    """scripts/setup.sh --models-dir puts the pair elsewhere ($OUROBOROS_MODELS_DIR, which every
    other script reads): the trainer's defaults, its output among them, follow it."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import train_acceptance_head as tah

    monkeypatch.setenv("OUROBOROS_MODELS_DIR", str(tmp_path))
    try:
        args = importlib.reload(tah).arg_parser().parse_args([])
        for path in (args.draft, args.target, args.models_dir, args.out, args.data_cache):
            assert Path(path).parent == tmp_path or Path(path) == tmp_path, path
    finally:
        monkeypatch.undo()
        importlib.reload(tah)
