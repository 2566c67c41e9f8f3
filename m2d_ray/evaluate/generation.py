"""A model's answers to the analysis' questions: batched `generate` with a KV cache and left padding, sampled at a
recorded temperature and seed, saved a batch at a time so that a killed run continues where it stopped.

The questions are cut into batches in their order (`Sampling.batch_size` each); batch i is sampled after
`torch.manual_seed(batch_seed(seed, i))`, so a batch's answers depend on its questions, the model, the device and
the seed only, never on which batches ran before it: a resumed run writes what an unbroken one would have. Each
finished batch is one file (`BatchStore`: STORE/batch-00003.jsonl, written complete or not at all: a temp file
renamed, or one object on s3://), read back on resume; only the batches without a file are generated.

Sampling is plain temperature sampling (no top-k, top-p or repetition penalty, whatever the model's own generation
config says); temperature 0 is greedy decoding. A prompt is left-truncated to leave room for the new tokens within
the model's context (`max_position_embeddings`); the new tokens are capped to half the context when the asked
number does not fit beside a prompt. An answer ends at an end-of-sequence token or where the model starts the next
question (questions.UNTIL at a line's start: `StopAtQuestion` stops that sequence, and the text is cut before the
marker), both recorded with the settings (`until`). Each answer records how it ended: `stop` (an end-of-sequence
token), `until` (the next question: what ran on is kept as `run_on`) or `length` (cut at the token limit: a truncated
answer).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from m2d_ray import storage
from m2d_ray.arch import auto_class
from m2d_ray.config import AnalysisConfig
from m2d_ray.evaluate.questions import TEMPLATE, UNTIL, Question, answer_part
from m2d_ray.models import _source, load_model, load_tokenizer, model_config


@dataclass(frozen=True)
class Sampling:
    """What a model's answers are drawn with (recorded with the results; a resumed run must keep it)."""

    max_new_tokens: int = AnalysisConfig.max_new_tokens  # defaults and docs: stage3.analysis (config/stages.py)
    temperature: float = AnalysisConfig.temperature
    seed: int = AnalysisConfig.seed
    batch_size: int = AnalysisConfig.batch_size


def recorded(questions: str, per_subject: int, s: Sampling, template: str = TEMPLATE) -> dict:
    """What a model's answers are generated from, as recorded beside them (a continued run must keep it)."""
    until = ["<end of sequence>", *(f"\n{m}" for m in UNTIL)]
    return {"questions": questions, "per_subject": per_subject, **asdict(s), "template": template, "until": until}


def batch_seed(seed: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{index}".encode()).digest()[:8], "big") >> 1


def batches(questions: list[Question], size: int) -> list[list[Question]]:
    return [questions[i : i + size] for i in range(0, len(questions), size)]


class BatchStore:
    """A model's finished batches under a storage URL (a local directory or s3://…): one JSON Lines file each."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _name(self, index: int) -> str:
        return f"batch-{index:05d}.jsonl"

    def done(self) -> dict[int, list[dict]]:
        """Batch index -> its answers, for every batch saved."""
        out = {}
        for name in storage.list_names(self.url):
            if name.startswith("batch-") and name.endswith(".jsonl"):
                text = storage.read_bytes(storage.join(self.url, name)).decode()
                out[int(name[6:-6])] = [json.loads(line) for line in text.splitlines() if line.strip()]
        return out

    def save(self, index: int, rows: list[dict]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".m2d-batch-", suffix=".jsonl")
        try:
            with os.fdopen(fd, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            storage.put_file(Path(tmp), storage.join(self.url, self._name(index)))
        finally:
            os.unlink(tmp)


def context_of(model) -> int | None:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(text, "max_position_embeddings", None)


class StopAtQuestion(StoppingCriteria):
    """Stops a sequence once its new text starts the next question (`answer_part` cuts there); `at[row]`: its new
    tokens then. Only the last `window` new tokens are decoded each step: more characters than the longest marker
    even for a byte-level tokenizer."""

    def __init__(self, tokenizer, start: int, window: int = 64) -> None:
        self.tokenizer, self.start, self.window, self.at = tokenizer, start, window, {}

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        n = input_ids.shape[1]
        tails = self.tokenizer.batch_decode(input_ids[:, max(self.start, n - self.window) :], skip_special_tokens=True)
        hit = [bool(answer_part(t)[1]) for t in tails]
        for row in (i for i, h in enumerate(hit) if h):
            self.at.setdefault(row, n - self.start)
        return torch.tensor(hit, dtype=torch.bool, device=input_ids.device)


def answer_batch(model, tokenizer, prompts: list[str], s: Sampling, seed: int) -> list[dict]:
    """One batch's answers: {"response", "run_on", "finish", "new_tokens", "prompt_tokens", "prompt_truncated"}."""
    device = next(model.parameters()).device
    ctx = context_of(model)
    new = s.max_new_tokens if ctx is None or s.max_new_tokens <= ctx // 2 else ctx // 2
    keep = None if ctx is None else ctx - new
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    cut = [keep is not None and len(x) > keep for x in ids]
    ids = [x[-keep:] if c else x for x, c in zip(ids, cut)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    stops = {eos} if isinstance(eos, int) else set(eos or ())
    config = GenerationConfig(
        do_sample=s.temperature > 0,
        temperature=s.temperature if s.temperature > 0 else None,
        top_k=0 if s.temperature > 0 else None,
        top_p=1.0 if s.temperature > 0 else None,
        repetition_penalty=1.0,
        max_new_tokens=new,
        use_cache=True,
        pad_token_id=pad,
        eos_token_id=sorted(stops) or None,
    )
    until = StopAtQuestion(tokenizer, width)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([until]),
        )
    rows = []
    for row, (x, c, gen) in enumerate(zip(ids, cut, out[:, width:].tolist())):
        end = next((i for i, t in enumerate(gen) if t in stops), None)
        at = until.at.get(row)  # the rows stopped there are padded after it (the pad may be the EOS token)
        n = min(i for i in (end, at, len(gen)) if i is not None)
        text, run_on = answer_part(tokenizer.decode(gen[:n], skip_special_tokens=True))
        rows.append(
            {
                "response": text,
                "run_on": run_on,
                "finish": "until" if n == at else "stop" if n == end else "length",
                "new_tokens": n,
                "prompt_tokens": len(x),
                "prompt_truncated": c,
            }
        )
    return rows


def answer_all(
    model,
    tokenizer,
    questions: list[Question],
    s: Sampling,
    store: BatchStore | None = None,
    template: str = TEMPLATE,
    progress: Callable[[int, int], None] | None = None,
) -> list[dict]:
    """Every question's record (Question.record + its answer), the batches `store` holds read back, the others
    generated and saved as each ends; `progress(done, total)` after each batch."""
    parts = batches(questions, s.batch_size)
    have = store.done() if store is not None else {}
    out = []
    for i, batch in enumerate(parts):
        rows = have.get(i)
        if rows is None or [r["id"] for r in rows] != [q.id for q in batch]:
            prompts = [q.prompt(template) for q in batch]
            answers = answer_batch(model, tokenizer, prompts, s, batch_seed(s.seed, i))
            rows = [{**q.record(), **a} for q, a in zip(batch, answers)]
            if store is not None:
                store.save(i, rows)
        out += rows
        if progress is not None:
            progress(i + 1, len(parts))
    return out


def load(model: str, device: str, placement=None):
    """(model, tokenizer) for generation: sharded over the visible GPUs with an accelerate device map when the
    placement (evaluate/placement.py) says the model needs several, else checked and loaded whole onto `device`."""
    if placement is None or not placement.shard:
        return load_model(model, device=device)
    n = max(1, int(placement.gpus))
    lm = auto_class(model_config(model)).from_pretrained(
        _source(model),
        device_map="auto",
        max_memory=dict.fromkeys(range(n), placement.max_memory_per_gpu),
        dtype="auto",
    )
    return lm.eval(), load_tokenizer(_source(model))
