"""What a longer pool key would give the draft's guesses, simulated on greedy text (no engine).

The phrase pool keys phrases on one token (pool.py). This replays the text of a
`scripts/generate.py --json` run (prompt + each greedy output, prompts in order, one pool for
all as under warm start) through pools of W phrases of L tokens per key, LRU, fed only
with the confirmed text's own phrases (context phrases: the prompt's, then each phrase as its
last token is confirmed; no window, no target inspiration): keyed on the last token, and keyed
on the last two tokens with the one-token pool filling the remaining guesses, and (--wide-pages)
keyed on the last token in pages of S > W phrases, each stored with the token before its key,
the W guesses those whose stored token is the current one's predecessor first, then the newest.
At each output position it prints how many of the next L tokens the best of the W guesses
matches (mean), how often one matches at least one token, and how often one matches all L.

--pool-trees replays the pool mode (pool_draft.py) instead, step by step: at each step the pool
proposes a tree from the last confirmed token, the longest prefix of the text it holds is
accepted plus the target's token after it, and the text's phrases enter the one-token pool as
they are confirmed (no target inspiration or refinement, which the engine adds to both). Trees:
the chain of best phrases (up to --draft-len tokens) with K suffixes at its end, as the pool
mode sent it before `pool_branches`; the K best phrases of the last token as branches under the
root (pool_branches); and, for scale, branches whose first is chained on (a tree the target
step cannot take). It prints tokens per step (E) and tokens sent per step.

    python scripts/pool_key_sim.py results/phrase_extension_base.json [--wide-pages 8 16]
    python scripts/pool_key_sim.py results/phrases_40.json --pool-trees [--per-key 8]
"""
import argparse
import json
from collections import defaultdict
from pathlib import Path

from generate import humaneval_prompts, models_dir


class LruPool:
    """key -> up to W phrases, newest first; a re-inserted phrase moves to the front."""

    def __init__(self, w: int):
        self.w, self.d = w, defaultdict(list)

    def insert(self, key, phrase: tuple) -> None:
        lst = self.d[key]
        if phrase in lst:
            lst.remove(phrase)
        lst.insert(0, phrase)
        del lst[self.w:]

    def get(self, key) -> list:
        return self.d.get(key, [])


class ContextRankedPool:
    """key -> up to S (phrase, token before the key), newest first; a re-inserted phrase moves
    to the front with its new context. get: the w best, those whose context matches first."""

    def __init__(self, s: int):
        self.s, self.d = s, defaultdict(list)

    def insert(self, key, phrase: tuple, before) -> None:
        lst = self.d[key]
        lst[:] = [e for e in lst if e[0] != phrase]
        lst.insert(0, (phrase, before))
        del lst[self.s:]

    def get(self, key, before, w: int) -> list:
        lst = self.d.get(key, [])
        ranked = [p for p, b in lst if b == before] + [p for p, b in lst if b != before]
        return ranked[:w]


def match(guesses: list, truth: list) -> int:
    """Longest prefix of `truth` that one guess starts with."""
    best = 0
    for g in guesses:
        n = 0
        while n < min(len(g), len(truth)) and g[n] == truth[n]:
            n += 1
        best = max(best, n)
    return best


def chain_tree(pool: LruPool, key, draft_len: int, K: int) -> list[list]:
    """The pool mode's chain: best phrases chained from `key`, cut to draft_len, then K phrases
    after its end (none where the chain is empty: their key found nothing). Paths from the root."""
    chain = []
    while len(chain) < draft_len:
        found = pool.get(key)
        if not found:
            break
        chain += list(found[0])
        key = chain[-1]
    chain = chain[:draft_len]
    if not chain:
        return []
    return [chain] + [chain + list(s) for s in pool.get(chain[-1])[:K]]


def branch_tree(pool: LruPool, key, K: int, chain_first: int = 0) -> list[list]:
    """pool_branches: the K best phrases of `key`, each a path from the root; chain_first > 0
    continues the first one with best phrases up to that many tokens."""
    paths = [list(s) for s in pool.get(key)[:K]]
    while paths and len(paths[0]) < chain_first:
        found = pool.get(paths[0][-1])
        if not found:
            break
        paths[0] += list(found[0])
    if paths and chain_first:
        paths[0] = paths[0][:chain_first]
    return paths


def sent_tokens(paths: list[list]) -> int:
    """Tree nodes of root paths that share at most a chain (chain_tree's shape, or disjoint)."""
    if len(paths) > 1 and paths[1][:len(paths[0])] == paths[0]:
        return len(paths[0]) + sum(len(p) - len(paths[0]) for p in paths[1:])
    return sum(len(p) for p in paths)


def replay_pool_mode(texts: list[tuple[list, list]], L: int, W: int, tree) -> tuple[float, float]:
    """E (tokens per step) and tokens sent per step of the pool mode over texts [(prompt ids,
    output ids)], warm across them; tree(pool, key) -> root paths."""
    pool = LruPool(W)
    steps = tokens = sent = 0
    for ids, out in texts:
        seq = list(ids) + list(out)

        def add(j: int) -> None:
            if 0 <= j and j + L < len(seq):
                pool.insert(seq[j], tuple(seq[j + 1:j + 1 + L]))

        for j in range(len(ids) - L - 1):
            add(j)
        j = len(ids) - 1
        while j < len(seq) - 1:
            paths = tree(pool, seq[j])
            step = min(match(paths, seq[j + 1:]) + 1, len(seq) - 1 - j)
            for t in range(step):
                add(j + 1 + t - L)
            j += step
            steps, tokens, sent = steps + 1, tokens + step, sent + sent_tokens(paths)
    return tokens / max(steps, 1), sent / max(steps, 1)


def pool_trees(texts: list[tuple[list, list]], L: int, W: int, draft_len: int) -> None:
    trees = {f"chain of {draft_len}, K = 1 suffix": lambda p, k: chain_tree(p, k, draft_len, 1),
             f"chain of {draft_len}, K = {W} suffixes": lambda p, k: chain_tree(p, k, draft_len, W),
             "branches, K = 1": lambda p, k: branch_tree(p, k, 1),
             f"branches, K = {W} (pool_branches)": lambda p, k: branch_tree(p, k, W),
             f"branches, K = {W}, the first chained to {draft_len}": lambda p, k: branch_tree(p, k, W, draft_len)}
    print(f"{len(texts)} prompts, pool mode replayed, W = {W}, L = {L}, context phrases only")
    for name, tree in trees.items():
        e, sent = replay_pool_mode(texts, L, W, tree)
        print(f"{name:40s} tokens per step {e:.3f}  tokens sent per step {sent:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="generate.py --json output (its first config's outputs)")
    ap.add_argument("--phrase-len", type=int, default=4, help="L = beta - 1")
    ap.add_argument("--per-key", type=int, default=4, help="W = G")
    ap.add_argument("--target", default=str(models_dir() / "qwen2.5-coder-1.5b-instruct"),
                    help="tokenizer of the run's target")
    ap.add_argument("--wide-pages", type=int, nargs="*", default=[],
                    help="page sizes S > W for the context-ranked one-token pool")
    ap.add_argument("--pool-trees", action="store_true", help="replay the pool mode's trees instead")
    ap.add_argument("--draft-len", type=int, default=8, help="--pool-trees: the chain's cap (gamma - 1 + beta)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    outputs = json.loads(args.run.read_text())[0]["outputs"]
    prompts = humaneval_prompts(len(outputs))
    tok = AutoTokenizer.from_pretrained(args.target)
    L, W = args.phrase_len, args.per_key
    if args.pool_trees:
        pool_trees([(tok(p).input_ids, o) for p, o in zip(prompts, outputs)], L, W, args.draft_len)
        return
    one, two = LruPool(W), LruPool(W)
    wide = {S: ContextRankedPool(S) for S in args.wide_pages}
    n = 0
    sums = {k: [0, 0, 0] for k in ["one-token key", "two-token key, then one"]
            + [f"one-token key, {S} ranked" for S in wide]}
    for prompt, out in zip(prompts, outputs):
        ids = tok(prompt).input_ids
        seq = ids + list(out)

        def add(j: int) -> None:  # the phrase after key seq[j]
            if 0 <= j and j + L < len(seq):
                phrase = tuple(seq[j + 1:j + 1 + L])
                one.insert(seq[j], phrase)
                if j >= 1:
                    two.insert((seq[j - 1], seq[j]), phrase)
                for pool in wide.values():
                    pool.insert(seq[j], phrase, seq[j - 1] if j >= 1 else None)

        for j in range(len(ids) - L - 1):
            add(j)
        for j in range(len(ids) - 1, len(seq) - 1):
            truth = seq[j + 1:j + 1 + L]
            g1 = one.get(seq[j])
            g2 = list(two.get((seq[j - 1], seq[j])))
            g2 += [g for g in g1 if g not in g2]
            ranked = [pool.get(seq[j], seq[j - 1], W) for pool in wide.values()]
            for name, guesses in zip(sums, [g1, g2[:W]] + ranked):
                m = match(guesses, truth)
                s = sums[name]
                s[0] += m
                s[1] += m > 0
                s[2] += m == L
            n += 1
            add(j + 1 - L)  # seq[j + 1] confirmed: the phrase that ends with it
    print(f"{len(outputs)} prompts, {n} output positions, W = {W}, L = {L}, context phrases only")
    for name, (m, hit, full) in sums.items():
        print(f"{name:26s} mean tokens matched {m / n:.3f}  >= 1 token {hit / n:.3f}  all {L} {full / n:.3f}")


if __name__ == "__main__":
    main()
