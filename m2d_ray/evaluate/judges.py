"""The judge of the analysis: knowledge error or reasoning error, for a wrong answer that the rules found coherent and
on-topic (evaluate/taxonomy.py).

    none            no judge: those answers stay `unjudged`
    teacher         a causal LM (the run's own MoE teacher; `m2d analyze --teacher MODEL`) scores the two label
                    continuations after `PROMPT` + an ask, in both label orders (`TEACHER_ASKS`: "1 for knowledge" and
                    "1 for reasoning"), and the verdict is the label likelier on average over the two orders (each
                    order's two likelihoods normalised, then averaged: a model's preference for the label " 1" or
                    for the first-named error cancels out); no free text is parsed. The labels are the digits " 1"
                    and " 2", which every tokenizer has; a tie (within `TIE` of even odds) is `unjudged`. How sure
                    it was is kept with each verdict: the log-odds of knowledge over reasoning (`log_odds`)
    openai:MODEL    any OpenAI-compatible chat-completions server (vLLM's, SGLang's, a hosted API) at `url`, asked
                    `PROMPT` + `OPENAI_ASK` for one word: a reply whose first word (after any `<think>...</think>` a
                    thinking model writes) is not a label, or that names both labels, is `unjudged`, never guessed.
                    The request asks for temperature 0 and up to `max_tokens` tokens (room for a reasoning model's
                    hidden reasoning or a thinking model's <think> before its word); a 400 that refuses `temperature`
                    (hosted reasoning models) drops it, one that asks for `max_completion_tokens` sends that instead
                    of `max_tokens`, for every later request. At most `rate` requests a second, retried with
                    exponential backoff on 408, 429, 5xx, network errors and bodies without a message (Retry-After
                    honoured, in seconds or as an HTTP date), all within `deadline` seconds per call (a model's
                    answers: stage3.analysis.judge_deadline); the key from the environment variable named
                    `key_env`. Where the rules read no single final answer it may be asked which letter the answer
                    commits to (`extract`: extraction.py's rule 8). `check` asks the server for the model itself
                    before any work: its /models lists it, else a one-token request to it is answered

A judge is called with the records to decide and returns one verdict per record; one that leaves more than a set
share of them `unjudged` (`shortfall`: stage3.analysis.max_unjudged) fails the model it judged. Its name and prompt
are recorded beside the results (`describe`).
"""

from __future__ import annotations

import datetime
import difflib
import email.utils
import http.client
import json
import math
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from m2d_ray.catalog.evaluate import parse_judge  # noqa: F401  (re-exported)
from m2d_ray.config import AnalysisConfig
from m2d_ray.errors import M2DError
from m2d_ray.evaluate.extraction import letters
from m2d_ray.evaluate.taxonomy import JUDGED

# Imported inside functions: torch and the generation loop (`m2d plan` reads this module without them).

KINDS = ("teacher", "none", "openai:MODEL")
PROMPT = (
    "A student answered a multiple choice question about {subject} and got it wrong.\n\n"
    "Question: {question}\n{choices}\nCorrect answer: {answer}\n\n"
    "The student's answer:\n{response}\n\n"
    "Is the student's mistake a knowledge error (a wrong fact, definition or recalled detail, in coherent and "
    "on-topic text) or a reasoning error (flawed logic in STEM: an attempt at logical, mathematical or scientific "
    "reasoning that reaches a wrong conclusion through flawed steps)?\n"
)
#: the teacher's two asks: the same labels in both orders (TEACHER_LABELS[0] is knowledge in the first, reasoning in
#: the second)
TEACHER_ASKS = (
    "Reply 1 for a knowledge error or 2 for a reasoning error.\nVerdict:",
    "Reply 1 for a reasoning error or 2 for a knowledge error.\nVerdict:",
)
TEACHER_LABELS = (" 1", " 2")
OPENAI_ASK = "Reply with one word: knowledge or reasoning."
#: the openai judge's question where the rules read no single final answer (extraction.py's rule 8)
EXTRACT = (
    "A student answered a multiple choice question about {subject}.\n\nQuestion: {question}\n{choices}\n\n"
    "The student's answer:\n{response}\n\n"
    "Which choice does the student's answer commit to as its final answer? Reply with its letter alone, or with the "
    "word none if it commits to no single choice."
)
CHECK_ASK = "Reply with one word: ready."


def _fields(r: dict) -> dict:
    choices = "\n".join(f"{x}. {c}" for x, c in zip(letters(len(r["choices"])), r["choices"]))
    return {"subject": r["subject"].replace("_", " "), "question": r["question"], "choices": choices}


def render(r: dict, ask: str) -> str:
    """The judge's whole prompt for record `r`."""
    return PROMPT.format(**_fields(r), answer=r["answer"], response=r["response"]) + ask


def shortfall(name: str, said: list[str], most: float, why: str = "") -> str | None:
    """The failure line of a judge that left more than `most` of the answers it was asked about `unjudged`, else
    None (a judge that cannot judge fails the model instead of passing its answers off as classified)."""
    left = said.count("unjudged")
    if not said or left / len(said) <= most:
        return None
    return (
        f"judge {name} left {left} of {len(said)} answers unjudged ({left / len(said):.0%} > {most:.0%}, "
        f"stage3.analysis.max_unjudged)" + (f": {why}" if why else "")
    )


# ---- teacher: the label continuations' log-likelihoods -----------------------------------------------------------
def context_ids(tokenizer, r: dict, room: int | None, ask: str = TEACHER_ASKS[0]) -> list[int]:
    """The teacher's prompt for `r` (ending with `ask`) as token ids, within `room` tokens: the answer's start is
    dropped first (its end holds the final answer), then the prompt's own start."""
    head, tail = (PROMPT + ask).split("{response}")
    fields = {**_fields(r), "answer": r["answer"]}
    pre = tokenizer(head.format(**fields), add_special_tokens=True)["input_ids"]
    body = tokenizer(r["response"], add_special_tokens=False)["input_ids"]
    post = tokenizer(tail, add_special_tokens=False)["input_ids"]
    if room is not None and len(pre) + len(body) + len(post) > room:
        body = body[len(body) - max(0, room - len(pre) - len(post)) :] if room > len(pre) + len(post) else []
    ids = pre + body + post
    return ids[len(ids) - room :] if room is not None and len(ids) > room else ids


def label_loglikelihoods(
    model, tokenizer, contexts: list[list[int]], labels: tuple[str, ...], batch_size: int = 16
) -> list[list[float]]:
    """log p(label | context) for every context and label, in float64 from the model's logits (sequences right-padded:
    a causal model's earlier positions never see the padding)."""
    import torch

    device = next(model.parameters()).device
    conts = [tokenizer(lab, add_special_tokens=False)["input_ids"] for lab in labels]
    seqs = [(c, x) for c in contexts for x in conts]
    out: list[float] = []
    for i in range(0, len(seqs), batch_size):
        chunk = seqs[i : i + batch_size]
        width = max(len(c) + len(x) for c, x in chunk)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        ids = torch.tensor([c + x + [pad] * (width - len(c) - len(x)) for c, x in chunk], device=device)
        mask = torch.tensor([[1] * (len(c) + len(x)) + [0] * (width - len(c) - len(x)) for c, x in chunk])
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask.to(device)).logits
        for row, (c, x) in enumerate(chunk):
            pos = torch.arange(len(c) - 1, len(c) + len(x) - 1, device=device)
            logp = torch.log_softmax(logits[row, pos].double(), dim=-1)
            out.append(float(logp[torch.arange(len(x)), torch.tensor(x, device=device)].sum()))
    n = len(labels)
    return [out[j : j + n] for j in range(0, len(out), n)]


@dataclass
class TeacherJudge:
    """A causal LM as the judge (model and tokenizer loaded by the caller)."""

    model: object
    tokenizer: object
    batch_size: int = 16
    name: str = "teacher"
    said: list[str] = field(default_factory=list)  # its last verdicts
    log_odds: list[float] = field(default_factory=list)  # and how sure it was: log P(knowledge) / P(reasoning)

    def why(self) -> str:
        return ties(self.said)

    def __call__(self, records: list[dict]) -> list[str]:
        from m2d_ray.evaluate.generation import context_of

        ctx = context_of(self.model)
        longest = max(len(self.tokenizer(x, add_special_tokens=False)["input_ids"]) for x in TEACHER_LABELS)
        room = None if ctx is None else ctx - longest
        contexts = [context_ids(self.tokenizer, r, room, ask) for r in records for ask in TEACHER_ASKS]
        s = self.scores(contexts)
        self.said = [verdict(s[i], s[i + 1]) for i in range(0, len(s), 2)]
        self.log_odds = [log_odds(knowledge_probability(s[i], s[i + 1])) for i in range(0, len(s), 2)]
        return self.said

    def scores(self, contexts: list[list[int]]) -> list[list[float]]:
        return label_loglikelihoods(self.model, self.tokenizer, contexts, TEACHER_LABELS, self.batch_size)


@dataclass
class StreamedTeacherJudge(TeacherJudge):
    """The teacher as the judge where no node holds it: `model` is its lazy checkpoint (weights.LazyTeacher), read a
    decoder layer at a time onto `device` for every sequence at once (one pass over its weights), the labels'
    log-likelihoods then taken from the final hidden states through its output head."""

    device: str = "cpu"

    def scores(self, contexts: list[list[int]]) -> list[list[float]]:
        return streamed_label_loglikelihoods(
            self.model, self.tokenizer, contexts, TEACHER_LABELS, self.batch_size, self.device
        )


def streamed_label_loglikelihoods(
    teacher, tokenizer, contexts: list[list[int]], labels: tuple[str, ...], batch_size: int, device: str
) -> list[list[float]]:
    """`label_loglikelihoods` of a lazy teacher streamed a decoder layer at a time (calibrate/stream.py): every
    sequence right-padded to one width in a single pass over the weights, the logits of the positions scored only,
    as the model's head gives them (a plain projection: a soft-capped or scaled head is refused by name)."""
    import torch

    from m2d_ray.arch.head import check_plain_head
    from m2d_ray.calibrate.stream import final_hidden_streamed
    from m2d_ray.weights import read_output_head

    check_plain_head(teacher.config)
    conts = [tokenizer(lab, add_special_tokens=False)["input_ids"] for lab in labels]
    seqs = [(c, x) for c in contexts for x in conts]
    width = max(len(c) + len(x) for c, x in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([c + x + [pad] * (width - len(c) - len(x)) for c, x in seqs])
    hidden = final_hidden_streamed(teacher, ids, batch_size, device)  # after the final norm, on the host
    head = read_output_head(teacher.name, hidden.dtype).to(device)
    out: list[float] = []
    for row, (c, x) in enumerate(seqs):
        pos = torch.arange(len(c) - 1, len(c) + len(x) - 1)
        logits = torch.nn.functional.linear(hidden[row, pos].to(device), head)
        logp = torch.log_softmax(logits.double(), dim=-1)
        out.append(float(logp[torch.arange(len(x)), torch.tensor(x, device=device)].sum()))
    n = len(labels)
    return [out[j : j + n] for j in range(0, len(out), n)]


def ties(said: list[str]) -> str:
    """Why a teacher judge left answers unjudged: ties."""
    n = said.count("unjudged")
    return f"{n} x a tie of the two errors (the same odds in both label orders)" if n else ""


def _first(scores: list[float]) -> float:
    """P(the first label) of two, from their log-likelihoods."""
    top = max(scores)
    e = [math.exp(x - top) for x in scores]
    return e[0] / sum(e)


def knowledge_probability(first: list[float], swapped: list[float]) -> float:
    """P(knowledge) averaged over the two label orders (`first`: the labels' log-likelihoods after TEACHER_ASKS[0],
    where label 1 is knowledge; `swapped`: after TEACHER_ASKS[1], where it is reasoning)."""
    return (_first(first) + 1.0 - _first(swapped)) / 2


def log_odds(p: float) -> float:
    """log(p / (1 - p)) of P(knowledge), rounded to 4 places, within +-27.6 (p within 1e-12 of 0 or 1: JSON has no
    infinity)."""
    p = min(max(p, 1e-12), 1 - 1e-12)
    return round(math.log(p / (1 - p)), 4)


#: how near even odds is no verdict: the same two sequences scored in other batches differ by float32 noise (4e-7
#: measured on the embedded teacher), which must not pass for a verdict
TIE = 1e-5


def verdict(first: list[float], swapped: list[float]) -> str:
    """The error likelier over both orders; one within TIE of even odds is no verdict (a tie)."""
    p = knowledge_probability(first, swapped)
    return "unjudged" if abs(p - 0.5) <= TIE else JUDGED[0] if p > 0.5 else JUDGED[1]


# ---- openai: a chat-completions server --------------------------------------------------------------------------
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def parse_reply(text: str | None) -> str:
    """A judge's reply -> its verdict: the first word after any thinking (`<think>...</think>`, or everything up to a
    lone `</think>` when the server put the opening tag in the prompt; an unclosed <think> leaves no word), if it is a
    label and the reply names no other label ("Reasoning or knowledge" is no verdict); else `unjudged`."""
    said, word = _after_thinking(text), _first_word(text)
    named = {w for w in re.findall(r"[a-z]+", said.lower()) if w in JUDGED}
    return word if word in JUDGED and named == {word} else "unjudged"


def _first_word(text: str | None) -> str:
    first = _after_thinking(text).strip().split(maxsplit=1)
    return first[0].strip(".,;:!?\"'*()[]`").lower() if first else ""


def _after_thinking(text: str | None) -> str:
    return _THINK.sub(" ", text or "").rpartition("</think>")[2].partition("<think>")[0]


def parse_letter(text: str | None, n: int) -> str | None:
    """An extraction reply -> the letter it gives (its first word after any thinking, one of the `n` choices'
    letters, bracketed or not), else None ("none", or anything else)."""
    first = _after_thinking(text).strip().split(maxsplit=1)
    word = first[0].strip(".,;:!?\"'*()[]`") if first else ""
    return word.upper() if len(word) == 1 and word.upper() in letters(n) else None


def retried(status: int) -> bool:
    """Whether a request answered with HTTP `status` is tried again: a timeout (408), a rate limit (429) and the
    server's errors (5xx) pass; another 4xx would be refused again."""
    return status in (408, 429) or status >= 500


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a Retry-After header asks to wait: a number of seconds, or an HTTP date (RFC 9110); None when it is
    neither."""
    if not value:
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def reply_text(body: object) -> tuple[str, str | None]:
    """(the first choice's message text, its finish reason) of a chat-completions body; ValueError when the body has
    no such message (`choices: null`, an error object, a list)."""
    try:
        choice = body["choices"][0]
        text = choice["message"].get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(f"a reply without choices[0].message: {json.dumps(body)[:120]}") from None
    return (text if isinstance(text, str) else ""), choice.get("finish_reason")


def http_problem(exc: urllib.error.HTTPError) -> str:
    """`HTTP 404: <the server's message>`, read from an error body that is JSON ({"error": {"message"}}) or text."""
    try:
        raw = exc.read().decode(errors="replace")
    except (OSError, http.client.HTTPException, ValueError):
        raw = ""
    try:
        err = json.loads(raw).get("error", raw) if raw else ""
        message = err.get("message", err) if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        message = raw
    return f"HTTP {exc.code}" + (f": {' '.join(str(message).split())[:160]}" if message else "")


#: what a request raises besides an HTTP status: no connection, a reset or timeout, a cut body, one that is no JSON
NETWORK_ERRORS = (urllib.error.URLError, http.client.HTTPException, OSError, ValueError)


@dataclass
class OpenAIJudge:
    """An OpenAI-compatible chat-completions server as the judge."""

    model: str
    url: str = AnalysisConfig.judge_url  # its settings' defaults and docs: stage3.analysis.judge_* (config/stages.py)
    key_env: str = AnalysisConfig.judge_key_env
    rate: float = AnalysisConfig.judge_rate
    retries: int = AnalysisConfig.judge_retries
    max_tokens: int = AnalysisConfig.judge_max_tokens
    backoff: float = 1.0  # seconds before the first retry; doubled each time
    timeout: float = 60.0
    deadline: float | None = None  # seconds for one call (a model's answers), retries included; None: no bound
    workers: int = 4
    failures: int = 0  # requests that failed after every retry (their records: unjudged)
    problems: Counter = field(default_factory=Counter)  # why answers were left unjudged, and how often
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next: float = 0.0
    _temperature: bool = True  # send temperature 0 (until a 400 refuses it)
    _tokens: str = "max_tokens"  # the field of the token limit (max_completion_tokens once a 400 asks for it)
    _until: float | None = None  # the monotonic time the current call's deadline passes

    @classmethod
    def configured(cls, model: str, a: AnalysisConfig) -> OpenAIJudge:
        """The judge as stage3.analysis (a run's stage, or `m2d analyze`'s flags) sets it."""
        return cls(
            model,
            a.judge_url,
            a.judge_key_env,
            rate=a.judge_rate,
            retries=a.judge_retries,
            max_tokens=a.judge_max_tokens,
            deadline=a.judge_deadline,
        )

    @property
    def name(self) -> str:
        return f"openai:{self.model}"

    def _headers(self) -> dict:
        key = os.environ.get(self.key_env)
        return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def check(self) -> None:
        """Before any work: the server serves this model (its /models lists it, else a one-token request to it is
        answered), or one line naming the URL and the model."""
        listed = self._listed()
        if self.model in listed:
            return
        got, why = self._send(CHECK_ASK, 1)
        if got is None:
            close = difflib.get_close_matches(self.model, listed, n=1, cutoff=0.4)
            raise M2DError(
                f"judge {self.url} cannot judge with model {self.model!r} ({why})"
                + (f"; did you mean {close[0]!r}?" if close else "")
                + "; give a model the server serves and its base URL (an OpenAI-compatible one ends in /v1: "
                "stage3.analysis.judge_url, m2d analyze --judge-url)"
            )

    def _listed(self) -> list[str]:
        """The model ids the server's /models lists ([] when it has no such list); one line for a server that is
        unreachable or refuses the key."""
        req = urllib.request.Request(self.url.rstrip("/") + "/models", headers=self._headers())
        try:
            with urllib.request.urlopen(req, timeout=min(self.timeout, 10.0)) as resp:
                data = json.loads(resp.read()).get("data")
            return [str(m.get("id")) for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise M2DError(
                    f"judge {self.url} refused the request (HTTP {exc.code}); set ${self.key_env} to its API key "
                    "(stage3.analysis.judge_key_env names the variable)"
                ) from None
            return []
        except urllib.error.URLError as exc:
            raise M2DError(
                f"judge URL {self.url} is unreachable ({exc.reason}); start the server or give a judge_url that "
                "answers (stage3.analysis.judge_url, m2d analyze --judge-url)"
            ) from None
        except (http.client.HTTPException, OSError, ValueError, AttributeError):
            return []  # a listing that is no JSON object: the one-token request decides

    def _wait_turn(self) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + 1.0 / self.rate
        time.sleep(max(0.0, start - now))

    def _body(self, prompt: str, tokens: int) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], self._tokens: tokens}
        return {**body, "temperature": 0} if self._temperature else body

    def _adapt(self, why: str, sent: dict) -> bool:
        """After a 400 to `sent`: True when it refused a field this judge can drop or rename (then changed for every
        later request), so the request is sent again at once."""
        said = why.lower()
        with self._lock:
            if "temperature" in sent and "temperature" in said:
                self._temperature = False
                return True
            if "max_tokens" in sent and "max_completion_tokens" in said:
                self._tokens = "max_completion_tokens"
                return True
        return False

    def _post(self, body: dict) -> tuple[str, str | None]:
        req = urllib.request.Request(
            self.url.rstrip("/") + "/chat/completions",
            data=json.dumps(body).encode(),
            headers=self._headers(),
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=min(self.timeout, max(0.1, self._left()))) as resp:
            return reply_text(json.loads(resp.read()))

    def _left(self) -> float:
        """Seconds left before the current call's deadline (infinity without one)."""
        return math.inf if self._until is None else self._until - time.monotonic()

    def _send(self, prompt: str, tokens: int) -> tuple[tuple[str, str | None] | None, str]:
        """((the reply's text, its finish reason), "") or, once every try failed or the call's deadline passed, (None,
        why). 408, 429 and 5xx are retried (after the server's Retry-After, in seconds or as an HTTP date, else with
        backoff); another 4xx is not (a field it refuses is changed first)."""
        attempt, why = 0, ""
        while attempt <= self.retries:
            if self._left() <= 0:
                return None, self._late(why)
            body = self._body(prompt, tokens)
            self._wait_turn()
            wait = self.backoff * 2**attempt
            try:
                return self._post(body), ""
            except urllib.error.HTTPError as exc:
                why = http_problem(exc)
                if exc.code == 400 and self._adapt(why, body):
                    continue
                if not retried(exc.code):
                    return None, why
                after = retry_after(exc.headers.get("Retry-After") if exc.headers else None)
                wait = min(60.0, after) if after is not None else wait
            except NETWORK_ERRORS as exc:
                why = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            attempt += 1
            if attempt <= self.retries:
                if wait >= self._left():
                    return None, self._late(why)
                time.sleep(wait)
        return None, why

    def _late(self, why: str) -> str:
        return f"the judge's deadline of {self.deadline:g} s passed (stage3.analysis.judge_deadline)" + (
            f" after {why}" if why else ""
        )

    def _judge(self, prompt: str) -> str:
        """One answer's verdict; why there is none is counted in `problems`."""
        got, why = self._send(prompt, self.max_tokens)
        said = "unjudged" if got is None else parse_reply(got[0])
        if said == "unjudged":
            if got is None:
                problem = why
            elif got[1] == "length":
                problem = f"a reply cut at {self.max_tokens} tokens before its word (stage3.analysis.judge_max_tokens)"
            elif _first_word(got[0]) in JUDGED:
                problem = "a reply naming both labels"
            else:
                problem = "a reply whose first word is no label"
            with self._lock:
                self.failures += got is None
                self.problems[problem] += 1
        return said

    def why(self) -> str:
        """The commonest reasons answers were left unjudged, for a failure line."""
        return "; ".join(f"{n} x {p}" for p, n in self.problems.most_common(2))

    def __call__(self, records: list[dict]) -> list[str]:
        prompts = [render(r, OPENAI_ASK) for r in records]
        self._until = None if self.deadline is None else time.monotonic() + self.deadline
        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            return list(pool.map(self._judge, prompts))

    def extract(self, records: list[dict]) -> list[str | None]:
        """Rule 8 of extraction.py: the letter each answer commits to, read by the judge where the rules read none (a
        reply that is no letter of the choices: None)."""
        self._until = None if self.deadline is None else time.monotonic() + self.deadline

        def one(r: dict) -> str | None:
            got, _ = self._send(EXTRACT.format(**_fields(r), response=r["response"]), self.max_tokens)
            return None if got is None else parse_letter(got[0], len(r["choices"]))

        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            return list(pool.map(one, records))


def describe(spec: str) -> dict:
    """The judge's name and prompt, as recorded beside the results."""
    kind, _ = parse_judge(spec)
    if kind == "none":
        return {"judge": spec, "prompt": "", "labels": list(JUDGED)}
    if kind == "teacher":
        return {
            "judge": spec,
            "prompt": PROMPT + TEACHER_ASKS[0],
            "asks": list(TEACHER_ASKS),
            "labels": list(TEACHER_LABELS),
        }
    return {"judge": spec, "prompt": PROMPT + OPENAI_ASK, "labels": list(JUDGED), "extract_prompt": EXTRACT}
