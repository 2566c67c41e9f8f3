"""`m2d distill`: one student (a directory, or a baseline name built from the teacher) on Ray Train.

OUT/metrics.jsonl is the validation curve, OUT/result.json the summary, OUT/logs the log; the storage
(`--storage`, default OUT) holds student/ (the exported student), train/ (the Ray Train checkpoints:
running the same command again resumes; removed once the student is exported, unless
stage2.keep_training_state=true), init/ for a baseline, and what the workers read (the text
files, and a student directory or teacher on the driver's disk when Ray is a cluster). A finished OUT is
replaced only with --overwrite, and only once the new student is done (the new run is made in a hidden
sibling directory, which a killed --overwrite run resumes from).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from m2d_ray.artifacts import check_output, replace_dir, write_json_atomic, write_marker
from m2d_ray.catalog.distill import AUTO
from m2d_ray.catalog.methods import RANDOM_BASELINES
from m2d_ray.catalog.targets import ONLINE
from m2d_ray.checkpoint import check_files, scan
from m2d_ray.commands.runs import keep_logs
from m2d_ray.config import RayConfig, SweepConfig, load_config
from m2d_ray.console import emit, say
from m2d_ray.convert.initial import InitialStudent
from m2d_ray.data.text import check_spec
from m2d_ray.distill.checkpointing import without_plan
from m2d_ray.distill.data import check_source
from m2d_ray.distill.trainer import MetricsLog, fit, follow
from m2d_ray.errors import M2DError, RunFailed
from m2d_ray.models import (
    absolute,
    check_teacher,
    check_teacher_topk,
    default_teacher,
    load_tokenizer,
    model_config,
)
from m2d_ray.runtime.ray_env import ensure_ray
from m2d_ray.runtime.run_storage import RunStorage
from m2d_ray.runtime.shards import targets, tokens
from m2d_ray.stages.student import job


def distill_one(
    teacher: str | None,
    student: str,
    out: str | Path,
    eval_data: str,
    config: str | None = None,
    overrides: list[str] = (),
    overwrite: bool = False,
    store: str | None = None,
    loaded: SweepConfig | None = None,
) -> dict:
    """One student distilled (`loaded`: the config as the CLI read it from `config` and `overrides`)."""
    full = loaded or load_config(config, overrides)
    cfg, shard = full.distill, full.stage2.shard_teacher  # (refused with cached targets or one worker)
    spec = None if full.stage2.targets == AUTO else full.target_spec()
    out = check_output(out, "distillation", overwrite=True).resolve()  # never a file or a foreign directory
    finished = (out / "result.json").exists()
    if finished and not overwrite:
        raise M2DError(
            f"--out {out} already holds a finished distillation; pass --overwrite to replace it, or choose a new path"
        )
    teacher = absolute(teacher or default_teacher())
    check_teacher(teacher)
    check_teacher_topk(teacher, cfg.teacher_topk)
    student_dir = None
    if student not in RANDOM_BASELINES:
        student_dir = Path(student).expanduser().resolve()
        if not (student_dir / "config.json").is_file():
            raise M2DError(
                f"student {student!r} is neither a model directory nor a baseline: give a directory from m2d convert, "
                f"or one of {', '.join(RANDOM_BASELINES.names())}"
            )
        model_config(str(student_dir))
        check_files(str(student_dir), "student")
    check_spec(eval_data, "--eval-data")
    check_source(cfg.train_data, cfg)
    scan(teacher, "teacher")
    if student_dir is not None:
        scan(str(student_dir), "student")
    if store is not None:
        RunStorage(store).check()
    if cfg.checkpointing == AUTO:  # no plan here to decide it (m2d run's does): the trainer's rule, said once
        cfg = dataclasses.replace(cfg, checkpointing=without_plan("cuda" if cfg.gpus_per_worker > 0 else "cpu"))
        say(
            f"distill.checkpointing=auto: {cfg.checkpointing} (m2d distill plans no memory: full on a GPU, none on a "
            "CPU; name none or selective to keep more activations)"
        )

    work = out.with_name(f".{out.name}.m2d-new") if finished else out  # --overwrite: built aside, swapped in at the end
    work.mkdir(parents=True, exist_ok=True)
    write_marker(work, "distillation")
    keep_logs(work)
    storage = RunStorage(store or str(work))
    ensure_ray(RayConfig())
    storage.mark()
    local_teacher, teacher = teacher, storage.put_model(teacher)
    init = storage.put_model(str(student_dir), "student") if student_dir is not None else None
    build = InitialStudent(teacher, baseline=student, seed=cfg.seed) if student_dir is None else None
    cfg = dataclasses.replace(cfg, train_data=storage.put_data(cfg.train_data))
    eval_data = storage.put_data(eval_data)
    if full.stage2.targets == AUTO:  # one student: its teacher never stores states
        say(
            "stage2.targets=auto: online"
            + (f", the teacher sharded over the {cfg.workers} ranks" if shard else "")
            + " (one student: cached states would cost the teacher's forward once anyway, and their storage)"
        )
    toks = tokens(storage, teacher, load_tokenizer(local_teacher), cfg, eval_data)
    targ = targets(storage, teacher, toks, spec, cfg, full.calib, full.ray) if spec else None
    with follow(work / "metrics.jsonl", out.name, total=cfg.steps):
        result = fit(
            job(
                storage,
                None,
                teacher,
                cfg,
                eval_data,
                build=build,
                init=init,
                tokens=toks,
                targets=targ,
                target_spec=spec,
                shard_teacher=shard,
            ),
            callbacks=[MetricsLog(work / "metrics.jsonl")],
        )
    if result.error is not None:
        raise RunFailed(
            f"distillation failed: {str(result.error).splitlines()[0][:300]}; fix it and run the same command to resume"
        )
    m = result.metrics
    summary = {
        "student": RunStorage(store or str(out)).student(),
        "steps": m["step"],
        "tokens": m["tokens"],
        "resumed_from": m["resumed_from"],
        "first_val_ppl": m["val_ppl_initial"],
        "last_val_ppl": m["val_ppl"],
        "tokens_per_s": m["tokens_per_s"],
        "loss": cfg.loss,
        "teacher_topk": cfg.teacher_topk,
        "deepspeed": cfg.uses_deepspeed,
        "precision": cfg.precision,
        "workers": cfg.workers,
        "targets": str(spec or ONLINE) + (", sharded" if shard else ""),
        "peak_rss_bytes": m.get("peak_rss_bytes"),
        "peak_cuda_bytes": m.get("peak_cuda_bytes"),
        "metrics": str(out / "metrics.jsonl"),
    }
    if not full.stage2.keep_training_state:  # the exported student is in storage (the last report waits for it)
        storage.drop_training_state(None, storage.student())
    write_json_atomic(work / "result.json", summary)
    if work != out:
        replace_dir(out, work)
    return summary


def main(args) -> None:
    how = {"overwrite": args.overwrite, "store": args.storage, "loaded": args.cfg}  # the config: read once, by the CLI
    emit(json.dumps(distill_one(args.teacher, args.student, args.out, args.eval_data, **how)))
