"""Answers scored against gold answers, as SQuAD v1.1's official evaluation script scores them.

    normalize("The  Broncos!")  -> "broncos"   lower case, punctuation out, articles out,
                                               whitespace collapsed (the script's order)
    exact_match  normalized reply == normalized gold
    f1           token F1 of the normalized reply against the normalized gold (bag of tokens)
    contains     the gold inside the reply, as whole words (a small instruct model answers in
                 a sentence: "It began in October 1973.")
    recall       a gold answer inside one of the retrieved documents, as whole words

`contains` and `recall` compare words: both sides normalized as SQuAD normalizes, except that
punctuation splits words instead of joining them (`words`), so "Harbison's analysis" contains
"Richard Harbison" when it follows "Richard", and "in 19734" does not contain "1973" (nor
"in 2012" the gold "2"). A plain substring test of the SQuAD-normalized strings would take the
second and third and miss the first ("harbisons").

Each figure is the best over a question's gold answers (SQuAD has several per question,
NQ-open an alias list). As in the script, an empty reply exactly matches a gold answer that
normalizes to nothing ("The"), and F1 is 0 whenever no token is shared (both empty included);
`contains` and `recall` never match an empty gold. Pure functions.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize(text: str) -> str:
    """SQuAD v1.1's `normalize_answer`: lower case, remove punctuation, remove the articles
    a/an/the, collapse whitespace (in the script's order)."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(reply: str, gold: str) -> float:
    return float(normalize(reply) == normalize(gold))


def f1(reply: str, gold: str) -> float:
    """The script's `f1_score`: the harmonic mean of precision and recall of the tokens shared
    (with multiplicity) by the normalized reply and gold; 0 when none is shared."""
    reply_tokens, gold_tokens = normalize(reply).split(), normalize(gold).split()
    same = sum((Counter(reply_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(reply_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def words(text: str) -> str:
    """`normalize` with punctuation as a word break: "Harbison's" -> "harbison s", "U.S." ->
    "u s", "state-of-the-art" -> "state of art"; here Unicode punctuation breaks words too
    ("1986–87" -> "1986 87": an en dash is not in `string.punctuation`)."""
    text = "".join(" " if _breaks(ch) else ch for ch in text.lower())
    return " ".join(_ARTICLES.sub(" ", text).split())


def _breaks(ch: str) -> bool:
    return ch in _PUNCTUATION or unicodedata.category(ch).startswith("P")


def contains(reply: str, gold: str) -> float:
    """1 when the gold's `words` are a run of whole words of the reply's ("1973" is in
    "October, 1973.", not in "19734"); an empty gold is in nothing."""
    return float(_inside(words(gold), words(reply)))


def _inside(needle: str, haystack: str) -> bool:
    return bool(needle) and f" {needle} " in f" {haystack} "


def best(score: Callable[[str, str], float], reply: str, golds: Sequence[str]) -> float:
    """The best `score` of `reply` over the gold answers (0 when there are none: the script's
    `metric_max_over_ground_truths` over an empty list would fail)."""
    return max((score(reply, gold) for gold in golds), default=0.0)


def retrieval_recall(texts: Sequence[str], golds: Sequence[str]) -> float:
    """1 when some gold answer is in one of the retrieved texts, as whole `words` (each text on
    its own, so no answer is made up across a seam)."""
    normalized = [words(text) for text in texts]
    return float(any(_inside(words(g), t) for g in golds for t in normalized))


SCORES: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "f1": f1,
    "contains": contains,
}
"""The per-answer figures, by their JSON names."""


def score_reply(reply: str, golds: Sequence[str]) -> dict[str, float]:
    """Every figure of `SCORES` for one reply, each the best over the gold answers."""
    return {name: best(score, reply, golds) for name, score in SCORES.items()}
