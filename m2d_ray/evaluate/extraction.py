"""The final answer a generated response gives, and the letter of an answer key: what the error taxonomy
(evaluate/taxonomy.py) reads of a response before it classifies it, and what benchmarks/science/answer_extraction.py
measures alone against the extractors people use. Pure functions: no model, no files.

**Answer extraction** (`extract`): as a careful grader reads a response, by eight ordered rules, each with its
  reason, in the comment block before `extract` (the model's own answer only; a choice's text before a single
  letter; the common statements wherever they stand; negations, hypotheticals and questions not taken; hedges by
  meaning; what a letter is; the final statement counts; the judge where no rule finds one). The text read is the
  answer up to where the model's answer ended: generation stops at the next question or chat turn it starts
  writing, and saved answers are cut there too (questions.py, `answer_part`). A truncated response states nothing:
  responses read back from a file carry no finish reason, so both count the same.

**The answer key** (`key_letter`): a letter of the choices (either case), an integer (numpy's too) counted from 0
  (as Hugging Face's MMLU stores it: 1 is B) or, when asked or detected (`integer_base`: a file whose keys include
  the number of choices and never 0), from 1, or one choice's exact text (surrounding spaces aside); a one-letter
  string is a letter. Anything else is no key (a JSON string "1" is no index: an index is a number).
"""

from __future__ import annotations

import numbers
import re
import unicodedata
from collections.abc import Iterable

#: why an extracted answer is no choice, or why there is none
NO_ANSWER, OUTSIDE = "no final answer", "answer outside the choices"
HEDGED = "hedged: no single answer"


# ---- the final answer -------------------------------------------------------------------------------------------
# The rules a careful grader follows, in order (docs/how-to/analyze.md shows them with examples; benchmarks/
# extraction.py measures them against the extractors people use):
#
#  1. Read only the model's own answer. The text from the next question or chat turn it starts writing on is cut
#     before the rules read it (questions.answer_part), and full-width characters are read as their ASCII forms
#     (NFKC: "答案：Ｄ" is "答案:D"). Why: a base model's made-up next question has an answer of its own.
#  2. A choice's own text before a single letter. Where an answer is stated, the text there is compared with every
#     choice's text, normalised (case, punctuation, spacing, and a choice's own "A." / "(A)" / "1)" prefix
#     dropped); a letter is read only when no choice's text stands there, or when the letter is written as a label
#     ("(B)", "B.", "B)"). Why: MMLU's choices "I only", "II and III", "A rise in interest rates" begin like letters.
#  3. The statements of an answer, wherever they stand: after a cue ("the answer is", "Answer:", "Answer -",
#     "the correct option would be", "I'd go with", "it can only be", "must be", "has to be", \\boxed{...}, and
#     the non-English ones multilingual students write: 答案是, 正确答案, 答えは, "Die Antwort ist", "la réponse
#     est", "la respuesta es", "a resposta é", "la risposta è", "Ответ:"); a letter said to be right ("D is the
#     correct answer", "(D) is correct"); a concluding sentence that is only a letter ("So B.", "Thus, (B)."); the
#     final line when it is a letter ("B", "**B**") or a choice as the prompt lists them ("B. Mitochondria", not one
#     line of a list of choices). Why: these are how models say it; a grader reads them all.
#  4. Not an answer: a negated statement ("the answer is not A", "D is incorrect", "it can't be D"), a hypothetical
#     one (its cue inside a clause opened by if / suppose / assume / unless / whether: "If the answer is D, ..."),
#     one in a question ("Is the answer D?"). Why: they name a letter the model does not commit to.
#  5. Hedges by meaning: two different letters offered as the answer ("B or C", "either B or C", "B/C", "B and C",
#     "B, or possibly C", "B (though maybe C)", "B, but C is also plausible") are no single answer; a second letter
#     that only starts a clause of its own ("B, and D is far too large") is no hedge. Why: adjacency is not meaning.
#  6. What a letter is: an upper-case letter; one that is also a word ("A", "I", or lower case "a", "d") only when it
#     stands as a label: bracketed, before punctuation or the line's end, or before a connective ("d since ...");
#     "A metal, namely copper (B)" reads the bracketed B; a numbered choice ("3) oxygen", "(3)") is the third
#     letter when the choices are lettered; several capitals as one token ("AB") are an answer outside the choices.
#     Weak cues (must / would / has to be, go with) count only with a letter written as a label or a choice's text.
#  7. The final answer counts: the last statement that names one; a final line that is a letter (rule 3) after it
#     wins. A cue that names nothing ("the answer is clear") is read only when no statement names an answer: an
#     answer outside the choices. No statement at all is no final answer (a truncated response has none).
#  8. Where these rules find no single answer (none, or a hedge) and a judge is configured that can read text, the
#     judge may extract it (`classify(..., extractor=)`), recorded as `extracted_by: judge`. Why: what no rule
#     reads a reader still can (as xFinder-style extractors do), and the record says who read it.
_NOT = r"(?!\s*n['’]t\b|\s+not\b|\s+nicht\b)"
_BE = r"(?:is|was|would\s+be|should\s+be|must\s+be|will\s+be|has\s+to\s+be|seems\s+to\s+be|=)"
#: cues whose statement is the answer: one naming nothing is still read (rule 7)
_STRONG = re.compile(
    r"\b(?:final\s+|correct\s+|right\s+|best\s+|my\s+)?answer[*_]*(?:\s+to\s+(?:this|the)\s+question)?"
    rf"\s*(?:{_BE}\b{_NOT}[\s*_]*:?|[:=]|\s*[-–—]\s)"
    rf"|\b(?:correct|right|best|only\s+correct)\s+(?:option|choice|letter|one)\s+(?:here\s+)?{_BE}\b{_NOT}[\s*_]*:?"
    r"|(?=\\boxed\{)"
    r"|(?:正确)?答案(?:应该|應該)?(?:是|为|為|选|選)?(?!\s*不)\s*:?|正确选项(?:是|为)?\s*:?|(?:故|应|所以|因此)选"
    r"|答えは|正解は"
    r"|\b(?:richtige\s+)?antwort\s*(?:(?:ist|lautet)\b(?!\s+nicht)|:)"
    r"|\b(?:bonne\s+)?réponse\s*(?:(?:correcte\s+)?est\b|:)"
    r"|\brespuesta\s*(?:(?:correcta\s+)?es\b|:)|\bresposta\s*(?:(?:correta\s+)?é|:)|\brisposta\s*(?:(?:corretta\s+)?è|:)"
    r"|(?:правильный\s+)?ответ\s*(?:[:—-]|это\b)",
    re.IGNORECASE,
)
#: cues that are statements only with a letter written as a label or a choice's text (rule 6)
_WEAK = re.compile(
    r"\b(?:must|has\s+to|have\s+to|can\s+only|could\s+only|would|should)\s+be\b(?!\s+not\b)"
    r"|\b(?:go(?:ing)?\s+with|choose|pick|select|opt\s+for)\b|\b(?:is|be)\b(?=\s+(?:option|choice)\b)"
    r"|\b(?:so|thus|hence|therefore)\s*,?\s*it['’]?s\b|\b(?:so|thus|hence|therefore)\s*,?\s*it\s+is\b(?!\s+not\b)",
    re.IGNORECASE,
)
#: a letter said to be right: "D is the correct answer", "(D) is correct", "Option B is right" (not "is incorrect")
_SAID_RIGHT = re.compile(
    r"(?<![A-Za-z0-9'’])(?:(?i:option|choice)\s+)?[(*\[]*(?P<x>[A-Z])[)*\]]*(?![A-Za-z0-9'’])"
    r"\s+(?:is|would\s+be|must\s+be|seems(?:\s+to\s+be)?|looks)\s+(?:the\s+)?(?:only\s+)?"
    r"(?i:correct|right|best|true\s+answer|answer)\b"
)
#: a concluding sentence that is only a letter: "So B.", "Thus, (B).", "Therefore option B!"
_CONCLUDE = re.compile(
    r"(?:^|(?<=[.!?:\n]))[ \t]*(?i:so|thus|hence|therefore|consequently|finally)\b[\s,:]*(?:(?i:option|choice)\s+)?"
    r"[(*\[]*(?P<x>[A-Z])[)*\]]*[ \t]*(?:[.!]|$)",
    re.MULTILINE,
)
#: what may stand before the answer itself: brackets, emphasis, LaTeX wrappers, "option", "choice", "either"
_OPEN = re.compile(
    r"(?:[\s*_:(\[{$]|\\boxed\{|\\(?:text|textbf|mathbf|mathrm|mathit|textit|bf)\s*\{?"
    r"|(?:the\s+)?(?:option|choice|letter|either)\b|it\s+is\b|it['’]s\b)*",
    re.I,
)
_CONNECTIVE = (
    "because|since|as|is|was|would|seems|and|or|but|so|for|with|which|this|that|here|there|then|thus|hence|"
    "therefore|given|due|in|on|of|by|from|to|—|-"
)
#: a letter written as a label: bracketed or emphasised, or followed by punctuation or the line's end
_LABEL = re.compile(r"[(\[]\s*([A-Za-z])\s*[)\]]|\*\*([A-Za-z])\*\*|([A-Za-z])(?=\s*(?:[).:,;!?\]}*$\"“”]|$))")
_BARE_LETTER = re.compile(r"([A-Za-z])(?![A-Za-z0-9'’])")
_NUMBERED = re.compile(r"\(?(\d{1,2})(?:\)|\.(?!\d))")
_TOKEN = re.compile(r"[A-Z]{2,}(?![A-Za-z0-9])")  # "AB": several letters as one answer
_IN_BRACKETS = re.compile(r"\(([A-Z])\)")
#: a second letter offered beside the first: "or C", "/C", "and C" (not "and C is ...": a clause of its own)
_ALSO = re.compile(
    r"^[\s*_)\]},$(]*(?:(?i:or|and)\b|/|&)[\s*_(\[{]*(?:(?i:possibly|maybe|perhaps|even)\s+)?"
    r"(?:(?i:option|choice)\s+)?([A-Z])(?![A-Za-z0-9'’])(?![\s*)\]]*(?:is|was|would|seems|has|can|could|might)\b)"
)
#: a letter offered with doubt later in the sentence: "(though maybe C)", "or possibly C", "C is also plausible"
_DOUBT = re.compile(
    r"\b(?i:maybe|possibly|perhaps|probably|might\s+be|could\s+(?:also\s+)?be)\s+(?:(?i:option|choice)\s+)?"
    r"[(*]*([A-Z])(?![A-Za-z0-9'’])"
    r"|(?<![A-Za-z0-9])([A-Z])[)*]*\s+(?:is|seems|could\s+be|might\s+be)\s+(?:also|equally)\s+"
    r"(?i:plausible|possible|correct|right|valid|likely)"
)
_HYPOTHETICAL = re.compile(r"\b(?:if|suppose|supposing|assume|assuming|unless|whether)\b", re.I)
_CLAUSE_END = re.compile(r"[,;:.!?\n]|\bthen\b", re.I)
_SENTENCE_END = re.compile(r"[.!?](?=\s|$)|\n|。|？|！")
_CHOICE_PREFIX = re.compile(r"^\s*(?:\(?[A-Za-z0-9]\)|[A-Za-z0-9][.:])\s+")
_BARE = re.compile(r"^[\s*_(\[]*([A-Z])[\s*_)\].:]*$")
_LISTED = re.compile(r"^\s*[(*]*([A-Z])[).:]\**\s+(\S.*)$")  # a line as the prompt lists a choice: "B. text"
_EDGE = " .,;:!*_})]$\"'"


def letters(n: int) -> str:
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


def _canon(text: str) -> str:
    """A text as rule 2 compares it: lower case, punctuation as spaces, one space between words."""
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def _choice_texts(choices: list[str]) -> list[str]:
    return [_canon(_CHOICE_PREFIX.sub("", c)) for c in choices]


def _choice(said: str, choices: list[str]) -> int | None:
    """The one choice whose text the statement gives: equal to it, else starting with it where a word ends (the
    longest such choice); None when no choice or several equal ones do."""
    s, texts = _canon(said), _choice_texts(choices)
    for hit in (
        [i for i, t in enumerate(texts) if t and s == t],
        [i for i, t in enumerate(texts) if t and (s == t or s.startswith(t + " "))],
    ):
        if hit:
            longest = max(len(texts[i]) for i in hit)
            best = [i for i in hit if len(texts[i]) == longest]
            return best[0] if len(best) == 1 else None
    return None


def _sentence(text: str, start: int) -> str:
    """The rest of the sentence from `start`."""
    m = _SENTENCE_END.search(text, start)
    return text[start : m.start() if m else len(text)]


def _letter_at(said: str, strict: bool) -> tuple[str, int] | None:
    """(letter, end) of a letter at the start of `said` (rule 6); `strict`: only one written as a label."""
    m = _LABEL.match(said)
    if m is not None:
        return (m.group(1) or m.group(2) or m.group(3)).upper(), m.end()
    m = _BARE_LETTER.match(said)
    if m is None:
        return None
    x = m.group(1)
    if strict or x in "AI" or x.islower():  # also a word (or a weak cue's): a letter only before a connective
        nxt = re.match(r"\s+([\w—-]+)", said[m.end() :])
        if nxt is None or not re.fullmatch(_CONNECTIVE, nxt.group(1), re.I):
            return None
    return x.upper(), m.end()


def _hedge(text: str, first: str, end: int, valid: str) -> str | None:
    """A second letter offered as the answer after `first` (rule 5), within its sentence."""
    rest = _sentence(text, end)
    m = _ALSO.match(rest)
    if m is not None and m.group(1) != first:
        return m.group(1)
    for m in _DOUBT.finditer(rest):
        other = m.group(1) or m.group(2)
        if other != first and other in valid:
            return other
    return None


def _named(text: str, at: int, choices: list[str], strict: bool) -> tuple[tuple[str, str], int] | None:
    """What the statement at `at` names, as ((extracted, why), where it ends); None when it names no answer."""
    line_end = text.find("\n", at)
    line = text[at : len(text) if line_end < 0 else line_end]
    if not line.strip(_EDGE + " \t") and line_end >= 0:  # a cue that ends its line: the answer is on the next
        nxt = text.find("\n", line_end + 1)
        at, line = line_end + 1, text[line_end + 1 : len(text) if nxt < 0 else nxt]
    skip = _OPEN.match(line).end()
    said, start, valid = line[skip:], at + skip, letters(len(choices))
    labelled = re.match(r"[(\[]?\s*[A-Za-z]\s*[)\].:](?:\s|$)", said) is not None
    i = None if labelled else _choice(said, choices)
    if i is not None:  # rule 2: the choice's own text before a letter
        return (valid[i], ""), start + len(said)
    got = _letter_at(said, strict)
    if got is not None:
        x, end = got
        other = _hedge(text, x, start + end, valid)
        if other is not None:
            return (f"{x}/{other}", HEDGED), start + end
        return (x, "" if x in valid else OUTSIDE), start + end
    n = _NUMBERED.match(said)
    if n is not None and 1 <= int(n.group(1)) <= len(choices):  # "3) oxygen": the third of lettered choices
        return (valid[int(n.group(1)) - 1], ""), start + n.end()
    if strict:
        return None
    inside = _IN_BRACKETS.search(_sentence(text, start))  # "A metal, namely copper (B)"
    if inside is not None:
        x = inside.group(1)
        return (x, "" if x in valid else OUTSIDE), start + inside.end()
    token = _TOKEN.match(said)
    if token is not None:
        return (token.group(), OUTSIDE), start + token.end()
    return None


def _committed(text: str, at: int) -> bool:
    """Rule 4: the statement whose cue starts at `at` is neither hypothetical (its clause opened by "if", or the
    "would" of a sentence opened by one: "If water boiled at 50 °C, A would be right"; "If I had to choose, ..." is
    a choice) nor in a question."""
    clause_start = max((m.end() for m in _CLAUSE_END.finditer(text, 0, at)), default=0)
    if _HYPOTHETICAL.search(text, clause_start, at):
        return False
    start = max((m.end() for m in _SENTENCE_END.finditer(text, 0, at)), default=0)
    end = _SENTENCE_END.search(text, at)
    if re.match(r"\s*(?:if|suppose|assuming|imagine)\b(?!\s+I\b)", text[start:at], re.I) and re.search(
        r"\bwould\b", text[at : end.start() if end else len(text)], re.I
    ):
        return False
    return end is None or end.group() not in ("?", "？")


def _statements(text: str, choices: list[str]) -> tuple[list[tuple[int, tuple[str, str]]], tuple[str, str] | None]:
    """Every committed statement that names an answer, as (where, (extracted, why)); and the last strong cue's text
    when it names nothing (rule 7's fallback)."""
    found: list[tuple[int, tuple[str, str]]] = []
    nothing = None
    for cue in _STRONG.finditer(text):
        if not _committed(text, cue.start()):
            continue
        got = _named(text, cue.end(), choices, strict=False)
        if got is not None:
            found.append((got[1], got[0]))
        else:
            said = next((ln for ln in text[cue.end() :].split("\n") if ln.strip()), "").strip().strip(_EDGE)
            nothing = (said[:80], OUTSIDE) if said else nothing
    for cue in _WEAK.finditer(text):
        if _committed(text, cue.start()):
            got = _named(text, cue.end(), choices, strict=True)
            if got is not None and not got[0][1] == OUTSIDE:
                found.append((got[1], got[0]))
    valid = letters(len(choices))
    for pattern in (_SAID_RIGHT, _CONCLUDE):
        for m in pattern.finditer(text):
            if _committed(text, m.start()) and not _negated_before(text, m.start()):
                x = m.group("x")
                other = _hedge(text, x, m.end("x"), valid) if pattern is _SAID_RIGHT else None
                found.append((m.end("x"), (f"{x}/{other}", HEDGED) if other else (x, "" if x in valid else OUTSIDE)))
    return sorted(found, key=lambda f: f[0]), nothing


def _negated_before(text: str, at: int) -> bool:
    """ "not (D) is correct" / "it is not true that D is right": a negation just before a letter said to be right."""
    return re.search(r"\b(?:not|n['’]t|no)\s*$", text[max(0, at - 12) : at], re.I) is not None


def _final_line(text: str, choices: list[str]) -> tuple[str, str] | None:
    """Rule 3's final line: only a letter, or one choice as the prompt lists it (not a line of a list of them)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    valid = letters(len(choices))
    bare = _BARE.match(lines[-1])
    if bare is not None:
        x = bare.group(1)
        return x, "" if x in valid else OUTSIDE
    listed = _LISTED.match(lines[-1])
    if listed is None or (len(lines) > 1 and _LISTED.match(lines[-2])):
        return None
    x, said = listed.group(1), listed.group(2)
    i = _choice(said, choices)
    if x not in valid or (i is not None and valid[i] != x):
        return None  # a letter and another choice's text: no single answer read from this line
    return x, ""


#: a letter standing alone ("A" and "I" before a lower-case word are words)
_LETTER_TOKEN = re.compile(
    r"(?<![A-Za-z0-9'’])([A-Z])(?![A-Za-z0-9'’])(?!\s+[a-z])|(?<![A-Za-z0-9'’])([B-HJ-Z])(?=\s+[a-z])"
)
_ENDS_LETTER = re.compile(
    r"(?<![A-Za-z0-9'’])(?:(?:(?i:option|choice)\s+)?[(*\[]*(?P<up>[A-Z])|(?:(?i:option|choice)\s+)?\((?P<low>[a-z])(?=\))|(?i:option|choice)\s+"
    r"(?P<opt>[a-z]))[)*\]]*(?:[).:]\s+(?P<text>[^\n]+?))?[\s*_]*[.!]?[\s*_]*$"
)
_ENDS_TEXT = re.compile(r".*(?:\b(?:is|are|be|was)\b|:)\s*(?P<text>\S.*?)[\s*_]*[.!]?[\s*_]*$", re.I | re.S)
_NEGATION = re.compile(r"\b(?:not|cannot|never|rule\s+out|ruled\s+out|eliminate|except|excluding)\b|n['’]t\b", re.I)


def _final_sentence(text: str, choices: list[str]) -> tuple[int, tuple[str, str]] | None:
    """Rule 3's final sentence: it ends with a letter ("That leaves B.", "So my pick is B) Silver.", "I would answer
    C.", "**C**") and names no other letter of the choices, or it ends with one choice's whole text after "is" or a
    colon ("... is forum non conveniens."); neither negated, hypothetical nor a question."""
    body = text.rstrip()
    if not body or body.endswith(("?", "？")):
        return None
    ends = [m.end() for m in _SENTENCE_END.finditer(body) if m.end() < len(body.rstrip(".!* _"))]
    start = ends[-1] if ends else 0
    sentence, valid = body[start:], letters(len(choices))
    if _NEGATION.search(sentence) or not _committed(body, start + len(sentence) - len(sentence.lstrip())):
        return None
    m = _ENDS_LETTER.search(sentence)
    if m is not None:
        x = (m.group("up") or m.group("low") or m.group("opt")).upper()
        said = m.group("text")
        if said is not None and _choice(said, choices) != valid.find(x):
            return None
        named = {a or b for a, b in _LETTER_TOKEN.findall(sentence[: m.start()])} & set(valid)
        if x in valid and not named - {x}:
            return start + m.end(), (x, "")
        return None
    m = _ENDS_TEXT.match(sentence)
    if m is not None:
        s, texts = _canon(m.group("text")), _choice_texts(choices)
        hit = [i for i, t in enumerate(texts) if t and s == t]
        if len(hit) == 1:
            return start + m.end(), (valid[hit[0]], "")
    return None


def extract(response: str, choices: list[str]) -> tuple[str | None, str]:
    """The final answer a response gives, as (extracted, why): a letter of the choices and ""; else what was given
    and why it is no choice (OUTSIDE: a letter, token or text outside the choices; HEDGED: two letters offered);
    else (None, NO_ANSWER). The rules above, in their order."""
    text = unicodedata.normalize("NFKC", response)
    found, nothing = _statements(text, choices)
    last = _final_line(text, choices)
    if last is not None:
        return last
    end = _final_sentence(text, choices)
    if end is not None and (not found or end[0] >= found[-1][0]):
        return end[1]
    if found:
        return found[-1][1]
    return nothing or (None, NO_ANSWER)


def key_letter(key: object, choices: list[str], base: int = 0) -> str:
    """The letter of an answer key (the module docstring's rule; integers counted from `base`: 0 as Hugging Face's
    MMLU stores them, 1 when asked or detected: `integer_base`); ValueError saying what it is otherwise."""
    valid = letters(len(choices))
    if isinstance(key, numbers.Integral) and not isinstance(key, bool):  # numpy's integers too
        if 0 <= int(key) - base < len(choices):
            return valid[int(key) - base]
        raise ValueError(
            f"is {key}, not an index of its {len(choices)} choices ({base} to {len(choices) - 1 + base}, counted "
            f"from {base})"
        )
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


def integer_base(keys: Iterable[tuple[object, int]]) -> int:
    """The base a file's integer keys count from, given (key, its number of choices) per line: 1 when some key is
    its number of choices (no 0-based index) and none is 0 (no 1-based one), else 0 (Hugging Face's MMLU)."""
    ints = [(int(k), n) for k, n in keys if isinstance(k, numbers.Integral) and not isinstance(k, bool)]
    return 1 if any(k == n for k, n in ints) and not any(k == 0 for k, _ in ints) else 0
