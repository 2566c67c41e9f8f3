"""The paper's error taxonomy of a generated answer ("Qualitative analysis", "Error taxonomy" appendix), as pure
functions: no model, no files. A response is put in one category, checked in this order (the first that matches
wins):

    incoherent   filler-word ratio > 35% and unique-word ratio < 15%, or digit ratio > 30%     (rule)
    repetitive   some word 3-gram occurs >= 5 times                                         (rule)
    correct      the extracted final answer is the key                                      (rule)
    other        topic drift (keyword overlap with the question < 15%), no final answer,    (rule)
                 or an answer outside the choices
    knowledge    coherent and on-topic, wrong: a wrong fact                                 (judge)
    reasoning    coherent and on-topic, wrong: flawed logic                                 (judge)
    unjudged     would go to the judge, and none was asked (or it gave no verdict)

What the paper leaves open, decided here (the README's analysis section says the same):
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
- **Answer extraction.** The first explicit statement of the answer ("the answer is (B)", "Answer: B", "final
  answer: **B**", "\\boxed{B}"), as lm-eval's chain-of-thought MMLU takes the first match (a base model that goes
  on writing the next question after its answer is read at its answer); a letter in that statement is taken as
  written in upper case, in lower case only when punctuation or the end follows it ("the answer is a. ..." but not
  "the answer is a fact"); a statement that names a choice's text instead of a letter maps to that choice. Without
  a statement, a last line that is only a letter ("B", "(B)", "B.") is the answer. A statement that names no choice
  is an answer outside the choices; no statement and no such line is no final answer (a truncated response has
  none: responses read back from a file carry no finish reason, so both count the same).
- **Empty responses** have no words: no ratio is defined, so they are not incoherent; they have no final answer.
Every threshold is a field of `Thresholds` (the paper's values are the defaults; `stage3.analysis.*` sets them).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

#: every category, in the order the report stacks them (best first)
CATEGORIES = ("correct", "knowledge", "reasoning", "other", "repetitive", "incoherent", "unjudged")
JUDGED = ("knowledge", "reasoning")  # what a judge decides
CATASTROPHIC = ("incoherent", "repetitive")
#: why a response is `other`
DRIFT, NO_ANSWER, OUTSIDE = "topic drift", "no final answer", "answer outside the choices"

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


@dataclass(frozen=True)
class Thresholds:
    """The rules' thresholds; the defaults are the paper's."""

    filler_ratio: float = 0.35  # incoherent: filler words / words above this ...
    unique_ratio: float = 0.15  # ... and distinct words / words below this
    digit_ratio: float = 0.30  # incoherent: digits / non-space characters above this
    ngram: int = 3  # repetitive: a word n-gram of this length ...
    repeats: int = 5  # ... occurring at least this many times
    overlap: float = 0.15  # topic drift: question keywords the response uses, below this share


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


# ---- the final answer -------------------------------------------------------------------------------------------
_STATEMENT = re.compile(
    r"(?:answer\s*(?:is|:)|answer\s+would\s+be|(?=\\boxed\{))[\s*_(\[{$]*(?:\\boxed\{)?(?:\\text\{)?[\s*_(\[{]*(?P<ans>[^\n]*)",
    re.IGNORECASE,
)
_LETTER = re.compile(r"(?P<up>[A-Z])(?![A-Za-z])|(?P<low>[a-z])(?=[).:,;\]}*]|\s*$)")
_BARE = re.compile(r"^[\s*_(\[]*([A-Z])[\s*_)\].:]*$")


def letters(n: int) -> str:
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def extract(response: str, choices: list[str]) -> str | None:
    """The final answer a response states: a letter (A, B, ...; possibly outside the choices), else the text it
    states when that names no choice, else None (no final answer). See the module docstring for the formats."""
    m = _STATEMENT.search(response)
    if m is not None:
        stated = m.group("ans").strip()
        letter = _LETTER.match(stated)
        if letter is not None:
            return (letter.group("up") or letter.group("low")).upper()
        text = stated.rstrip(" .*_})]").lower()
        for i, choice in enumerate(choices):
            if text and text == choice.strip().rstrip(".").lower():
                return letters(len(choices))[i]
        return stated[:80] or None
    last = next((ln for ln in reversed(response.splitlines()) if ln.strip()), "")
    bare = _BARE.match(last)
    return bare.group(1) if bare else None


# ---- one response's category --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verdict:
    """A response's category by the rules, or None: the judge decides (a wrong, coherent, on-topic answer)."""

    category: str | None
    extracted: str | None
    reason: str = ""


def by_rules(r: dict, th: Thresholds = Thresholds()) -> Verdict:
    """The rules in the priority order of the module docstring, on one record (question, choices, answer,
    response)."""
    text, choices = r["response"], r["choices"]
    got = extract(text, choices)
    if incoherent(text, th):
        return Verdict("incoherent", got)
    if repetitive(text, th):
        return Verdict("repetitive", got)
    if got is not None and got == r["answer"]:
        return Verdict("correct", got)
    drift = overlap(words(text), keywords(r["question"], choices))
    if drift is not None and drift < th.overlap:
        return Verdict("other", got, DRIFT)
    if got is None:
        return Verdict("other", got, NO_ANSWER)
    if got not in letters(len(choices)):
        return Verdict("other", got, OUTSIDE)
    return Verdict(None, got)


def classify(
    records: list[dict], judge: Callable[[list[dict]], list[str]] | None = None, th: Thresholds = Thresholds()
) -> list[dict]:
    """Each record with its `category`, `extracted` answer and `reason` (why `other`); the responses the rules leave
    open go to `judge` in one call (a verdict per record: knowledge, reasoning or unjudged), else are unjudged."""
    verdicts = [by_rules(r, th) for r in records]
    open_ = [i for i, v in enumerate(verdicts) if v.category is None]
    said = judge([records[i] for i in open_]) if judge is not None and open_ else ["unjudged"] * len(open_)
    decided = dict(zip(open_, said))
    out = []
    for i, (r, v) in enumerate(zip(records, verdicts)):
        category = v.category or decided[i]
        assert category in CATEGORIES, category
        out.append({**r, "category": category, "extracted": v.extracted, "reason": v.reason})
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
        "counts": {c: counts[c] for c in CATEGORIES},
        "shares": {c: share(c) for c in CATEGORIES},
        "catastrophic": share(*CATASTROPHIC),
        "knowledge_errors": share("knowledge"),
        "accuracy": share("correct"),
        "groups": dict(sorted(groups.items())),
    }


def thresholds_of(d: dict) -> Thresholds:
    return Thresholds(**{k: d[k] for k in asdict(Thresholds()) if k in d})
