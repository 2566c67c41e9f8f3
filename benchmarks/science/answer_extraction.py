"""Letter agreement with a careful grader: m2d's answer extraction beside the extractors people use (issue 55).

    python -m benchmarks.science.answer_extraction [--set benchmarks/data/extraction_set.jsonl] [--misses] [--before
        REV]

The set (benchmarks/data/extraction_set.jsonl): responses to 4-choice questions, each with the letter a careful
human grader reads as its committed final answer, or null (none, or no single one: a hedge, a truncated or empty
answer). Real generations (`source`: the model; benchmarks/tools/make_extraction_set.py remakes them unlabelled) and
written ones (`source: written`, `kind`: the shape they stand for). Each extractor reads the response as its own
pipeline would, and its letter (or none) is compared with the label:

    m2d                       questions.answer_part (where the answer ended), then extraction.extract; a hedge or a
                              text is no letter, a letter outside the choices is that letter (`--before REV`: also
                              the two as they were at git revision REV of this repository)
    lm-eval multi_choice_regex, lm-eval regex (strict-match)
                              the filters of lm-eval's mmlu_flan_cot_zeroshot template (read from the installed
                              lm_eval's task YAML, run with its own filter classes), after its `until` cut
                              (generate_until stops there); the output is a letter when exact_match's normalisation
                              (lower case, punctuation removed) leaves one, as it scores "(B)" against the target
    lm-eval regex (fewshot)   mmlu_flan_cot_fewshot's get-answer regex, the same way
    OpenCompass               first_option_postprocess(text, "ABCD") as OpenCompass's MMLU configs call it: its own
                              code, from the installed package or read out of its PyPI wheel (opencompass 0.5.2:
                              `pip download opencompass==0.5.2 --no-deps -d ~/.cache/m2d/wheels`; its dependencies
                              are not needed); the column is left out, said once, where neither is here
    simple-evals              re.search(ANSWER_PATTERN_MULTICHOICE) of openai/simple-evals' common.py,
                              r"(?i)Answer[ \\t]*:[ \\t]*\\$?([A-D])\\$?", its group compared as written

Prints one row per extractor: agreement on all, on the real generations and on the written ones, and on the responses
that commit to a letter. No timing: the figures do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import re
import string
import sys
import types
import zipfile
from collections.abc import Callable
from pathlib import Path

import yaml

from m2d_ray.evaluate.extraction import extract
from m2d_ray.evaluate.questions import answer_part

REPO = Path(__file__).resolve().parents[2]
SET = REPO / "benchmarks" / "data" / "extraction_set.jsonl"


# ---- m2d --------------------------------------------------------------------------------------------------------
def m2d(text: str, choices: list[str], cut=answer_part, read=extract) -> str | None:
    got, _ = read(cut(text)[0], choices)
    return got if got is not None and re.fullmatch(r"[A-Z]", got) else None


def m2d_at(rev: str):
    """m2d's reader as it was at git revision `rev`: its extraction.py (taxonomy.py before the two were apart) and
    questions.py loaded from `git show`."""
    import subprocess
    import sys
    import types

    def show(path: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True)

    mods = {}
    reader = "extraction" if show("m2d_ray/evaluate/extraction.py").returncode == 0 else "taxonomy"
    for name in (reader, "questions"):
        path = f"m2d_ray/evaluate/{name}.py"
        src = show(path)
        src.check_returncode()
        mod = types.ModuleType(f"m2d_{name}_{rev}")
        sys.modules[mod.__name__] = mod  # dataclasses look their module up
        exec(compile(src.stdout, f"{rev}:{path}", "exec"), mod.__dict__)  # noqa: S102 - this repository's own code
        mods[name] = mod
    return lambda text, choices: m2d(text, choices, mods["questions"].answer_part, mods[reader].extract)


# ---- lm-eval: its filters as its MMLU CoT task YAMLs configure them -------------------------------------------------
def _task_yaml(name: str) -> dict:
    import lm_eval

    path = Path(lm_eval.__file__).parent / "tasks" / "mmlu" / name
    return yaml.safe_load(path.read_text())


def lm_eval_extractors() -> dict:
    """{column: reader(text, choices)} for the filters of the zero-shot and few-shot flan CoT MMLU templates."""
    from lm_eval.filters.extraction import MultiChoiceRegexFilter, RegexFilter

    kinds = {"regex": RegexFilter, "multi_choice_regex": MultiChoiceRegexFilter}
    out = {}
    for name, label in (
        ("flan_cot_zeroshot/_mmlu_flan_cot_zeroshot_template_yaml", "zeroshot"),
        ("flan_cot_fewshot/_mmlu_flan_cot_fewshot_template_yaml", "fewshot"),
    ):
        task = _task_yaml(name)
        until = task["generation_kwargs"]["until"]
        for f in task["filter_list"]:
            first = f["filter"][0]
            assert f["filter"][1:] == [{"function": "take_first"}], f
            flt = kinds[first["function"]](**{k: v for k, v in first.items() if k != "function"})
            column = f"lm-eval {first['function']} ({label} {f['name']})"
            out[column] = _reader(flt, until)
    return out


def _cut(text: str, until: list[str]) -> str:
    """What generate_until returns: the text up to the first `until` string."""
    ends = [i for i in (text.find(u) for u in until) if i >= 0]
    return text[: min(ends)] if ends else text


def _reader(flt, until: list[str]):
    """A reader of many rows at once (the multi_choice_regex filter builds a table of every Unicode punctuation
    character per call)."""
    table = str.maketrans("", "", string.punctuation)

    def read(rows: list[dict]) -> list[str | None]:
        out = flt.apply([[_cut(r["response"], until)] for r in rows], [{"choices": r["choices"]} for r in rows])
        norms = [got.lower().translate(table) for [got] in out]  # exact_match: ignore_case, ignore_punctuation
        return [n.upper() if re.fullmatch(r"[a-z]", n) else None for n in norms]

    return read


def each(read):
    """A reader of one response made a reader of many rows."""
    return lambda rows: [read(r["response"], r["choices"]) for r in rows]


# ---- OpenCompass: first_option_postprocess, its own code from its PyPI wheel -------------------------------------
OPENCOMPASS = "opencompass==0.5.2"
WHEELS = Path.home() / ".cache" / "m2d" / "wheels"


def first_option_postprocess() -> Callable[..., str] | None:
    """OpenCompass's `first_option_postprocess`, run from its own source: the installed package, else the file
    `opencompass/utils/text_postprocessors.py` read out of its wheel (`pip download opencompass==0.5.2 --no-deps -d
    ~/.cache/m2d/wheels`; OpenCompass's dependencies are not needed, its registry decorator is stood in for);
    None where neither is here."""
    try:
        from opencompass.utils.text_postprocessors import first_option_postprocess as fo

        return fo
    except ImportError:
        pass
    wheel = next(iter(sorted(WHEELS.glob("opencompass-0.5.2-*.whl"))), None)
    if wheel is None:
        return None
    with zipfile.ZipFile(wheel) as z:
        source = z.read("opencompass/utils/text_postprocessors.py").decode()
    registry = types.ModuleType("opencompass.registry")
    registry.TEXT_POSTPROCESSORS = types.SimpleNamespace(register_module=lambda *a, **k: lambda fn: fn)
    saved = {m: sys.modules.get(m) for m in ("opencompass", "opencompass.registry")}
    sys.modules.update({"opencompass": types.ModuleType("opencompass"), "opencompass.registry": registry})
    try:
        namespace: dict = {"__name__": "opencompass_text_postprocessors"}
        exec(compile(source, f"{wheel.name}/opencompass/utils/text_postprocessors.py", "exec"), namespace)
    finally:
        for m, mod in saved.items():
            if mod is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = mod
    return namespace["first_option_postprocess"]


def opencompass_reader() -> Callable[[str, list[str]], str | None] | None:
    """first_option_postprocess(text, "ABCD") as OpenCompass's MMLU configs call it, or None where it is not here."""
    fo = first_option_postprocess()
    return None if fo is None else (lambda text, choices: fo(text, "ABCD") or None)


# ---- simple-evals ----------------------------------------------------------------------------------------------
ANSWER_PATTERN_MULTICHOICE = r"(?i)Answer[ \t]*:[ \t]*\$?([A-D])\$?"


def simple_evals(text: str, choices: list[str]) -> str | None:
    m = re.search(ANSWER_PATTERN_MULTICHOICE, text)
    return m.group(1) if m else None


# ---- the table -------------------------------------------------------------------------------------------------
def extractors(before: str | None = None) -> dict:
    was = {f"m2d at {before}": each(m2d_at(before))} if before else {}
    oc = opencompass_reader()
    opencompass = {"OpenCompass first_option_postprocess": each(oc)} if oc else {}
    return {"m2d": each(m2d), **was, **lm_eval_extractors(), **opencompass,
            "simple-evals Answer: pattern": each(simple_evals)}  # fmt: skip


def agreement(rows: list[dict], read) -> dict[str, tuple[int, int]]:
    """(agreeing, of) on all rows, the real generations, the written ones (those written with the rules, those
    written after the rules were frozen: `kind` "held out: ..."), and the rows labelled with a letter."""
    held = [r for r in rows if r["kind"].startswith("held out")]
    parts = {
        "all": rows,
        "real": [r for r in rows if r["source"] != "written"],
        "written": [r for r in rows if r["source"] == "written" and r not in held],
        "held out": held,
        "committed": [r for r in rows if r["label"] is not None],
    }
    said = {r["id"]: got for r, got in zip(rows, read(rows))}
    return {k: (sum(said[r["id"]] == r["label"] for r in v), len(v)) for k, v in parts.items()}


def table(rows: list[dict], before: str | None = None) -> str:
    head = (
        "| extractor | all | real generations | written with the rules | written after (held out) | responses with a "
        "letter |\n|---|---|---|---|---|---|\n"
    )
    lines = []
    for name, read in extractors(before).items():
        a = agreement(rows, read)
        cells = " | ".join(f"{n}/{of} ({n / of:.0%})" if of else "-" for n, of in a.values())
        lines.append(f"| {name} | {cells} |")
    return head + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", default=str(SET))
    ap.add_argument("--misses", action="store_true", help="print the responses m2d reads otherwise than the label")
    ap.add_argument("--before", default=None, help="a git revision: also m2d's reader as it was there")
    ap.add_argument("--json", action="store_true", help="one JSON line: each extractor's letters and agreement")
    a = ap.parse_args()
    rows = [json.loads(line) for line in Path(a.set).read_text().splitlines() if line.strip()]
    if a.json:
        reads = extractors(a.before)
        said = {name: read(rows) for name, read in reads.items()}
        agree = {name: agreement(rows, lambda _, got=got: got) for name, got in said.items()}
        print(json.dumps({"read": said, "agreement": agree}))
        return
    real = sum(r["source"] != "written" for r in rows)
    print(f"{len(rows)} responses ({real} real generations, {len(rows) - real} written), {a.set}")
    print(table(rows, a.before))
    if a.misses:
        for r in rows:
            got = m2d(r["response"], r["choices"])
            if got != r["label"]:
                print(f"- {r['id']} ({r['kind']}): m2d {got}, label {r['label']}: {r['response'][-100:]!r}")


if __name__ == "__main__":
    main()
