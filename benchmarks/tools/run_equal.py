"""Whether two runs of the same config say the same thing, whatever their times: the check that a restructuring
changed nothing for a user (issue 38).

    python -m benchmarks.tools.run_equal RUN_A RUN_B
        the run directories' tables (RUN_DIR/*.csv|md and report/*.csv|md), ledgers (stage 1, 2, 3), promotions and
        plans, memory_plan.json, and the MLflow runs (params, tags, final metrics and every metric's history) of
        each, with the run directory's own path made neutral; wall times, throughputs, memory peaks, the CPU rate
        and load a plan was priced with, and the Tune attempt ids are left out (they differ between two runs of
        one code on one machine)
    python -m benchmarks.tools.run_equal --plans OUT_A OUT_B
        two directories of `m2d plan` outputs (benchmarks/tools/plan_matrix.sh): every JSON line and table equal, but
            the
        seconds of CPU stages (priced at the machine's load when the plan was made)

Prints each difference and exits 1 when there is one; floats compare to a relative 1e-6.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from pathlib import Path

#: keys that hold a wall time, a throughput, a memory peak, the machine's rate or load, or an attempt id
VOLATILE = {
    "tokens_per_s",
    "mean_tokens_per_s",
    "mfu",
    "train_s",
    "eval_s",
    "ckpt_s",
    "peak_rss_bytes",
    "peak_cuda_bytes",
    "peak_work_bytes",
    "attempt",
    "seconds",
    "cpu_flops",
    "cpu_load",
    "capacity",
    "wall_s",
    "finished",
    "created",
    "node_hours",
    "s / training step",
    "tokens/s",
    "tok/s",
    "estimated s",
    "measured s",
    "measured / estimated",
    "measured peak MiB",
    "measured / planned",
    "peak RSS / rank (MB)",
    "sweep_id",
    "placement",
    "stats_sha256",  # covers the teacher's path too (two checkouts differ there): the statistics' tensors are compared
}
TABLES = ("stage1", "stage2", "distill", "matched", "overlap", "erank", "d2d_candidates", "memory", "cost")
LEDGERS = ("trials", "stage2/trials", "stage3/results")
JSONS = ("promotions.json", "plans.json", "memory_plan.json", "stage2/d2d/search.json")


def neutral(obj, run: Path):
    """`obj` with the run directory's path as RUN, the package's embedded assets as ASSETS (two checkouts' paths
    differ) and the volatile keys dropped."""
    text = re.sub(r'[^"\s]*/m2d_ray/assets/', "ASSETS/", json.dumps(obj).replace(str(run), "RUN"))
    return _drop(json.loads(text))


def _drop(obj):
    if isinstance(obj, dict):
        return {k: _drop(v) for k, v in obj.items() if k not in VOLATILE and not k.endswith((".seconds", "_s"))}
    if isinstance(obj, list):
        return [_drop(v) for v in obj]
    return obj


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isfinite(a) and math.isfinite(b) and math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def table(path: Path, run: Path) -> list:
    """A CSV or Markdown table as rows of cells, the volatile columns blanked."""
    text = re.sub(r"\S*/m2d_ray/assets/", "ASSETS/", path.read_text().replace(str(run), "RUN"))
    if path.suffix == ".csv":
        rows = list(csv.reader(text.splitlines()))
    else:
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
        rows += [[line] for line in text.splitlines() if line and not line.startswith("|")]
    if not rows:
        return rows
    drop = {i for i, h in enumerate(rows[0]) if h in VOLATILE or h.endswith("_s")}
    return [[_num(c) for i, c in enumerate(r) if i not in drop] for r in rows]


def _num(cell: str):
    try:
        return float(cell.replace(",", ""))
    except ValueError:
        return cell


def mlflow_runs(run: Path) -> dict:
    """Every MLflow run of the run's store by its m2d key (the parent as "parent"): params, tags, metrics, histories."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    out = {}
    for exp in client.search_experiments():
        for r in client.search_runs([exp.experiment_id], max_results=50_000):
            key = r.data.tags.get("m2d.trial") or ("parent" if "m2d.sweep_id" in r.data.tags else r.info.run_name)
            tags = {
                k: v for k, v in r.data.tags.items() if not k.startswith("mlflow.") or k in ("mlflow.note.content",)
            }
            tags.pop("m2d.sweep_id", None)
            tags.pop("mlflow.parentRunId", None)
            history = {
                m: [(x.step, x.value) for x in client.get_metric_history(r.info.run_id, m)]
                for m in r.data.metrics
                if m not in VOLATILE
            }
            out[key] = neutral(
                {
                    "status": r.info.status,
                    "params": r.data.params,
                    "tags": tags,
                    "metrics": r.data.metrics,
                    "history": history,
                },
                run,
            )
    return out


def compare_runs(a: Path, b: Path) -> list[str]:
    diffs = compare_stats(a, b)
    for d in (".", "report"):
        names = sorted(
            {p.name for p in (a / d).glob("*") if p.suffix in (".csv", ".md") and p.stem in TABLES}
            | {p.name for p in (b / d).glob("*") if p.suffix in (".csv", ".md") and p.stem in TABLES}
        )
        for n in names:
            pa, pb = a / d / n, b / d / n
            if not (pa.exists() and pb.exists()):
                diffs.append(f"{d}/{n}: only in {'A' if pa.exists() else 'B'}")
            elif not same(table(pa, a), table(pb, b)):
                diffs.append(f"{d}/{n}: tables differ")
    for sub in LEDGERS:
        ka = {p.stem: neutral(json.loads(p.read_text()), a) for p in sorted((a / sub).glob("*.json"))}
        kb = {p.stem: neutral(json.loads(p.read_text()), b) for p in sorted((b / sub).glob("*.json"))}
        if ka.keys() != kb.keys():
            diffs.append(f"{sub}: keys {sorted(ka.keys() ^ kb.keys())} in one only")
        diffs += [
            f"{sub}/{k}.json differs: {_first(ka[k], kb[k])}"
            for k in sorted(ka.keys() & kb.keys())
            if not same(ka[k], kb[k])
        ]
    for n in JSONS:
        pa, pb = a / n, b / n
        if pa.exists() != pb.exists():
            diffs.append(f"{n}: only in {'A' if pa.exists() else 'B'}")
        elif pa.exists():
            ja, jb = neutral(json.loads(pa.read_text()), a), neutral(json.loads(pb.read_text()), b)
            if not same(ja, jb):
                diffs.append(f"{n} differs: {_first(ja, jb)}")
    ma, mb = mlflow_runs(a), mlflow_runs(b)
    if ma.keys() != mb.keys():
        diffs.append(f"MLflow runs {sorted(ma.keys() ^ mb.keys())} in one only")
    diffs += [
        f"MLflow run {k} differs: {_first(ma[k], mb[k])}"
        for k in sorted(ma.keys() & mb.keys())
        if not same(ma[k], mb[k])
    ]
    return diffs


def compare_stats(a: Path, b: Path) -> list[str]:
    """The calibration statistics of both runs: every tensor equal to float64 round-off."""
    from safetensors.torch import load_file

    x, y = (load_file(str(r / "stats" / "stats.safetensors")) for r in (a, b))
    if x.keys() != y.keys():
        return ["stats: other tensors"]
    bad = [
        k for k in x if not x[k].double().allclose(y[k].double(), rtol=1e-12, atol=1e-12 * float(x[k].abs().max() or 1))
    ]
    return [f"stats: {k} differs" for k in bad]


def _first(a, b, where: str = "") -> str:
    """Where two values first differ (a path of keys) and the two values there."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            if k not in a or k not in b or not same(a[k], b[k]):
                return _first(a.get(k), b.get(k), f"{where}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if not same(x, y):
                return _first(x, y, f"{where}[{i}]")
    return f"{where or '.'}: {str(a)[:160]} != {str(b)[:160]}"


def compare_plans(a: Path, b: Path) -> list[str]:
    diffs = []
    for pa in sorted(a.glob("*.out")):
        pb = b / pa.name
        la, lb = pa.read_text().splitlines(), pb.read_text().splitlines() if pb.exists() else []
        ja = [_drop(json.loads(x)) for x in la if x.startswith("{")]
        jb = [_drop(json.loads(x)) for x in lb if x.startswith("{")]
        timed = (" s ", " min ", " h ", "s  ", "the most it can cost")  # the tables' time columns
        ta = [x for x in la if not x.startswith("{") and not any(t in x for t in timed)]
        tb = [x for x in lb if not x.startswith("{") and not any(t in x for t in timed)]
        if not same(ja, jb) or ta != tb:
            diffs.append(f"{pa.name}: {'the JSON line' if not same(ja, jb) else 'the table'} differs")
    for ea in sorted(a.glob("*.err")):
        eb = b / ea.name
        if ea.read_text() != (eb.read_text() if eb.exists() else None):
            diffs.append(f"{ea.name}: the refusal differs")
    return diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--plans", action="store_true", help="compare two directories of `m2d plan` outputs")
    args = ap.parse_args()
    diffs = compare_plans(args.a, args.b) if args.plans else compare_runs(args.a.resolve(), args.b.resolve())
    for d in diffs:
        print(d)
    print(f"{'equal' if not diffs else f'{len(diffs)} differences'}: {args.a} vs {args.b}")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
