"""`m2d analyze`: the paper's error taxonomy of generated answers (evaluate/taxonomy.py), outside a run.

    m2d analyze --responses FILE.jsonl [--judge ...] --out DIR   classify saved answers (no generation)
    m2d analyze --model M [--model M2 ...] --out DIR             answer the questions, then classify; the same
                                                                 command on the same DIR continues a killed one

DIR: responses.jsonl (every answer with its `category`, `extracted` answer and `reason`; `model` with --model),
summary.json, judge.json (the judge's name and prompt); with --model also settings.json (questions, prompt,
sampling, stop strings) and KEY/batch-NNNNN.jsonl (each model's generated batches). stdout: one JSON line with the
count and share of each category and the accuracy per subject group (per model with --model).

A responses file's lines are read as generated answers are: each `response` cut where the model's answer ended
(questions.answer_part: the next question or chat turn it wrote, an end-of-text token written out; the rest kept as
`run_on`), each `answer` key a letter, an integer or a choice's exact text (extraction.key_letter; integers counted
from 0 as Hugging Face's MMLU stores them, from 1 with --key-base 1 or when the file's keys include a number of
choices and never 0, said in one line), anything else one line naming the line, the field and what to write. A judge
that leaves more than --max-unjudged of a model's open answers unjudged fails the command (exit 1) with nothing
classified written; with --model the answers stay saved and the same command continues.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from m2d_ray.artifacts import (
    atomic_dir,
    check_output,
    output_kind,
    replace_dir,
    write_json_atomic,
    write_marker,
    write_text_atomic,
)
from m2d_ray.catalog.distill import AUTO
from m2d_ray.checkpoint import check_files
from m2d_ray.config import AnalysisConfig
from m2d_ray.console import bar, emit, say
from m2d_ray.errors import M2DError, RunFailed
from m2d_ray.evaluate.extraction import integer_base, key_letter
from m2d_ray.evaluate.generation import BatchStore, Sampling, answer_all, load, recorded
from m2d_ray.evaluate.judges import OpenAIJudge, TeacherJudge, describe, parse_judge, shortfall
from m2d_ray.evaluate.questions import TEMPLATE_CHARS, answer_part, check_set, group_of, sample
from m2d_ray.evaluate.runner import generation_placement, gpu_facts
from m2d_ray.evaluate.taxonomy import JUDGED, classify, summary
from m2d_ray.models import device_default, load_model, model_config
from m2d_ray.plan.suite import prompt_tokens

FIELDS = ("id", "subject", "question", "choices", "answer", "response")


def read_responses(path: str, key_base: str = AUTO) -> list[dict]:
    """The answers of a responses file, every line checked (one line naming the first line and field that cannot be
    read, and what to write); each response cut where the model's answer ended, each key made its letter (integer
    keys counted from `key_base`: 0, 1, or auto: 1 when the file's keys include a number of choices and never 0,
    said in one line)."""
    p = Path(path)
    if not p.is_file():
        raise M2DError(f"--responses {path} is not a file; give a JSON Lines file of answers")
    lines = [(n, _line(path, n, line)) for n, line in enumerate(p.read_text().splitlines(), 1) if line.strip()]
    if not lines:
        raise M2DError(f"--responses {path} holds no answers; give a file with one JSON object per line")
    base = int(key_base) if key_base != AUTO else integer_base((r["answer"], len(r["choices"])) for _, r in lines)
    if key_base == AUTO and base == 1:
        say(f"{path}: its integer answer keys include the number of choices and never 0: read as counted from 1 (1 is "
            "A; --key-base 0 reads them from 0)")  # fmt: skip
    out = []
    for n, r in lines:
        try:
            key = key_letter(r["answer"], r["choices"], base)
        except ValueError as exc:
            raise M2DError(f"{path} line {n}: field 'answer' {exc}; {_key_help(base, key_base)}") from None
        response, run_on = answer_part(r["response"])
        out.append({**r, "response": response, "run_on": run_on, "answer": key})
    return out


def _key_help(base: int, asked: str) -> str:
    """What to write instead of a key that cannot be read."""
    if base == 1:
        return "give a letter, an integer counted from 1 (--key-base 1: 1 is A) or one choice's exact text"
    also = " (the file's keys include 0, so they count from 0)" if asked == AUTO else ""
    return (
        f"give a letter, an integer counted from 0{also} as Hugging Face's MMLU stores it (1 is B), --key-base 1 for "
        "keys counted from 1, or one choice's exact text"
    )


def _line(path: str, n: int, line: str) -> dict:
    """Line `n` of a responses file as a record with every field of the right type; one line naming it otherwise."""
    try:
        r = json.loads(line)
    except ValueError:
        raise M2DError(f"{path} line {n} is not JSON; give one JSON object per line") from None
    missing = [f for f in FIELDS if not isinstance(r, dict) or f not in r]
    if missing:
        raise M2DError(f"{path} line {n} has no field {missing[0]!r}; give every line {', '.join(FIELDS)}")
    choices = r["choices"]
    if not isinstance(choices, list) or not 0 < len(choices) <= 26 or not all(isinstance(c, str) for c in choices):
        raise M2DError(f"{path} line {n}: field 'choices' is not a list of 1 to 26 strings; give the choices' texts")
    for f in ("subject", "question", "response"):
        if not isinstance(r[f], str):
            raise M2DError(f"{path} line {n}: field {f!r} is {r[f]!r}, not a string; give its text")
    return r


def check_judge(args) -> None:
    """The command's --judge, before any work: a known kind; the teacher judge's model named, and its files; an
    openai server that serves the model."""
    kind, model = parse_judge(args.judge)
    if kind == "openai":
        OpenAIJudge.configured(model, settings(args)).check()
    elif kind == "teacher":
        if not args.teacher:
            raise M2DError(
                "--judge teacher needs the judge's model; give --teacher MODEL (a causal LM that reads the questions' "
                "language: the MoE teacher of your run), or use --judge none or openai:MODEL"
            )
        model_config(args.teacher)
        check_files(args.teacher, "judge teacher")


def settings(args) -> AnalysisConfig:
    """The command's flags as stage3.analysis's settings (cli.py makes a flag of each key the command takes, with
    the key's default and doc), so that the command and the stage read one thing."""
    keys = {f.name for f in dataclasses.fields(AnalysisConfig)}
    return AnalysisConfig(**{k: v for k, v in vars(args).items() if k in keys})


def extractor_of(judge, args):
    """The judge's reading of the final answers the rules could not read (rule 8), when it reads text and is asked
    to (--judge-extracts, the default); else None."""
    return judge.extract if args.judge_extracts and hasattr(judge, "extract") else None


def load_judge(args, device: str):
    """The judge the checked --judge names (the teacher loaded now), or None."""
    kind, model = parse_judge(args.judge)
    if kind == "openai":
        return OpenAIJudge.configured(model, settings(args))
    if kind == "teacher":
        return TeacherJudge(*load_model(args.teacher, device=device), batch_size=args.batch_size)
    return None


def judged(records: list[dict], judge, most: float) -> str | None:
    """The failure line when `judge` left more than `most` of the answers it was asked about unjudged."""
    said = [r["category"] for r in records if r["category"] in (*JUDGED, "unjudged")]
    return shortfall(judge.name, said, most, judge.why()) if judge is not None else None


def key_of(model: str, taken: set[str]) -> str:
    base = Path(model.rstrip("/")).name.replace("/", "--") or "model"
    key, i = base, 2
    while key in taken:
        key, i = f"{base}-{i}", i + 1
    taken.add(key)
    return key


def _work_dir(out: Path, settings: dict, overwrite: bool) -> Path:
    """Where the answers go: --out itself (new, or an analysis with the same settings: continued), else with
    --overwrite a sibling that replaces --out once complete (continued too when a killed one is there)."""
    saved = out / "settings.json"
    if output_kind(out) == "analysis" and saved.is_file():
        before = json.loads(saved.read_text())
        if before == settings:
            return out
        if not overwrite:
            changed = ", ".join(k for k in settings if before.get(k) != settings[k])
            raise M2DError(
                f"--out {out} holds an analysis with other settings ({changed}); pass --overwrite to replace it, "
                "or choose a new path"
            )
        check_output(out, "analysis", overwrite=True)
        return out.with_name(f".{out.name}.m2d-new")
    check_output(out, "analysis", overwrite)
    return out if not out.exists() or not any(out.iterdir()) else out.with_name(f".{out.name}.m2d-new")


def generate(args) -> dict:
    """--model: every model answers the questions (resumable), then the answers are classified."""
    models = list(dict.fromkeys(args.model))
    for m in models:
        model_config(m)
        check_files(m)
    device = args.device or device_default()
    check_set(args.questions)
    check_judge(args)
    gpu_bytes, gpus = gpu_facts() if device.startswith("cuda") else (None, 0)
    prompt = int(prompt_tokens(args.questions, TEMPLATE_CHARS))
    places = {  # this machine's GPUs: a model that needs several is sharded over them; one that fits none: one line
        m: generation_placement(m, gpu_bytes, gpus, args.batch_size, prompt, prompt + args.max_new_tokens)
        for m in models
    }
    s = Sampling(args.max_new_tokens, args.temperature, args.seed, args.batch_size)
    settings, out = recorded(args.questions, args.per_subject, s), Path(args.out).expanduser()
    work = _work_dir(out, settings, args.overwrite)
    questions = sample(args.questions, args.per_subject, args.seed)
    if work != out and (work / "settings.json").is_file():
        if json.loads((work / "settings.json").read_text()) != settings:  # a killed --overwrite of other settings
            shutil.rmtree(work)
    if not (work / "settings.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        write_marker(work, "analysis")
        write_json_atomic(work / "settings.json", settings)
    taken: set[str] = set()
    answers = {}
    for m in models:
        key = key_of(m, taken)
        store = BatchStore(str(work / key))
        have = len(store.done())
        lm, tok = load(m, device, places[m])
        with bar(-(-len(questions) // s.batch_size), key, "batch") as b:
            rows = answer_all(lm, tok, questions, s, store, progress=lambda i, n: b.update())
        del lm
        cut = sum(r["finish"] == "length" for r in rows)
        say(f"{key}: {len(rows)} answers ({have} batches saved before; {cut} cut at the token limit)")
        answers[key] = rows
    judge = load_judge(args, device)
    records, per_model = [], {}
    for key, rows in answers.items():
        got = [{**r, "model": key} for r in classify(rows, judge, extractor=extractor_of(judge, args))]
        failed = judged(got, judge, args.max_unjudged)
        if failed:
            raise RunFailed(f"{key}: {failed}; its answers are saved in {work}: the same command judges them again")
        records += got
        per_model[key] = summary(got, group_of)
    _write(work, records, per_model, args)
    if work != out:
        replace_dir(out, work)
    return {"models": per_model, "judge": args.judge, "out": str(out.resolve())}


def _write(where: Path, records: list[dict], summaries: dict, args) -> None:
    write_text_atomic(where / "responses.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    write_json_atomic(where / "summary.json", summaries)
    teacher = {"teacher": args.teacher} if parse_judge(args.judge)[0] == "teacher" else {}
    write_json_atomic(where / "judge.json", {**describe(args.judge), **teacher})


def reclassify(args) -> dict:
    """--responses: the saved answers classified again."""
    rows = read_responses(args.responses, args.key_base)
    check_judge(args)
    check_output(args.out, "analysis", args.overwrite)
    judge = load_judge(args, args.device or device_default())
    records = classify(rows, judge, extractor=extractor_of(judge, args))
    failed = judged(records, judge, args.max_unjudged)
    if failed:
        raise RunFailed(f"{failed}; nothing written: run the command again once the judge answers")
    result = summary(records, group_of)
    with atomic_dir(args.out, "analysis", args.overwrite) as tmp:
        _write(tmp, records, result, args)
    return {**result, "judge": args.judge, "out": str(Path(args.out).expanduser().resolve())}


def main(args) -> None:
    emit(json.dumps(reclassify(args) if args.responses else generate(args)))
