"""Science check on real text: distil four students of ../shared/teachers/qwen3moe-wiki4 with one budget.

    DO-ACP K=k (pure pruning, the paper's best), the best SF student of stage 1 (runs/wiki4/promotions.json,
    or sf/rr K=8 proportional), random FFN + teacher attention, random init of the whole student.
Validation perplexity on ../shared/data/wikitext-2/wiki.test.raw over steps; prints a markdown table.

    python -m benchmarks.science.wiki4_students [--steps 150] [--out runs/s2-wiki4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks.common import REPO as ROOT
from benchmarks.common import TEACHER_DIR as TEACHER
from benchmarks.common import WIKI_TEST as EVAL
from benchmarks.common import WIKI_VALID as TRAIN


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default=str(ROOT / "runs" / "s2-wiki4"))
    args = ap.parse_args()
    out = Path(args.out)
    from m2d_ray.commands.convert import convert_one

    stats = ROOT / "runs" / "wiki4" / "stats"
    prom = ROOT / "runs" / "wiki4" / "promotions.json"
    sf = {"K": 8, "scaling": "proportional", "grouping": "rr"}
    if prom.exists():
        pairs = json.loads(prom.read_text())["pairs"]
        sf = min((v for k, v in pairs.items() if k.startswith("sf/")), key=lambda v: v["ppl"])
    recipes = {
        "DO-ACP K=k": ("do-acp", "rr", "uniform", None),
        f"SF {sf['grouping']} K={sf['K']} {sf['scaling']}": ("sf", sf["grouping"], sf["scaling"], sf["K"]),
    }
    students, slugs = {}, {}
    for name, (s, g, c, K) in recipes.items():
        slugs[name] = s
        d = out / "init" / s
        if not (d / "config.json").exists():
            convert_one(
                str(TEACHER),
                s,
                g,
                c,
                K,
                d,
                stats=str(stats) if stats.exists() else None,
                calib_data=None if stats.exists() else str(TRAIN),
                calib_kwargs={"max_tokens": 32768, "seq_len": 256},
            )
        students[name] = str(d)
    for name, baseline in (("random FFN + teacher attention", "random-ffn"), ("random init", "random-init")):
        students[name] = slugs[name] = baseline
    curves = {}
    for name, student in students.items():
        run = out / slugs[name]
        if not (run / "result.json").exists():
            cmd = [
                sys.executable,
                "-m",
                "m2d_ray.cli",
                "distill",
                "--teacher",
                str(TEACHER),
                "--student",
                student,
                "--train-data",
                str(TRAIN),
                "--eval-data",
                str(EVAL),
                "--steps",
                str(args.steps),
                "--no-deepspeed",
                "--out",
                str(run),
                "lr=1e-3",
                "min_lr=1e-4",
                "warmup_steps=10",
                "batch_size=8",
                "seq_len=256",
                "eval_every=25",
                "eval_max_tokens=65536",
                "threads_per_worker=2",
            ]
            subprocess.run(cmd, check=True)
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [(0, lines[0]["val_ppl_initial"])] + [(m["step"], m["val_ppl"]) for m in lines]
    steps = [s for s, _ in next(iter(curves.values()))]
    print("| student | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---:|" * len(steps))
    for name, c in curves.items():
        print(f"| {name} | " + " | ".join(f"{p:,.1f}" for _, p in c) + " |")


if __name__ == "__main__":
    main()
