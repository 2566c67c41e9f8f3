"""The judge of the analysis: knowledge error or reasoning error, for a wrong answer that the rules found coherent and
on-topic (evaluate/taxonomy.py).

    none            no judge: those answers stay `unjudged`
    teacher         a causal LM (the run's own MoE teacher) scores the two label continuations after `PROMPT` + its
                    `TEACHER_ASK` and the more likely one is the verdict: no free text is parsed. The labels are the
                    digits " 1" and " 2", which every tokenizer has (the embedded teacher's word-level vocabulary
                    has no English label words); an exact tie is `unjudged`
    openai:MODEL    any OpenAI-compatible chat-completions server (vLLM's, SGLang's, a hosted API) at `url`, asked
                    `PROMPT` + `OPENAI_ASK` for one word at temperature 0: a reply whose first word is not a label is
                    `unjudged`, never guessed; requests at most `rate` a second, retried with exponential backoff on
                    429, 5xx and network errors (Retry-After honoured); the key from the environment variable named

A judge is called with the records to decide and returns one verdict per record. Its name and prompt are recorded
beside the results (`describe`).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from m2d_ray.errors import M2DError
from m2d_ray.evaluate.generation import context_of
from m2d_ray.evaluate.taxonomy import JUDGED, letters

KINDS = ("teacher", "none", "openai:MODEL")
PROMPT = (
    "A student answered a multiple choice question about {subject} and got it wrong.\n\n"
    "Question: {question}\n{choices}\nCorrect answer: {answer}\n\n"
    "The student's answer:\n{response}\n\n"
    "Is the student's mistake a knowledge error (a wrong fact, definition or recalled detail, in coherent and "
    "on-topic text) or a reasoning error (an attempt at logical or mathematical reasoning that reaches a wrong "
    "conclusion through flawed logic)?\n"
)
TEACHER_ASK = "Reply 1 for a knowledge error or 2 for a reasoning error.\nVerdict:"
TEACHER_LABELS = (" 1", " 2")  # -> JUDGED, in order
OPENAI_ASK = "Reply with one word: knowledge or reasoning."


def parse_judge(spec: str) -> tuple[str, str | None]:
    """(kind, model) of a judge spec: teacher, none, or openai:MODEL."""
    kind, _, model = str(spec).partition(":")
    if kind in ("teacher", "none") and not model:
        return kind, None
    if kind == "openai" and model.strip():
        return kind, model.strip()
    raise M2DError(f"unknown judge {spec!r}; write teacher, none or openai:MODEL (e.g. openai:gpt-4o-mini)")


def _fields(r: dict) -> dict:
    choices = "\n".join(f"{x}. {c}" for x, c in zip(letters(len(r["choices"])), r["choices"]))
    return {"subject": r["subject"].replace("_", " "), "question": r["question"], "choices": choices}


def render(r: dict, ask: str) -> str:
    """The judge's whole prompt for record `r`."""
    return PROMPT.format(**_fields(r), answer=r["answer"], response=r["response"]) + ask


# ---- teacher: the label continuations' log-likelihoods -----------------------------------------------------------
def context_ids(tokenizer, r: dict, room: int | None) -> list[int]:
    """The teacher's prompt for `r` as token ids, within `room` tokens: the answer's start is dropped first (its end
    holds the final answer), then the prompt's own start."""
    head, tail = (PROMPT + TEACHER_ASK).split("{response}")
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
    failures: int = 0

    def __call__(self, records: list[dict]) -> list[str]:
        ctx = context_of(self.model)
        longest = max(len(self.tokenizer(x, add_special_tokens=False)["input_ids"]) for x in TEACHER_LABELS)
        room = None if ctx is None else ctx - longest
        contexts = [context_ids(self.tokenizer, r, room) for r in records]
        scores = label_loglikelihoods(self.model, self.tokenizer, contexts, TEACHER_LABELS, self.batch_size)
        return [verdict(s) for s in scores]


def verdict(scores: list[float]) -> str:
    """The label with the highest log-likelihood; a tie is no verdict."""
    best = max(scores)
    return "unjudged" if scores.count(best) > 1 else JUDGED[scores.index(best)]


# ---- openai: a chat-completions server --------------------------------------------------------------------------
def parse_reply(text: str | None) -> str:
    """A judge's reply -> its verdict: the first word, if it is a label; else `unjudged`."""
    first = (text or "").strip().split(maxsplit=1)
    word = first[0].strip(".,;:!?\"'*()[]`").lower() if first else ""
    return word if word in JUDGED else "unjudged"


@dataclass
class OpenAIJudge:
    """An OpenAI-compatible chat-completions server as the judge."""

    model: str
    url: str = "https://api.openai.com/v1"
    key_env: str = "OPENAI_API_KEY"
    rate: float = 2.0  # requests per second, at most
    retries: int = 4
    backoff: float = 1.0  # seconds before the first retry; doubled each time
    timeout: float = 60.0
    workers: int = 4
    failures: int = 0  # requests that failed after every retry (their records: unjudged)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _next: float = 0.0

    @property
    def name(self) -> str:
        return f"openai:{self.model}"

    def _headers(self) -> dict:
        key = os.environ.get(self.key_env)
        return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}

    def check(self) -> None:
        """Before any generation: the server answers (GET /models) and takes the key."""
        req = urllib.request.Request(self.url.rstrip("/") + "/models", headers=self._headers())
        try:
            urllib.request.urlopen(req, timeout=min(self.timeout, 10.0)).close()
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise M2DError(
                    f"judge {self.url} refused the request (HTTP {exc.code}); set ${self.key_env} to its API key "
                    "(stage3.analysis.judge_key_env names the variable)"
                ) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise M2DError(
                f"judge URL {self.url} is unreachable ({reason}); start the server or give a judge_url that answers "
                "(stage3.analysis.judge_url, m2d analyze --judge-url)"
            ) from None

    def _wait_turn(self) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + 1.0 / self.rate
        time.sleep(max(0.0, start - now))

    def ask(self, prompt: str) -> str | None:
        """The reply's text, or None when every try failed."""
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8,
                "temperature": 0,
            }
        ).encode()
        for attempt in range(self.retries + 1):
            self._wait_turn()
            req = urllib.request.Request(
                self.url.rstrip("/") + "/chat/completions", data=body, headers=self._headers(), method="POST"
            )
            wait = self.backoff * 2**attempt
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())["choices"][0]["message"].get("content")
            except urllib.error.HTTPError as exc:
                if exc.code != 429 and exc.code < 500:
                    break
                after = exc.headers.get("Retry-After") if exc.headers else None
                wait = min(60.0, float(after)) if after and after.replace(".", "", 1).isdigit() else wait
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError):
                pass
            if attempt < self.retries:
                time.sleep(wait)
        with self._lock:
            self.failures += 1
        return None

    def __call__(self, records: list[dict]) -> list[str]:
        prompts = [render(r, OPENAI_ASK) for r in records]
        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            return [parse_reply(reply) for reply in pool.map(self.ask, prompts)]


def describe(spec: str) -> dict:
    """The judge's name and prompt, as recorded beside the results."""
    kind, _ = parse_judge(spec)
    ask = {"teacher": TEACHER_ASK, "none": ""}.get(kind, OPENAI_ASK)
    prompt = PROMPT + ask if kind != "none" else ""
    return {"judge": spec, "prompt": prompt, "labels": list(TEACHER_LABELS) if kind == "teacher" else list(JUDGED)}
