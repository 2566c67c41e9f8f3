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
- **Answer extraction.** A statement of the answer is a cue ("the answer is", "answer would be", "Answer:",
  "**Answer**:", "the correct option is", "\\boxed{") not negated ("the answer isn't A", "is not A"), then, past
  brackets, emphasis, LaTeX wrappers and the words "option", "choice", "letter", "either", on its line (or the
  next line when the cue ends one): a letter (upper case; lower case only before punctuation or the line's end: "the
  answer is a. ..." but not "the answer is a fact"), two different letters joined by or / and / "/" (a hedge: no
  single answer), several capitals as one token ("AB": outside the choices), or the text of exactly one choice
  (equal to it, or starting with it where a word ends). The **final** answer counts: the last statement that names
  one, and a last line that is only a letter ("B", "(B)", "**B**", "B.") after it. A statement that names nothing
  ("the answer is clear") is read only when no statement names an answer: an answer outside the choices. No
  statement and no such line is no final answer (a truncated response has none: responses read back from a file
  carry no finish reason, so both count the same). The text read is the answer up to where the model's answer
  ended: generation stops at the next question it starts writing, and saved answers are cut there too
  (questions.py, `answer_part`), so a base model's next question is never read as its answer.
- **The answer key** (`key_letter`): a letter of the choices (either case), an integer counted from 0 (as Hugging
  Face's MMLU stores it: 1 is B), or one choice's exact text (surrounding spaces aside); a one-letter string is a
  letter. Anything else is no key (a JSON string "1" is no index: an index is a number).
- **Empty responses** have no words: no ratio is defined, so they are not incoherent; they have no final answer
  (not topic drift: there is no text to drift).
Every threshold is a field of `config.Thresholds` (the paper's values are the defaults; `stage3.analysis.*` sets them).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from m2d_ray.config import Thresholds

#: every category, in the order the report stacks them (best first)
CATEGORIES = ("correct", "knowledge", "reasoning", "other", "repetitive", "incoherent", "unjudged")
JUDGED = ("knowledge", "reasoning")  # what a judge decides
CATASTROPHIC = ("incoherent", "repetitive")
#: why a response is `other`
DRIFT, NO_ANSWER, OUTSIDE = "topic drift", "no final answer", "answer outside the choices"
HEDGED = "hedged: no single answer"

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


# ---- the final answer -------------------------------------------------------------------------------------------
#: where a statement of the answer begins: "the answer is", "answer:", "**Answer**:", "the correct option is",
#: "\boxed{" (never a negated one: "the answer isn't A", "the answer is not A")
_CUE = re.compile(
    r"\banswer[*_]*\s*(?:(?:is|would\s+be|should\s+be|must\s+be)\b(?!\s*n['’]t|\s+not\b)[\s*_]*:?|:)"
    r"|\b(?:correct|right|best)\s+(?:option|choice)\s+is\b(?!\s*n['’]t|\s+not\b)[\s*_]*:?"
    r"|(?=\\boxed\{)",
    re.IGNORECASE,
)
#: what may stand before the answer itself: brackets, emphasis, LaTeX wrappers, "option", "choice", "either"
_OPEN = re.compile(r"(?:[\s*_:(\[{$]|\\boxed\{|\\text(?:bf)?\{|\\mathrm\{|(?:option|choice|letter|either)\b)*", re.I)
_LETTER = re.compile(r"(?P<up>[A-Z])(?![A-Za-z0-9])|(?P<low>[a-z])(?=[).:,;\]}*]|\s*$)")
_TOKEN = re.compile(r"[A-Z]{2,}(?![A-Za-z0-9])")  # "AB": several letters as one answer
_OTHER = re.compile(r"[\s*_)\]},$]*(?:(?i:or|and)\b|/|&)[\s*_(\[{]*(?:(?i:option|choice)\s+)?([A-Z])(?![A-Za-z0-9])")
_BARE = re.compile(r"^[\s*_(\[]*([A-Z])[\s*_)\].:]*$")
_EDGE = " .,;:!*_})]$\"'"


def letters(n: int) -> str:
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def _norm(text: str) -> str:
    return " ".join(text.split()).strip(_EDGE).lower()


def _choice(said: str, choices: list[str]) -> int | None:
    """The one choice whose text the statement gives: equal to it, else starting with it (then a word ends); None
    when no choice or several do."""
    s = _norm(said)
    texts = [_norm(c) for c in choices]
    for hit in (
        [i for i, t in enumerate(texts) if t and s == t],
        [i for i, t in enumerate(texts) if t and _starts(s, t)],
    ):
        if hit:
            return hit[0] if len(hit) == 1 else None
    return None


def _starts(said: str, text: str) -> bool:
    return said.startswith(text) and not said[len(text) : len(text) + 1].isalnum()


def _statement(span: str, choices: list[str]) -> tuple[str, str] | None:
    """What one statement says, read from the text after its cue: (extracted, why-not-a-choice) as `extract`
    returns them, or None when it names no answer at all ("the answer is clear")."""
    line = next((ln for ln in span.split("\n") if ln.strip(_EDGE + " \t")), "")
    said = line[_OPEN.match(line).end() :]
    m = _LETTER.match(said)
    if m is not None:
        first = (m.group("up") or m.group("low")).upper()
        other = _OTHER.match(said, m.end())
        if other is not None and other.group(1) != first:
            return f"{first}/{other.group(1)}", HEDGED
        return first, "" if first in letters(len(choices)) else OUTSIDE
    token = _TOKEN.match(said)
    i = _choice(said, choices)
    if i is not None:
        return letters(len(choices))[i], ""
    if token is not None:
        return token.group(), OUTSIDE
    return None


def extract(response: str, choices: list[str]) -> tuple[str | None, str]:
    """The final answer a response gives, as (extracted, why): a letter of the choices and ""; else what was given
    and why it is no choice (OUTSIDE: a letter, token or text outside the choices; HEDGED: two letters offered);
    else (None, NO_ANSWER). See the module docstring for the shapes read."""
    read, last_text = None, None
    for cue in _CUE.finditer(response):
        span = response[cue.end() :]
        got = _statement(span, choices)
        if got is not None:
            read = got
        else:
            text = next((ln for ln in span.split("\n") if ln.strip()), "").strip().strip(_EDGE)
            last_text = (text[:80], OUTSIDE) if text else last_text
    last = next((ln for ln in reversed(response.splitlines()) if ln.strip()), "")
    bare = _BARE.match(last)
    if bare is not None:
        letter = bare.group(1)
        return letter, "" if letter in letters(len(choices)) else OUTSIDE
    return read or last_text or (None, NO_ANSWER)


def key_letter(key: object, choices: list[str]) -> str:
    """The letter of an answer key (the module docstring's rule); ValueError saying what it is otherwise."""
    valid = letters(len(choices))
    if isinstance(key, int) and not isinstance(key, bool):
        if 0 <= key < len(choices):
            return valid[key]
        raise ValueError(f"is {key}, not an index of its {len(choices)} choices (0 to {len(choices) - 1})")
    if not isinstance(key, str):
        raise ValueError(f"is {key!r}, neither a letter, an integer index nor a choice's text")
    text = key.strip()
    if len(text) == 1 and text.upper() in valid:
        return text.upper()
    same = [i for i, c in enumerate(choices) if c.strip() == text]
    if len(same) == 1:
        return valid[same[0]]
    which = f"the text of {len(same)} choices" if same else f"no letter {valid[:1]}-{valid[-1:]} nor a choice's text"
    raise ValueError(f"is {key!r}: {which}")


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
    got, why = extract(text, choices)
    if incoherent(text, th):
        return Verdict("incoherent", got)
    if repetitive(text, th):
        return Verdict("repetitive", got)
    if not why and got == r["answer"]:
        return Verdict("correct", got)
    ws = words(text)
    drift = overlap(ws, keywords(r["question"], choices))
    if ws and drift is not None and drift < th.overlap:
        return Verdict("other", got, DRIFT)
    if why:
        return Verdict("other", got, why)
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
