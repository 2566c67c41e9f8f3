"""The paper's error taxonomy of a generated answer ("Qualitative analysis", "Error taxonomy" appendix), as pure
functions: no model, no files. A response is put in one category, checked in this order (the first that matches
wins):

    incoherent   filler-word ratio > 35% and unique-word ratio < 15%, or digit ratio > 30%     (rule)
    repetitive   some word 3-gram occurs >= 5 times                                         (rule)
    correct      the extracted final answer is the key                                      (rule)
    other        topic drift (keyword overlap with the question < 15%), no final answer,    (rule)
                 a hedged answer (two letters), or an answer outside the choices
    knowledge    coherent and on-topic, wrong: a wrong fact                                 (judge)
    reasoning    coherent and on-topic, wrong: flawed logic                                 (judge)
    unjudged     would go to the judge, and none was asked (or it gave no verdict)

What the paper leaves open, decided here (docs/how-to/analyze.md sets each choice beside the paper's words):
- **Where `correct` sits.** After the two catastrophic rules, before the rest: a degenerate text that happens to
  contain the key ("B B B B B ...") is a failure, not an answer; a right answer is right however short it is (a
  bare "The answer is (B)." shares few keywords with the question and would otherwise count as topic drift).
  The judge is asked only about wrong, coherent, on-topic responses with a final answer among the choices.
- **Words.** Runs of letters and digits (an apostrophe inside a word kept: "don't"), lower-cased.
- **Filler words.** English function words and discourse fillers (`FILLER_WORDS`: articles, pronouns,
  prepositions, conjunctions, auxiliaries, "um", "like", "well", ...): words that carry no content of their own.
- **Digit ratio.** Digit characters over the response's non-space characters.
- **Keywords.** The distinct words of the question and its choices that are not filler words and have at least
  two characters; overlap = the share of them the response uses. A question without keywords is never drift.
- **Answer extraction** and **the answer key**: evaluate/extraction.py (`extract`, `key_letter`).
- **Empty responses** have no words: no ratio is defined, so they are not incoherent; they have no final answer
  (not topic drift: there is no text to drift).
Every threshold is a field of `config.Thresholds` (the paper's values are the defaults; `stage3.analysis.*` sets them).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from m2d_ray.config import Thresholds
from m2d_ray.evaluate.extraction import HEDGED, OUTSIDE, extract, letters

#: every category, in the order the report stacks them (best first)
CATEGORIES = ("correct", "knowledge", "reasoning", "other", "repetitive", "incoherent", "unjudged")
JUDGED = ("knowledge", "reasoning")  # what a judge decides
CATASTROPHIC = ("incoherent", "repetitive")
#: why a response is `other`
DRIFT = "topic drift"

FILLER_WORDS = frozenset(
    """a an the this that these those some any each every all both either neither no not nor
    i me my mine we us our ours you your yours he him his she her hers it its they them their theirs one
    myself yourself himself herself itself ourselves themselves what which who whom whose
    and or but so yet for because if then than as while when where whether though although also too very just
    only really quite rather even still already again ever never always often there here now
    of in on at to from by with without about above below under over into onto out up down off through
    between among across after before during since until upon within around near like
    is am are was were be been being do does did doing done have has had having will would shall should
    can could may might must ought let let's i'm it's that's there's
    um uh er erm ah oh hmm well okay ok yeah yes basically actually literally kind sort thing things stuff
    etc""".split()
)


# ---- the text's measures ----------------------------------------------------------------------------------------
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def filler_ratio(ws: list[str]) -> float | None:
    return sum(w in FILLER_WORDS for w in ws) / len(ws) if ws else None


def unique_ratio(ws: list[str]) -> float | None:
    return len(set(ws)) / len(ws) if ws else None


def digit_ratio(text: str) -> float | None:
    chars = [c for c in text if not c.isspace()]
    return sum(c.isdigit() for c in chars) / len(chars) if chars else None


def most_repeated(ws: list[str], n: int) -> tuple[tuple[str, ...], int]:
    """The word n-gram that occurs most often (overlapping occurrences count), and how often."""
    grams = Counter(tuple(ws[i : i + n]) for i in range(len(ws) - n + 1))
    return grams.most_common(1)[0] if grams else ((), 0)


def keywords(question: str, choices: Iterable[str]) -> set[str]:
    return {w for w in words(" ".join([question, *choices])) if w not in FILLER_WORDS and len(w) >= 2}


def overlap(response_words: Iterable[str], keys: set[str]) -> float | None:
    return len(keys & set(response_words)) / len(keys) if keys else None


def incoherent(text: str, th: Thresholds = Thresholds()) -> bool:
    ws, digits = words(text), digit_ratio(text)
    filler, unique = filler_ratio(ws), unique_ratio(ws)
    low_content = filler is not None and filler > th.filler_ratio and unique < th.unique_ratio
    return low_content or (digits is not None and digits > th.digit_ratio)


def repetitive(text: str, th: Thresholds = Thresholds()) -> bool:
    return most_repeated(words(text), th.ngram)[1] >= th.repeats


# ---- one response's category --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """A response's category by the rules, or None: the judge decides (a wrong, coherent, on-topic answer)."""

    category: str | None
    extracted: str | None
    reason: str = ""
    extracted_by: str = "rules"  # or "judge": rule 8, where the rules read no single answer


def by_rules(r: dict, th: Thresholds = Thresholds()) -> Verdict:
    """The rules in the priority order of the module docstring, on one record (question, choices, answer,
    response; `judge_extracted`: the letter a judge read where the rules read no single answer, rule 8)."""
    text, choices = r["response"], r["choices"]
    got, why = extract(text, choices)
    by = "rules"
    if (got is None or why == HEDGED) and r.get("judge_extracted"):
        got, by = r["judge_extracted"], "judge"
        why = "" if got in letters(len(choices)) else OUTSIDE
    if incoherent(text, th):
        return Verdict("incoherent", got, extracted_by=by)
    if repetitive(text, th):
        return Verdict("repetitive", got, extracted_by=by)
    if not why and got == r["answer"]:
        return Verdict("correct", got, extracted_by=by)
    ws = words(text)
    drift = overlap(ws, keywords(r["question"], choices))
    if ws and drift is not None and drift < th.overlap:
        return Verdict("other", got, DRIFT, by)
    if why:
        return Verdict("other", got, why, by)
    return Verdict(None, got, extracted_by=by)


def _unread(r: dict, th: Thresholds) -> bool:
    """The rules read no single answer (none, or a hedge) in a text that is neither incoherent nor repetitive."""
    got, why = extract(r["response"], r["choices"])
    return (got is None or why == HEDGED) and not incoherent(r["response"], th) and not repetitive(r["response"], th)


def judge_extracted(
    records: list[dict], extractor: Callable[[list[dict]], list[str | None]], th: Thresholds = Thresholds()
) -> list[dict]:
    """Rule 8: the records whose rules read no single answer (none, or a hedge) in a coherent, non-repeating text,
    given to `extractor` in one call; each letter it reads is kept as the record's `judge_extracted`."""
    ask = [i for i, r in enumerate(records) if _unread(r, th)]
    said = extractor([records[i] for i in ask]) if ask else []
    read = {i: x for i, x in zip(ask, said) if x}
    return [{**r, "judge_extracted": read[i]} if i in read else r for i, r in enumerate(records)]


def classify(
    records: list[dict],
    judge: Callable[[list[dict]], list[str]] | None = None,
    th: Thresholds = Thresholds(),
    extractor: Callable[[list[dict]], list[str | None]] | None = None,
) -> list[dict]:
    """Each record with its `category`, `extracted` answer, who read it (`extracted_by`: rules or judge) and `reason`
    (why `other`); where the rules read no single answer, `extractor` (a judge that reads text) may read it first
    (rule 8). The responses the rules leave open go to `judge` in one call (a verdict per record: knowledge,
    reasoning or unjudged; a judge with `log_odds` after the call: how sure it was, kept as `judge_log_odds`), else
    are unjudged."""
    if extractor is not None:
        records = judge_extracted(records, extractor, th)
    verdicts = [by_rules(r, th) for r in records]
    open_ = [i for i, v in enumerate(verdicts) if v.category is None]
    said = judge([records[i] for i in open_]) if judge is not None and open_ else ["unjudged"] * len(open_)
    odds = list(getattr(judge, "log_odds", None) or []) if judge is not None and open_ else []
    decided = dict(zip(open_, said))
    sure = dict(zip(open_, odds)) if len(odds) == len(open_) else {}
    out = []
    for i, (r, v) in enumerate(zip(records, verdicts)):
        category = v.category or decided[i]
        assert category in CATEGORIES, category
        extra = {"judge_log_odds": sure[i]} if i in sure else {}
        out.append(
            {**r, "category": category, "extracted": v.extracted, "extracted_by": v.extracted_by, "reason": v.reason}
            | extra
        )
    return out


# ---- what a model's responses add up to ---------------------------------------------------------------------
def summary(records: list[dict], group_of: Callable[[str], str]) -> dict:
    """Counts and shares of every category, the catastrophic-failure rate (incoherent + repetitive), the
    knowledge-error rate, the accuracy, and per subject group its questions and accuracy."""
    n = len(records)
    counts = Counter(r["category"] for r in records)
    groups: dict[str, dict] = {}
    for r in records:
        g = groups.setdefault(group_of(r["subject"]), {"n": 0, "correct": 0})
        g["n"] += 1
        g["correct"] += r["category"] == "correct"
    for g in groups.values():
        g["accuracy"] = g["correct"] / g["n"]

    def share(*cats: str) -> float | None:
        return sum(counts[c] for c in cats) / n if n else None

    return {
        "n": n,
        "judge_sureness": sureness(records),
        "judge_extracted": sum(r.get("extracted_by") == "judge" for r in records),
        "counts": {c: counts[c] for c in CATEGORIES},
        "shares": {c: share(c) for c in CATEGORIES},
        "catastrophic": share(*CATASTROPHIC),
        "knowledge_errors": share("knowledge"),
        "accuracy": share("correct"),
        "groups": dict(sorted(groups.items())),
    }


#: a verdict less sure than 3:1 either way (|log-odds| < log 3) counts as unsure
UNSURE = math.log(3)


def sureness(records: list[dict]) -> dict | None:
    """How sure the judge was of its verdicts (the records with `judge_log_odds`): how many, the median |log-odds|
    and the share less sure than 3:1; None when it gave no odds."""
    odds = sorted(abs(r["judge_log_odds"]) for r in records if r.get("judge_log_odds") is not None)
    if not odds:
        return None
    mid = len(odds) // 2
    median = odds[mid] if len(odds) % 2 else (odds[mid - 1] + odds[mid]) / 2
    return {"n": len(odds), "median_abs_log_odds": median, "unsure": sum(x < UNSURE for x in odds) / len(odds)}


def thresholds_of(d: dict) -> Thresholds:
    return Thresholds(**{k: d[k] for k in asdict(Thresholds()) if k in d})
