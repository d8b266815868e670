"""The pieces of the analysis scripts whose numbers results/README.md reports."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from pool_key_sim import LruPool, match  # noqa: E402


def test_lru_pool_keeps_the_newest_phrases_of_a_key():
    pool = LruPool(2)
    for phrase in [(1, 2), (3, 4), (1, 2), (5, 6)]:
        pool.insert("k", phrase)
    # (1, 2) re-inserted moved to the front, then (5, 6) pushed (3, 4) out
    assert pool.get("k") == [(5, 6), (1, 2)]
    assert pool.get("other") == []


def test_match_is_the_longest_guessed_prefix():
    assert match([(1, 2, 9), (1, 2, 3)], [1, 2, 3]) == 3
    assert match([(1, 9), (7, 8)], [1, 2, 3]) == 1
    assert match([(4,)], [1, 2]) == 0
    assert match([], [1]) == 0
    assert match([(1, 2, 3, 4)], [1, 2]) == 2  # the text ends before the phrase does
