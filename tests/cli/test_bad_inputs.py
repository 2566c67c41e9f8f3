"""Every command on bad input: exit code 2, exactly one line on stderr that names the problem and what to do,
and the file system exactly as it was (temp files included: they are gone).

The cases run the real CLI entry point in-process (`m2d_ray.cli.main`) with file-descriptor capture, so
whatever a library would print — from Python or not — counts against the one line.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, SMALL_CALIB
from judge_server import JudgeServer

from m2d_ray.cli import main
from m2d_ray.models import default_teacher
from m2d_ray.shipped import EXPERIMENTS

TINY = EXPERIMENTS / "tiny.yaml"
#: words that tell the user what to do next; every error line has one
ACTIONS = (
    "give",
    "choose",
    "pass",
    "use",
    "resume",
    "recalibrate",
    "re-download",
    "did you mean",
    "write",
    "drop",
    "add",
    "start",
    "check",
    "move",
    "keep",
    "see",
    "list",
    "make",
    "finish",
    "fix",
    "run `",
)


def _poison(path: Path, key_part: str) -> None:
    """One NaN in the first tensor whose name contains `key_part`."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    key = next(k for k in tensors if key_part in k)
    tensors[key].view(-1)[3] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})


def _distill(w, *more: str) -> list[str]:
    """`m2d distill` of the matrix's student on synthetic text, with `more` options."""
    return ["distill", "--student", str(w["student"]), "--eval-data", "synthetic:valid", *more, "--out", "d"]


def _quantised_twin(moe_dir: Path, out: Path, method: str, damage: str | None = None) -> None:
    """The tiny teacher published quantised: its experts in fine-grained FP8 (tests/quantize.py), one expert's scale
    `damage`d (missing or NaN); or just a config naming `method` (the weights are not read before the refusal)."""
    import quantize
    from safetensors.torch import load_file, save_file

    shutil.copytree(moe_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "weight_block_size": [16, 16], "bits": 4}
    (out / "config.json").write_text(json.dumps(config))
    if method != "fp8":
        return
    state = load_file(str(out / "model.safetensors"))
    for key in [k for k in state if ".experts." in k]:
        state[key], state[key + "_scale_inv"] = quantize.quantise_blocks(state[key], 16, 16, torch.float8_e4m3fn)
    scale = "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"
    if damage == "missing":
        del state[scale]
    else:
        state[scale][0, 0] = float("nan")
    save_file(state, str(out / "model.safetensors"))


def _dense_twin(moe_dir: Path, out: Path) -> None:
    """A dense Qwen3 with the MoE teacher's attention and vocabulary and FFN width E x expert width."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    moe = AutoConfig.from_pretrained(moe_dir)
    cfg = Qwen3Config(
        vocab_size=moe.vocab_size,
        hidden_size=moe.hidden_size,
        num_hidden_layers=moe.num_hidden_layers,
        num_attention_heads=moe.num_attention_heads,
        num_key_value_heads=moe.num_key_value_heads,
        head_dim=moe.head_dim,
        intermediate_size=moe.num_experts * moe.moe_intermediate_size,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(moe_dir).save_pretrained(out)


@pytest.fixture(scope="module")
def w(tmp_path_factory, tiny_teacher_dir):
    """One workspace: good and damaged teachers, students, statistics, texts, configs and a run."""
    from transformers import LlamaConfig, PhimoeConfig

    from m2d_ray.artifacts import write_marker
    from m2d_ray.calibrate.artifact import MANIFEST_FILE, STATS_FILE
    from m2d_ray.commands.calibrate import run_calibrate
    from m2d_ray.commands.convert import convert_one
    from m2d_ray.config import dump_config, load_config

    root = tmp_path_factory.mktemp("bad_inputs")
    p = {
        name: root / name
        for name in (
            "teacher",
            "nan_teacher",
            "trunc_teacher",
            "garbage_teacher",
            "unsharded_teacher",
            "stats",
            "corrupt_stats",
            "nan_stats",
            "other_stats",
            "student",
            "nan_student",
            "trunc_student",
            "llama",
            "phimoe",
            "run",
            "work",
            "tmp",
            "dense",
            "nan_dense",
            "gptq_teacher",
            "noscale_teacher",
            "nanscale_teacher",
        )
    }
    for name in ("teacher", "nan_teacher", "trunc_teacher", "garbage_teacher", "unsharded_teacher"):
        shutil.copytree(tiny_teacher_dir, p[name])
    _poison(p["nan_teacher"] / "model.safetensors", "experts")
    weights = p["trunc_teacher"] / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    (p["garbage_teacher"] / "model.safetensors").write_bytes(b"\xff" * 64 + b"not a checkpoint")
    (p["unsharded_teacher"] / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}})
    )
    _dense_twin(tiny_teacher_dir, p["dense"])
    _quantised_twin(tiny_teacher_dir, p["gptq_teacher"], "gptq")
    _quantised_twin(tiny_teacher_dir, p["noscale_teacher"], "fp8", "missing")
    _quantised_twin(tiny_teacher_dir, p["nanscale_teacher"], "fp8", "nan")
    shutil.copytree(p["dense"], p["nan_dense"])
    _poison(p["nan_dense"] / "model.safetensors", "mlp")
    LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32
    ).save_pretrained(p["llama"])
    PhimoeConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32
    ).save_pretrained(p["phimoe"])

    run_calibrate(str(p["teacher"]), "synthetic:valid", p["stats"], max_tokens=2048, seq_len=64)
    for name in ("corrupt_stats", "nan_stats", "other_stats"):
        shutil.copytree(p["stats"], p[name])
    raw = bytearray((p["corrupt_stats"] / STATS_FILE).read_bytes())
    raw[-1] ^= 0xFF
    (p["corrupt_stats"] / STATS_FILE).write_bytes(bytes(raw))
    _poison(p["nan_stats"] / STATS_FILE, "gram")
    from m2d_ray.artifacts import sha256_file

    for name, edit in (
        ("nan_stats", lambda m: m.update(sha256=sha256_file(p["nan_stats"] / STATS_FILE))),
        ("other_stats", lambda m: m["model"].update(name="some/other-moe", config_sha256="0" * 64)),
    ):
        manifest = json.loads((p[name] / MANIFEST_FILE).read_text())
        edit(manifest)
        (p[name] / MANIFEST_FILE).write_text(json.dumps(manifest))

    convert_one(str(p["teacher"]), "sf", "rr", "uniform", 2, p["student"], stats=str(p["stats"]))
    for name in ("nan_student", "trunc_student"):
        shutil.copytree(p["student"], p[name])
    _poison(p["nan_student"] / "model.safetensors", "mlp")
    weights = p["trunc_student"] / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)

    p["run"].mkdir()
    write_marker(p["run"], "run")
    dump_config(load_config(TINY, ["stage2.baselines=[random-init]"]), p["run"] / "config.yaml")
    (p["run"] / "sweep.json").write_text(json.dumps({"sweep_id": "0" * 32, "attempts": 1}))

    p["work"].mkdir()
    p["tmp"].mkdir()
    texts = {
        "empty.txt": b"",
        "short.txt": b"the court",
        "binary.bin": bytes(range(256)) * 64,
        "notes.txt": b"my notes\n",
        "bad.yaml": b"grid: [sf, pp\nname: x\n",
        "typo.yaml": b"include: " + str(TINY).encode() + b"\ngrid:\n  scorng: [sf]\n",
        "answers.jsonl": (json.dumps(ANSWER) + "\n").encode(),
        "no_answer_field.jsonl": (
            json.dumps(ANSWER) + "\n" + json.dumps({k: v for k, v in ANSWER.items() if k != "answer"}) + "\n"
        ).encode(),
        "key_outside.jsonl": (json.dumps({**ANSWER, "answer": "C"}) + "\n").encode(),
        "key_index_outside.jsonl": (
            json.dumps({**ANSWER, "answer": 0}) + "\n" + json.dumps({**ANSWER, "answer": 2}) + "\n"
        ).encode(),  # 0 and the number of choices: neither base reads both
        "key_zero.jsonl": (
            json.dumps({**ANSWER, "answer": 1}) + "\n" + json.dumps({**ANSWER, "answer": 0}) + "\n"
        ).encode(),
    }
    for name, data in texts.items():
        (p["work"] / name).write_bytes(data)
    (p["work"] / "raycluster_without_cpus.yaml").write_text(_raycluster_without_cpus())
    (p["work"] / "mine").mkdir()
    (p["work"] / "mine" / "thesis.tex").write_text("do not delete\n")
    (p["work"] / "textdir").mkdir()
    (p["work"] / "textdir" / "a.txt").write_text("text\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("shards", "broken"):
        (p["work"] / name).mkdir()
        for i in range(2):
            pq.write_table(
                pa.table({"content": ["the court ruled on the case"] * 20}), p["work"] / name / f"part-{i}.parquet"
            )
    shards = f"{p['work'] / 'shards'}#column=content"  # the run started on these files, one of them then smaller
    files = [
        [
            str((p["work"] / "shards" / f"part-{i}.parquet").resolve()),
            1 if i else os.path.getsize(p["work"] / "shards" / "part-0.parquet"),
            1,
        ]
        for i in range(2)
    ]
    (p["run"] / "corpora.json").write_text(
        json.dumps({"eval.data": {"spec": shards, "column": "content", "files": files}})
    )
    raw = (p["work"] / "broken" / "part-1.parquet").read_bytes()
    (p["work"] / "broken" / "part-1.parquet").write_bytes(raw[: len(raw) // 2])
    p["root"] = root
    return p


def _calib(w, data: str) -> list[str]:
    return ["calibrate", "--model", str(w["teacher"]), "--calib-data", data, "--out", "s"]


def _conv(w, *extra):
    return [
        "convert",
        "--model",
        str(w["teacher"]),
        "--stats",
        str(w["stats"]),
        "--K",
        "2",
        "--out",
        "student_out",
        *extra,
    ]


def _prune(w, *extra):
    return ["prune-dense", "--model", str(w["dense"]), "--calib-data", "synthetic:valid", "--out", "pruned_out", *extra]


def _run(*extra):
    return ["run", str(TINY), "--out", "run_out", *extra]


#: one line of a responses file (m2d analyze --responses)
ANSWER = {
    "id": "q1",
    "subject": "astronomy",
    "question": "Which?",
    "choices": ["a", "b"],
    "answer": "A",
    "response": "x",
}
CLOSED_PORT = "http://127.0.0.1:9/v1"  # the discard port: nothing listens there


@pytest.fixture(scope="module")
def judge_404(w):
    """A judge server that answers 404 to everything (a misspelt model, a base URL without /v1): its URL in w."""
    server = JudgeServer(served=())
    server.listed = False
    w["judge_404"] = server.url
    yield server
    server.close()


def _analyze(*extra):
    return ["analyze", "--responses", "answers.jsonl", "--out", "analysis_out", *extra]


# name -> (argv builder given the workspace, fragment of the error line)
CASES = {
    # output paths
    "convert out is a file": (lambda w: _conv(w)[:-1] + ["notes.txt"], "is an existing file"),
    "convert out is a foreign dir": (lambda w: _conv(w)[:-1] + ["mine"], "m2d did not write"),
    "convert out is under a file": (lambda w: _conv(w)[:-1] + ["notes.txt/student"], "which is a file"),
    "convert out holds a student, no --overwrite": (lambda w: _conv(w)[:-1] + [str(w["student"])], "pass --overwrite"),
    "calibrate out holds a student": (
        lambda w: [
            "calibrate",
            "--model",
            str(w["teacher"]),
            "--calib-data",
            "synthetic:valid",
            "--out",
            str(w["student"]),
        ],
        "holds an m2d student, not a statistics",
    ),
    "calibrate out holds other stats": (
        lambda w: ["calibrate", "--model", str(w["teacher"]), *SMALL_CALIB, "--out", str(w["stats"])],
        "pass --overwrite",
    ),
    "distill out is a file": (
        lambda w: ["distill", "--student", str(w["student"]), "--eval-data", "synthetic:valid", "--out", "notes.txt"],
        "is an existing file",
    ),
    "run out is a foreign dir": (lambda w: ["run", str(TINY), "--out", "mine"], "m2d did not write"),
    "run out is an existing run": (lambda w: ["run", str(TINY), "--out", str(w["run"])], "--resume"),
    # methods, K, keys, overrides, YAML
    "K below k": (lambda w: _conv(w, "--K", "1"), "outside [k, E]"),
    "K above E": (lambda w: _conv(w, "--K", "9"), "outside [k, E]"),
    "K not positive (argparse)": (lambda w: _conv(w, "--K", "0"), "must be positive"),
    "unknown scoring": (lambda w: _conv(w, "--scoring", "do_acp"), "did you mean 'do-acp'"),
    "unknown grouping": (lambda w: _conv(w, "--grouping", "kmeans"), "unknown grouping"),
    "unknown scaling": (lambda w: _conv(w, "--scaling", "proportionl"), "did you mean 'proportional'"),
    "unknown baseline": (
        lambda w: ["convert", "--model", str(w["teacher"]), "--baseline", "random", "--out", "b"],
        "unknown baseline",
    ),
    "unknown option": (lambda w: _conv(w, "--scorings", "sf"), "unrecognized arguments"),
    "bad YAML": (lambda w: ["run", "bad.yaml"], "not valid YAML"),
    "unknown config key": (lambda w: ["run", "typo.yaml"], "did you mean grid.scoring"),
    "override without =": (lambda w: _run("grid.K"), "is not key=value"),
    "override of a wrong type": (lambda w: _run("distill.steps=many"), "should be int"),
    "empty grid list": (lambda w: _run("grid.scoring=[]"), "grid.scoring is empty"),
    "grid K outside [k, E]": (lambda w: _run("grid.K=[1,2]"), "outside [k, E]"),
    "unknown distill key": (
        lambda w: ["distill", "--student", str(w["student"]), "--eval-data", "synthetic:valid", "--out", "d", "lrr=1"],
        "did you mean distill.lr",
    ),
    "config file missing": (lambda w: ["run", "missing.yaml"], "not found"),
    # models
    "model missing": (lambda w: _conv(w, "--model", "/nonexistent/model"), "not found"),
    "model is a file": (lambda w: _conv(w, "--model", "notes.txt"), "is a file"),
    "non-MoE model": (lambda w: _conv(w, "--model", str(w["llama"])), "'llama' is not a Mixture-of-Experts family"),
    "MoE family the method cannot express": (
        lambda w: _conv(w, "--model", str(w["phimoe"])),
        "'phimoe' cannot be converted by the method: its sparsemixer",
    ),
    "NaN in a teacher expert": (
        lambda w: ["convert", "--model", str(w["nan_teacher"]), "--calib-data", "synthetic:valid", "--out", "s"],
        "expert 0) has 1 NaN",
    ),
    "NaN in a teacher expert, streamed calibration": (
        lambda w: [
            "convert",
            "--model",
            str(w["nan_teacher"]),
            "--calib-data",
            "synthetic:valid",
            "--stream",
            "--out",
            "s",
        ],
        "expert 0) has 1 NaN",
    ),
    "teacher published in a quantisation m2d cannot read": (
        lambda w: ["convert", "--model", str(w["gptq_teacher"]), "--calib-data", "synthetic:valid", "--out", "s"],
        "quantised with 'gptq', which m2d cannot read",
    ),
    "quantised teacher without a scale": (
        lambda w: ["convert", "--model", str(w["noscale_teacher"]), "--calib-data", "synthetic:valid", "--out", "s"],
        "mlp.experts.3.up_proj.weight is stored quantised (fp8) but its "
        "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv is missing",
    ),
    "quantised teacher with a NaN scale, streamed calibration": (
        lambda w: [
            "convert",
            "--model",
            str(w["nanscale_teacher"]),
            "--calib-data",
            "synthetic:valid",
            "--stream",
            "--out",
            "s",
        ],
        "scale model.layers.0.mlp.experts.3.up_proj.weight_scale_inv (layer 0, expert 3) has 1 NaN",
    ),
    "memory budget not a size": (
        lambda w: [
            "calibrate",
            "--model",
            str(w["teacher"]),
            "--calib-data",
            "synthetic:valid",
            "--max-memory",
            "lots",
            "--out",
            "s",
        ],
        "'lots' not understood",
    ),
    "calib.max_memory not a size": (
        lambda w: _run("calib.max_memory=lots"),
        "calib.max_memory: memory size 'lots' not understood",
    ),
    "truncated teacher checkpoint": (lambda w: _conv(w, "--model", str(w["trunc_teacher"])), "truncated"),
    "garbage teacher checkpoint": (
        lambda w: _conv(w, "--model", str(w["garbage_teacher"])),
        "not a whole safetensors file",
    ),
    "shard named in the index is missing": (
        lambda w: _conv(w, "--model", str(w["unsharded_teacher"])),
        "lacks 1 weight file",
    ),
    "NaN teacher in a run (driver scan)": (
        lambda w: _run(f"model={w['nan_teacher']}", "stage2.baselines=[random-init]"),
        "has 1 NaN",
    ),
    "d2d without its dense teacher": (
        lambda w: _run(f"model={w['nan_teacher']}"),
        "no stage2.d2d_teacher: give the dense model matched",
    ),
    "d2d teacher is an MoE model": (
        lambda w: _run(f"stage2.d2d_teacher={default_teacher()}"),
        "is a Mixture-of-Experts model",
    ),
    "teacher-topk below k": (
        lambda w: [
            "distill",
            "--student",
            str(w["student"]),
            "--teacher",
            str(w["teacher"]),
            "--teacher-topk",
            "1",
            "--eval-data",
            "synthetic:valid",
            "--out",
            "d",
        ],
        "outside [k, E]",
    ),
    # students
    "distill student missing": (
        lambda w: ["distill", "--student", "/missing", "--eval-data", "synthetic:valid", "--out", "d"],
        "neither a model directory nor a baseline",
    ),
    "distill student truncated": (
        lambda w: ["distill", "--student", str(w["trunc_student"]), "--eval-data", "synthetic:valid", "--out", "d"],
        "truncated",
    ),
    "eval model with a NaN weight": (
        lambda w: ["eval", "--model", str(w["nan_student"]), "--tasks", "local"],
        "has 1 NaN",
    ),
    # statistics
    "stats dir missing": (lambda w: _conv(w, "--stats", "/nonexistent/stats"), "not a statistics directory"),
    "stats corrupted": (lambda w: _conv(w, "--stats", str(w["corrupt_stats"])), "checksum"),
    "stats with NaN": (lambda w: _conv(w, "--stats", str(w["nan_stats"])), "has 1 NaN"),
    "stats of another teacher": (lambda w: _conv(w, "--stats", str(w["other_stats"])), "computed for some/other-moe"),
    # data
    "calibration text empty": (
        lambda w: _calib(w, "empty.txt"),
        "empty",
    ),
    "calibration text too short": (
        lambda w: _calib(w, "short.txt"),
        "at least",
    ),
    "calibration text binary": (
        lambda w: _calib(w, "binary.bin"),
        "not a UTF-8 text file",
    ),
    "calibration data is a directory without corpus files": (
        lambda w: _calib(w, "mine"),
        "is a directory with no .parquet",
    ),
    "calibration split unknown": (
        lambda w: _calib(w, "synthetic:dev"),
        "unknown split",
    ),
    "convert eval data missing (before any work)": (
        lambda w: _conv(w, "--eval-data", "/missing.txt"),
        "neither a file",
    ),
    "distill eval data missing": (
        lambda w: ["distill", "--student", str(w["student"]), "--eval-data", "/missing.txt", "--out", "d"],
        "neither a file",
    ),
    "distill train data missing": (
        lambda w: [
            "distill",
            "--student",
            str(w["student"]),
            "--eval-data",
            "synthetic:valid",
            "--train-data",
            "/missing.jsonl",
            "--out",
            "d",
        ],
        "neither a file",
    ),
    "run train data missing": (lambda w: _run("distill.train_data=/missing.txt"), "neither a file"),
    "train data glob matches nothing": (
        lambda w: _run("distill.train_data=shards/*.jsonl.gz"),
        "no file matches shards/*.jsonl.gz",
    ),
    "train data shard without the column": (
        lambda w: _run("distill.train_data=shards"),
        "part-0.parquet has no column 'text' (columns: content)",
    ),
    "train data shard corrupt": (
        lambda w: [
            "distill",
            "--student",
            str(w["student"]),
            "--eval-data",
            "synthetic:valid",
            "--train-data",
            "broken#column=content",
            "--out",
            "d",
        ],
        "part-1.parquet is corrupt",
    ),
    "train data shorter than the budget": (
        lambda w: _run("distill.train_data=shards#column=content"),
        "but the budget needs 320",
    ),
    "calibration data on the hub, offline without a cache": (
        lambda w: ["calibrate", "--model", str(w["teacher"]), "--calib-data", "hf:nobody/no-such-corpus", "--out", "s"],
        "offline); run once online",
        {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    ),
    # tasks
    "unknown lm-eval task": (
        lambda w: ["eval", "--model", str(w["student"]), "--tasks", "hellaswagg"],
        "did you mean hellaswag",
    ),
    "bad task spec": (lambda w: ["eval", "--model", str(w["student"]), "--tasks", "hellaswag:ten"], "name:shots"),
    "text task file missing": (
        lambda w: ["eval", "--model", str(w["student"]), "--tasks", "text:/missing.txt"],
        "is not a file",
    ),
    "unknown task in a run config": (lambda w: _run("stage3.tasks=arc_easyy"), "did you mean arc_easy"),
    # runs
    "run: a stage no node type holds (before calibration)": (
        lambda w: _run("distill.gpus_per_worker=1"),
        "stage2: no node type can ever hold one rank (CPU 1, GPU 1",
    ),
    "run: a stage over its device's memory (before calibration)": (
        lambda w: _run("distill.batch_size=100000", "distill.seq_len=1024"),
        "stage2: one rank needs",
    ),
    "run: unknown GPU type": (lambda w: _run("stage3.accelerator=H1OO"), "did you mean H100"),
    "plan: a config that does not fit": (
        lambda w: ["plan", str(TINY), "distill.batch_size=100000", "distill.seq_len=1024"],
        "a smaller distill.batch_size (now 100000",  # checkpointing auto already took full: what is left to change
    ),
    "plan: cluster config missing": (lambda w: ["plan", str(TINY), "--cluster", "missing.yaml"], "not found"),
    "plan: a RayCluster whose head has no CPUs": (
        lambda w: ["plan", str(TINY), "--cluster", str(w["work"] / "raycluster_without_cpus.yaml")],
        "Ray's autoscaler cannot read this RayCluster (Autoscaler failed to detect `CPU` resources",
    ),
    "plan: a CPU efficiency above 1": (
        lambda w: ["plan", str(TINY), "plan.cpu_efficiency=1.5"],
        "plan.cpu_efficiency=1.5 must be in (0, 1]",
    ),
    "run: over plan.max_dollars (before calibration)": (
        lambda w: [
            *_run("distill.gpus_per_worker=1", "distill.accelerator=H100", "plan.max_dollars=0.01"),
            "--cluster",
            str(ROOT / "cluster.yaml"),
        ],
        "but plan.max_dollars is $0.01",
    ),
    "plan: storage over plan.max_storage": (
        lambda w: ["plan", str(TINY), "plan.max_storage=10MiB"],
        "(most: checkpoints 10 MiB) but plan.max_storage is 10 MiB; fewer students at once",
    ),
    "plan: every exact mode over plan.max_storage and memory": (
        lambda w: [
            "plan",
            str(EXPERIMENTS / "qwen3_30b_a3b.yaml"),
            "--model",
            str(EXPERIMENTS / "configs" / "Qwen--Qwen3-30B-A3B"),
            "--cluster",
            str(ROOT / "cluster.yaml"),
            "plan.max_storage=1TB",
            "distill.workers=1",
            "distill.deepspeed=false",  # at one rank ZeRO shards nothing (and its float32 bucket would not fit)
            "distill.accelerator=H100",  # unset, the plan would place the rank on an H200, where online fits
        ],
        "no exact mode fits teacher (hidden stores 2004.3 GiB, over plan.max_storage 931.3 GiB; online needs 124.4 GiB "
        "a rank, over the 75.7 GiB a device gives it)",
    ),
    "plan: a misspelt recipe": (
        lambda w: ["plan", str(TINY), "stage2.recipes=[do-acp/rx/K4/uniform]"],
        "unknown grouping 'rx'; did you mean",
    ),
    "run: a recipe's K outside [k, E]": (
        lambda w: _run("stage2.recipes=[sf/rr/K64/uniform]"),
        "stage2.recipes: sf/rr/K64/uniform outside K in [k, E] = [2, 16]",
    ),
    "distill: a sharded teacher with cached targets": (
        lambda w: _distill(w, "--targets", "hidden", "--shard-teacher", "--workers", "2"),
        "stage2.shard_teacher=true changes nothing with stage2.targets=hidden",
    ),
    "distill: a sharded teacher on one worker": (
        lambda w: _distill(w, "--shard-teacher"),
        "changes nothing with distill.workers=1",
    ),
    "resume of a directory that is no run": (lambda w: ["run", "--resume", "mine"], "not an m2d run directory"),
    "resume with a changed grid": (
        lambda w: ["run", "--resume", str(w["run"]), "grid.K=[4]"],
        "grid differ from stage 1",
    ),
    "resume against a changed corpus": (
        lambda w: ["run", "--resume", str(w["run"]), f"eval.data={w['work'] / 'shards'}#column=content"],
        "part-0.parquet modified; ",
    ),
    "sweep resume with overrides": (
        lambda w: ["sweep", "--resume", str(w["run"]), "grid.K=[4]"],
        "reuses the run's saved config",
    ),
    "report of a directory that is no run": (lambda w: ["report", "mine"], "not an m2d run directory"),
    "stage 2 without a stage 1": (lambda w: ["sweep", str(TINY), "stage=2"], "add --resume"),
    # what the models write (m2d analyze, stage3.analysis)
    "analyze: unknown judge": (lambda w: _analyze("--judge", "gpt-4"), "unknown judge 'gpt-4'"),
    "analyze: unreachable judge URL": (
        lambda w: _analyze("--judge", "openai:some-model", "--judge-url", CLOSED_PORT),
        f"judge URL {CLOSED_PORT} is unreachable",
    ),
    "analyze: a judge server that answers 404": (
        lambda w: _analyze("--judge", "openai:some-model", "--judge-url", w["judge_404"]),
        "cannot judge with model 'some-model' (HTTP 404: The model `some-model` does not exist.)",
    ),
    "analyze: --judge teacher without --teacher": (
        lambda w: _analyze("--judge", "teacher"),
        "--judge teacher needs the judge's model; give --teacher MODEL",
    ),
    "analyze: an answer key outside the choices": (
        lambda w: ["analyze", "--responses", "key_outside.jsonl", "--out", "a"],
        "key_outside.jsonl line 1: field 'answer' is 'C': no letter A-B nor a choice's text",
    ),
    "analyze: an integer answer key outside the choices": (
        lambda w: ["analyze", "--responses", "key_index_outside.jsonl", "--out", "a"],
        "key_index_outside.jsonl line 2: field 'answer' is 2, not an index of its 2 choices (0 to 1, counted from 0); "
        "give a letter, an integer counted from 0 (the file's keys include 0",
    ),
    "analyze: a 0 key with --key-base 1": (
        lambda w: ["analyze", "--responses", "key_zero.jsonl", "--key-base", "1", "--out", "a"],
        "key_zero.jsonl line 2: field 'answer' is 0, not an index of its 2 choices (1 to 2, counted from 1); give a "
        "letter, an integer counted from 1",
    ),
    "analyze: max unjudged not a share (argparse)": (
        lambda w: _analyze("--max-unjudged", "5"),
        "must be a share in [0, 1]",
    ),
    "analyze: a responses line without a field": (
        lambda w: ["analyze", "--responses", "no_answer_field.jsonl", "--out", "a"],
        "no_answer_field.jsonl line 2 has no field 'answer'",
    ),
    "analyze: max new tokens not positive (argparse)": (
        lambda w: ["analyze", "--model", str(w["student"]), "--max-new-tokens", "0", "--out", "a"],
        "must be positive",
    ),
    "analyze: MMLU data missing": (
        lambda w: ["analyze", "--model", str(w["student"]), "--out", "a"],
        "run `m2d fetch-data`",
        {"M2D_DATA_DIR": "/nonexistent-m2d-data"},
    ),
    "analyze: out holds a student": (
        lambda w: _analyze()[:-1] + [str(w["student"])],
        "holds an m2d student, not an analysis",
    ),
    "analyze: judge deadline not positive (argparse)": (
        lambda w: _analyze("--judge-deadline", "0"),
        "must be positive",
    ),
    "analyze: key base not 0 or 1 (argparse)": (lambda w: _analyze("--key-base", "2"), "invalid choice: '2'"),
    "run: analysis judge deadline not positive": (
        lambda w: _run("stage3.analysis.judge_deadline=0"),
        "stage3.analysis.judge_deadline=0",
    ),
    "run: unknown analysis judge": (lambda w: _run("stage3.analysis.judge=gpt"), "unknown judge 'gpt'"),
    "run: unreachable analysis judge (before any work)": (
        lambda w: _run("stage3.analysis.judge=openai:m", f"stage3.analysis.judge_url={CLOSED_PORT}"),
        f"judge URL {CLOSED_PORT} is unreachable",
    ),
    "run: a judge server that answers 404 (before any work)": (
        lambda w: _run("stage3.analysis.judge=openai:m", f"stage3.analysis.judge_url={w['judge_404']}"),
        "cannot judge with model 'm' (HTTP 404",
    ),
    "run: analysis max_unjudged not a share": (
        lambda w: _run("stage3.analysis.max_unjudged=5"),
        "stage3.analysis.max_unjudged=5.0: give a share in [0, 1]",
    ),
    "run: analysis on MMLU without its data": (
        lambda w: _run("stage3.analysis.questions=mmlu"),
        "run `m2d fetch-data`",
        {"M2D_DATA_DIR": "/nonexistent-m2d-data"},
    ),
    "run: analysis max_new_tokens not positive": (
        lambda w: _run("stage3.analysis.max_new_tokens=0"),
        "stage3.analysis.max_new_tokens=0: give a positive number",
    ),
    # dense-to-dense pruning
    "prune-dense of an MoE teacher": (
        lambda w: _prune(w, "--model", str(w["teacher"]), "--target-params", "50000"),
        "is a Mixture-of-Experts model",
    ),
    "prune-dense without a budget or sizes": (lambda w: _prune(w), "give exactly one of"),
    "prune-dense with a budget and sizes": (
        lambda w: _prune(w, "--target-params", "50000", "--ffn", "32"),
        "give exactly one of",
    ),
    "prune-dense heads not whole groups": (lambda w: _prune(w, "--heads", "1"), "not a multiple of 2"),
    "prune-dense size above the teacher's": (lambda w: _prune(w, "--ffn", "4096"), "--ffn 4096 is outside [1, 128]"),
    "prune-dense size not positive (argparse)": (lambda w: _prune(w, "--layers", "0"), "must be positive"),
    "prune-dense budget above the teacher": (
        lambda w: _prune(w, "--target-params", "100000000"),
        "not below the teacher's",
    ),
    "prune-dense budget too small": (lambda w: _prune(w, "--target-params", "100"), "candidate shape"),
    "prune-dense match is no MoE": (
        lambda w: _prune(w, "--match", str(w["dense"])),
        "'qwen3' is not a Mixture-of-Experts family",
    ),
    "prune-dense out holds a student": (
        lambda w: [*_prune(w)[:-1], str(w["student"]), "--ffn", "32"],
        "holds an m2d student, not a pruned",
    ),
    "prune-dense calibration text too short": (
        lambda w: _prune(w, "--ffn", "32", "--calib-data", "short.txt"),
        "at least",
    ),
    "prune-dense eval data missing": (
        lambda w: _prune(w, "--ffn", "32", "--eval-data", "/missing.txt"),
        "neither a file",
    ),
    "prune-dense NaN in the teacher": (lambda w: _prune(w, "--model", str(w["nan_dense"]), "--ffn", "32"), "has 1 NaN"),
}


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every path under `root` with its mode, size and mtime (the temp directory itself excepted: checked empty)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    out.pop("tmp")
    return out


def _raycluster_without_cpus() -> str:
    """k8s/raycluster.yaml with its head's container limits gone: Ray's autoscaler cannot tell its CPUs."""
    docs = list(yaml.safe_load_all((ROOT / "k8s" / "raycluster.yaml").read_text()))
    head = next(d for d in docs if d["kind"] == "RayCluster")["spec"]["headGroupSpec"]
    del head["template"]["spec"]["containers"][0]["resources"]
    return yaml.safe_dump_all(docs)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input(case, w, judge_404, capfd, monkeypatch):
    argv, fragment, *env = CASES[case]
    for key, value in (env[0] if env else {}).items():
        monkeypatch.setenv(key, value)
    args = argv(w)
    monkeypatch.chdir(w["work"])
    monkeypatch.setattr(tempfile, "tempdir", str(w["tmp"]))  # the command's temp files must be gone afterwards
    torch.manual_seed(0)
    capfd.readouterr()
    before = _snapshot(w["root"])
    try:
        code = main(args)
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (case, err[-2000:])
    assert len(lines) == 1, f"{case}: expected one line on stderr, got:\n{err[-3000:]}"
    line = lines[0]
    assert line.startswith("m2d: error: ") and fragment in line, line
    assert any(a in line.lower() for a in ACTIONS), f"the line does not say what to do: {line}"
    assert out == "" or args[0] == "plan", out  # m2d plan's table and bill are its output, fitting or not
    assert _snapshot(w["root"]) == before, f"{case} changed the file system"
    assert not any(w["tmp"].iterdir()), list(w["tmp"].iterdir())


def test_the_matrix_covers_every_command():
    fake = collections.defaultdict(lambda: Path("x"))
    assert len(CASES) >= 30
    assert {build(fake)[0] for build, *_ in CASES.values()} == {
        "convert",
        "calibrate",
        "distill",
        "eval",
        "run",
        "sweep",
        "report",
        "prune-dense",
        "plan",
        "analyze",
    }
