"""`bench quality`'s arithmetic, by hand: SQuAD's normalisation, exact match, F1 and
"contains" (with the official script's known quirks), retrieval recall, the Wilson and bootstrap
intervals, the paired bootstrap, and the question count for an interval's width. No engine."""

from __future__ import annotations

import math
import random

import pytest

from ragcache_core.bench.intervals import (
    Z95,
    bootstrap,
    mean_interval,
    paired_difference,
    questions_for,
    wilson,
)
from ragcache_core.bench.scoring import (
    best,
    contains,
    exact_match,
    f1,
    normalize,
    retrieval_recall,
    score_reply,
    words,
)


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Quick, Brown fox!", "quick brown fox"),
        ("  A  an THE   ", ""),  # nothing but articles
        ("theatre another", "theatre another"),  # articles only as whole words
        ("U.S. Army", "us army"),  # punctuation goes without a space ...
        ("state-of-the-art", "stateoftheart"),  # ... so "the" is no word here (the script too)
        ("Denver\tBroncos\n", "denver broncos"),
        ("Café–Bar", "café–bar"),  # an en dash is not string.punctuation: kept, as the script
        ("$12", "12"),
    ],
)
def test_normalize_is_squads(text: str, normalized: str) -> None:
    assert normalize(text) == normalized


def test_exact_match_after_normalisation() -> None:
    assert exact_match("The Denver Broncos.", "denver broncos") == 1.0
    assert exact_match("Denver Broncos won", "Denver Broncos") == 0.0
    assert exact_match("", "The") == 1.0  # both normalize to "" (the script says 1 as well)


def test_f1_by_hand() -> None:
    assert f1("Denver Broncos", "Broncos") == pytest.approx(2 / 3)  # P 1/2, R 1
    # reply tokens cat sat on mat (4), gold cat on mat (3): 3 shared, P 3/4, R 1 -> 6/7
    assert f1("The cat sat on the mat.", "cat on a mat") == pytest.approx(6 / 7)
    assert f1("cat cat", "cat") == pytest.approx(2 / 3)  # shared with multiplicity: 1, not 2
    assert f1("dog", "cat") == 0.0
    assert f1("", "") == 0.0  # no shared token: 0, as the script (its v2 differs)
    assert f1("the", "a") == 0.0


def test_words_break_at_punctuation_where_normalize_joins() -> None:
    assert words("Richard Harbison's analysis") == "richard harbison s analysis"
    assert normalize("Richard Harbison's analysis") == "richard harbisons analysis"
    assert words("The U.S. state-of-the-art") == "u s state of art"
    assert words("the 1986–87 season") == "1986 87 season"  # an en dash breaks words here


def test_contains_takes_whole_words_of_the_reply() -> None:
    assert contains("It began in October, 1973.", "October 1973") == 1.0
    assert contains("in 19734", "1973") == 0.0  # not a whole word
    assert contains("in 2012", "2") == 0.0
    assert contains("It was Richard Harbison's analysis.", "Richard Harbison") == 1.0
    assert contains("the U.S. Army", "U.S.") == 1.0
    assert contains("The answer is the Broncos", "Denver Broncos") == 0.0
    assert contains("anything at all", "The") == 0.0  # an empty gold is in nothing
    assert contains("Denver Broncos", "Denver Broncos") == 1.0


def test_each_figure_is_the_best_over_the_gold_answers() -> None:
    golds = ("Denver Broncos", "Broncos", "the Broncos")
    assert score_reply("Broncos", golds) == {"exact_match": 1.0, "f1": 1.0, "contains": 1.0}
    scores = score_reply("The Broncos of Denver", golds)
    assert scores["exact_match"] == 0.0
    assert scores["f1"] == pytest.approx(0.8)  # vs "Denver Broncos": 2 of 3 tokens, all gold
    assert scores["contains"] == 1.0
    assert score_reply("Carolina", golds) == {"exact_match": 0.0, "f1": 0.0, "contains": 0.0}
    assert best(f1, "anything", ()) == 0.0


def test_retrieval_recall_per_document() -> None:
    texts = ["The 1973 oil crisis began in October 1973.", "Prices rose in March."]
    assert retrieval_recall(texts, ["October 1973", "1974"]) == 1.0
    assert retrieval_recall(texts, ["1974"]) == 0.0
    assert retrieval_recall(["... in October", "1973 prices rose"], ["October 1973"]) == 0.0
    # A SQuAD dev answer whose paragraph has it only as a possessive (SQuAD's normalisation
    # would make "harbisons" of it).
    paragraph = ["Richard Harbison's purely morphological analysis in 1985 concluded ..."]
    assert retrieval_recall(paragraph, ["Richard Harbison"]) == 1.0


# --------------------------------------------------------------------------- intervals


def test_wilson_by_hand() -> None:
    half = wilson([1.0] * 5 + [0.0] * 5)
    assert half.value == 0.5
    assert (half.low, half.high) == pytest.approx((0.2366, 0.7634), abs=1e-4)  # textbook 5/10
    every = wilson([1.0] * 300)
    assert (every.value, every.high) == (1.0, 1.0)
    assert every.low == pytest.approx(1 / (1 + Z95**2 / 300))  # width left at 100%
    with pytest.raises(ValueError, match="0/1"):
        wilson([0.5])


def test_bootstrap_is_seeded_and_near_the_normal_interval() -> None:
    rng = random.Random(7)
    values = [rng.random() ** 2 for _ in range(400)]
    first, again = bootstrap(values, seed=3), bootstrap(values, seed=3)
    assert first == again and first.method == "bootstrap"
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    assert first.low < mean < first.high
    assert first.half_width == pytest.approx(Z95 * sd / math.sqrt(len(values)), rel=0.15)
    assert bootstrap([0.25] * 10).low == bootstrap([0.25] * 10).high == 0.25
    assert mean_interval([0.0, 1.0, 1.0]).method == "wilson"
    assert mean_interval([0.0, 0.5, 1.0]).method == "bootstrap"


def test_the_paired_bootstrap_sees_what_two_separate_intervals_hide() -> None:
    rng = random.Random(11)
    reference = [rng.random() for _ in range(200)]
    better = [min(1.0, r + 0.02 + rng.gauss(0, 0.005)) for r in reference]
    paired = paired_difference(better, reference, seed=0)
    assert paired.method == "paired-bootstrap"
    assert 0.0 < paired.low <= paired.value <= paired.high  # a clear gain of ~2 points ...
    apart = bootstrap(better), bootstrap(reference)
    assert apart[0].low < apart[1].high  # ... that the separate intervals overlap on
    same = paired_difference(reference, reference)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="length"):
        paired_difference([1.0], [1.0, 0.0])


def test_questions_for_a_width() -> None:
    assert questions_for(0.5, 0.03) == math.ceil((Z95 * 0.5 / 0.03) ** 2) == 1068
    assert questions_for(0.4, 0.03) == 683
    with pytest.raises(ValueError):
        questions_for(0.4, 0)
