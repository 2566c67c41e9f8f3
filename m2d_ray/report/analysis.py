"""The numbers behind the run report, read from a run directory (no plotting, no HTML).

distillation table   one row per promoted pair (+ baselines, teacher): stage-1 ppl, stage-2 outcome,
                     per-benchmark accuracy and the unweighted mean
marginal effects     mean accuracy per scoring (over groupings) and per grouping (over scorings)
matched parameters   best MoE-to-dense student vs the run's baselines
selection overlap    |S_a ∩ S_b| / K between scorings at K = k, averaged over layers
effective rank       of the selected experts' output Gram, per scoring and K, averaged over layers
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from m2d_ray.config import SweepConfig, load_config
from m2d_ray.run_dir import TEACHER_KEY, RunDir


@dataclass
class RunData:
    """Everything a finished (or partly finished) run directory holds."""

    run_dir: Path
    cfg: SweepConfig
    stage1: list[dict]
    plans: dict[str, dict]
    promotions: dict
    stage2: dict[str, dict] = field(default_factory=dict)  # key -> ledger record
    stage3: dict[str, dict] = field(default_factory=dict)  # key -> lm-eval result ("teacher" included)
    analysis: dict[str, dict] = field(default_factory=dict)  # key -> what the model wrote, by category
    timings: dict = field(default_factory=dict)
    memory_plan: dict | None = None  # RUN_DIR/memory_plan.json: what m2d run planned per device
    teachers: tuple[tuple[str, str], ...] = ()  # the baselines' own teachers: (the table's label, stage 3's key)
    matched: tuple[str, ...] = ()  # the baselines of the matched-parameter table, in its order

    @property
    def k(self) -> int:
        return self.promotions["k"]

    def tasks(self) -> list[str]:
        """Benchmark names in suite order (from the first evaluated model)."""
        for r in self.stage3.values():
            if r.get("tasks"):
                return list(r["tasks"])
        return []


def load_run(run_dir: str | Path, teachers: tuple[tuple[str, str], ...] = (), matched: tuple[str, ...] = ()) -> RunData:
    """A run directory's records; `teachers` and `matched`: what the run's baselines bring (RunData's fields)."""
    rd = RunDir(run_dir)
    promotions = rd.read_promotions()
    return RunData(
        rd.path,
        load_config(rd.config),
        rd.stage1_ledger().records(),
        rd.read_plans()["plans"],
        promotions,
        stage2={r["key"]: r for r in rd.stage2_records()},
        stage3=rd.read_stage3(),
        analysis=rd.read_analysis(),
        timings=rd.stage_times(),
        memory_plan=rd.read_memory_plan(),
        teachers=tuple(teachers),
        matched=tuple(matched),
    )


def distill_rows(data: RunData) -> list[dict]:
    """Promoted pairs in grid order (those of `stage2.pairs` when it names some; named recipes in their order), then
    the baselines, then the teacher (and the baselines' own teachers); accuracies where measured."""
    g, only = data.cfg.grid, data.cfg.stage2.pairs
    rows = []
    named = [tuple(pair.split("/")) for pair in data.promotions.get("order", ())]
    for s, gr in named or [(s, gr) for s in g.scoring for gr in g.grouping]:
        p = data.promotions["pairs"].get(f"{s}/{gr}")
        if p is not None and (not only or f"{s}/{gr}" in only):
            rows.append(
                {
                    "kind": "student",
                    "scoring": s,
                    "grouping": gr,
                    "K": p["K"],
                    "scaling": p["scaling"],
                    "stage1_ppl": p["ppl"],
                    "key": p["key"],
                }
            )
    for b in data.cfg.stage2.baselines:
        rows.append(
            {
                "kind": "baseline",
                "scoring": b,
                "grouping": "",
                "K": None,
                "scaling": "",
                "stage1_ppl": None,
                "key": f"baseline-{b}",
            }
        )
    teachers = [("teacher", TEACHER_KEY), *data.teachers]
    rows += [
        {"kind": "teacher", "scoring": name, "grouping": "", "K": None, "scaling": "", "stage1_ppl": None, "key": key}
        for name, key in teachers
    ]
    for r in rows:
        s2 = data.stage2.get(r["key"], {})
        s3 = data.stage3.get(r["key"], {})
        r.update(
            status=s2.get("status", "-" if r["kind"] == "teacher" else "not distilled"),
            steps=s2.get("steps"),
            val_ppl=s2.get("val_ppl"),
            student_params=s2.get("student_params"),
            teacher_active_params=s2.get("teacher_active_params"),
            tokens_per_s=s2.get("tokens_per_s"),
            acc={t: v.get("score") for t, v in s3.get("tasks", {}).items()},
            mean=s3.get("mean"),
            eval=s3.get("status", "-"),
        )
    return rows


def matched_rows(data: RunData, rows: list[dict]) -> list[dict]:
    """The matched-parameter comparison: the best MoE-to-dense student (highest stage-3 mean accuracy; without
    accuracies, lowest final validation perplexity), then the run's baselines in `data.matched`'s order;
    each with its seconds per training step (tokens per step / the last interval's tokens/s)."""

    def rank(r: dict) -> tuple:
        return (r["mean"] is not None, r["mean"] or 0.0, -(r["val_ppl"] or math.inf))

    students = [r for r in rows if r["kind"] == "student" and r["status"] in ("ok", "pruned")]
    picked = [{**max(students, key=rank), "label": "best MoE-to-dense"}] if students else []
    picked += [
        {**r, "label": r["scoring"]}
        for b in data.matched
        for r in rows
        if r["kind"] == "baseline" and r["scoring"] == b
    ]
    d = data.cfg.distill
    per_step = d.batch_size * d.grad_accum * d.workers * d.seq_len
    for r in picked:
        r["s_per_step"] = per_step / r["tokens_per_s"] if r.get("tokens_per_s") else None
    return picked


def outcome(data: RunData) -> dict:
    """What the run produced, from the driver's records: students by stage-2 status, models evaluated, and the
    analysis' failed models with their errors."""
    rows = [r for r in distill_rows(data) if r["kind"] != "teacher"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "pruned", "failed", "diverged", "not distilled")}
    students = [r for r in rows if r["eval"] != "-"]
    return {
        "students": counts,
        "promoted": sum(r["kind"] == "student" for r in rows),
        "promoted_distilled": sum(r["kind"] == "student" and r["status"] in ("ok", "pruned") for r in rows),
        "evaluated": sum(r["eval"] == "ok" for r in students),
        "eval_failed": sum(r["eval"] == "failed" for r in students),
        "teacher_evaluated": data.stage3.get(TEACHER_KEY, {}).get("status") == "ok",
        "analysis_failed": {k: r.get("error") for k, r in data.analysis.items() if r.get("status") == "failed"},
    }


def outcome_line(o: dict) -> str:
    s = o["students"]
    line = f"students: {s['ok']} ok, {s['pruned']} pruned, {s['failed']} failed, {s['diverged']} diverged"
    if s["not distilled"]:
        line += f", {s['not distilled']} not distilled"
    line += f"; {o['evaluated']} students evaluated" + (
        f", {o['eval_failed']} failed to evaluate" if o["eval_failed"] else ""
    )
    line += "; teacher evaluated" if o["teacher_evaluated"] else ""
    return line + (f"; the analysis failed for {len(o['analysis_failed'])} models" if o["analysis_failed"] else "")


def marginal(rows: list[dict], axis: str, order: tuple[str, ...]) -> dict[str, float]:
    """Mean accuracy per value of `axis` ("scoring" or "grouping") over the students that have one."""
    out = {}
    for v in order:
        accs = [r["mean"] for r in rows if r["kind"] == "student" and r[axis] == v and r["mean"] is not None]
        if accs:
            out[v] = sum(accs) / len(accs)
    return out


def selections(data: RunData, K: int) -> dict[str, dict[str, list[int]]]:
    """scoring -> layer -> selected experts at K (selection does not depend on grouping or scaling)."""
    out: dict[str, dict[str, list[int]]] = {}
    for plan in data.plans.values():
        if plan["K"] == K and plan["scoring"] not in out:
            out[plan["scoring"]] = {i: l["selected"] for i, l in plan["layers"].items()}
    return {s: out[s] for s in data.cfg.grid.scoring if s in out}


def overlap(sel: dict[str, dict[str, list[int]]], K: int) -> dict[str, dict[str, float]]:
    """|S_a ∩ S_b| / K averaged over layers, for every pair of scorings."""
    return {
        a: {b: sum(len(set(sa[i]) & set(sel[b][i])) for i in sa) / (K * len(sa)) for b in sel} for a, sa in sel.items()
    }


def erank_table(data: RunData) -> tuple[list[int], dict[str, dict[int, float]]]:
    """(K values, scoring -> K -> effective rank averaged over layers)."""
    table: dict[str, dict[int, float]] = {}
    for plan in data.plans.values():
        er = [l["erank"] for l in plan["layers"].values()]
        table.setdefault(plan["scoring"], {})[plan["K"]] = sum(er) / len(er)
    Ks = sorted({K for t in table.values() for K in t})
    return Ks, {s: table[s] for s in data.cfg.grid.scoring if s in table}


def val_loss_curves(data: RunData) -> dict[str, list[tuple[int, float]]]:
    """student label -> [(step, validation loss = ln ppl)] from the stage-2 ledger (finite points)."""
    out = {}
    for r in data.stage2.values():
        pts = [(s, math.log(p)) for s, p in r.get("curve", []) if p is not None and p > 0]
        if pts:
            out[r["pair"] if not r.get("baseline") else f"{r['pair']} (baseline)"] = sorted(set(pts))
    return out


def memory_rows(data: RunData) -> list[dict]:
    """Planned bytes per device (RUN_DIR/memory_plan.json) beside the measured peaks: stage 2's largest over
    its students (CUDA allocations on a GPU, else resident memory) and each stage-3 model's."""
    plan = data.memory_plan
    if not plan:
        return []
    rows = []
    for r in plan.get("rows", []):
        name = r["name"]
        if name == "stage2":
            peaks = [_peak(s) for s in data.stage2.values() if not s.get("duplicate_of")]
        elif name.startswith("stage3:"):
            key = name.split(":", 1)[1]
            keys = (
                [k for k, s in data.stage2.items() if s.get("student_path") and not s.get("duplicate_of")]
                if key == "student"
                else [key]
            )
            peaks = [_peak(data.stage3.get(k, {})) for k in keys]
        else:
            peaks = []
        peaks = [p for p in peaks if p]
        measured = max(peaks) if peaks else None
        rows.append(
            {
                "stage": name,
                "unit": r["unit"],
                "planned": r["per_device"],
                "measured": measured,
                "ratio": measured / r["per_device"] if measured and r["per_device"] else None,
                "fits": r["fits"],
            }
        )
    return rows


def cost_rows(data: RunData) -> list[dict]:
    """The plan's bill per stage (RUN_DIR/memory_plan.json) beside the wall time run.json measured for it, in the
    plan's order (its rows'; the JSON objects' keys are sorted). A run of an older m2d timed calibration inside stage 1
    and the targets pass inside stage 2 (their `calibrate_s`, `targets_s`): those are taken apart again."""
    cost = (data.memory_plan or {}).get("cost")
    if not cost:
        return []
    measured: dict[str, float | None] = {}
    for name, t in data.timings.items():
        inner = {"stage1": ("calibrate", "calibrate_s"), "stage2": ("targets", "targets_s")}.get(name)
        if inner and inner[1] in t and inner[0] not in data.timings:  # an older run's layout
            measured[inner[0]] = t[inner[1]]
            measured[name] = t["wall_s"] - t[inner[1]]
        else:
            measured[name] = t.get("wall_s")
    order = list(dict.fromkeys(r["name"].split(":")[0] for r in data.memory_plan.get("rows", [])))
    rows = []
    for name, c in sorted(cost["stages"].items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
        m, est = measured.get(name), c.get("seconds")
        rows.append(
            {
                "stage": name,
                "flops": c["flops"],
                "estimated_s": est,
                "measured_s": m,
                "ratio": m / est if m and est else None,
                "gpu_hours": c.get("gpu_hours"),
                "dollars": c.get("dollars"),
            }
        )
    return rows


def _peak(r: dict) -> int | None:
    """A record's measured peak comparable with the plan: CUDA allocations on a GPU, else the resident memory
    the work added (an older record: the process's whole resident peak)."""
    return r.get("peak_cuda_bytes") or r.get("peak_work_bytes") or r.get("peak_rss_bytes")
