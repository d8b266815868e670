"""What a longer pool key would give the draft's guesses, simulated on greedy text (no engine).

The phrase pool keys phrases on one token (algorithm.md). This replays the text of a
`scripts/generate.py --json` run (prompt + each greedy output, prompts in order, one pool for
all as under warm start) through pools of W phrases of L tokens per key, LRU, fed only
with the confirmed text's own phrases (context phrases: the prompt's, then each phrase as its
last token is confirmed; no window, no target inspiration): keyed on the last token, and keyed
on the last two tokens with the one-token pool filling the remaining guesses, and (--wide-pages)
keyed on the last token in pages of S > W phrases, each stored with the token before its key,
the W guesses those whose stored token is the current one's predecessor first, then the newest.
At each output position it prints how many of the next L tokens the best of the W guesses
matches (mean), how often one matches at least one token, and how often one matches all L.

    python scripts/pool_key_sim.py results/phrase_extension_base.json [--wide-pages 8 16]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="generate.py --json output (its first config's outputs)")
    ap.add_argument("--phrase-len", type=int, default=4, help="L = beta - 1")
    ap.add_argument("--per-key", type=int, default=4, help="W = G")
    ap.add_argument("--target", default=str(models_dir() / "qwen2.5-coder-1.5b-instruct"),
                    help="tokenizer of the run's target")
    ap.add_argument("--wide-pages", type=int, nargs="*", default=[],
                    help="page sizes S > W for the context-ranked one-token pool")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    outputs = json.loads(args.run.read_text())[0]["outputs"]
    prompts = humaneval_prompts(len(outputs))
    tok = AutoTokenizer.from_pretrained(args.target)
    L, W = args.phrase_len, args.per_key
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
