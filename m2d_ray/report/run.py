"""The numbers of a run as the report shows them: its tables and figures, built from a run directory's records
(`analysis.RunData`). The stages choose which go into their sections (`Stage.sections`); `page.py` writes them.

    distillation table                   distill.csv/.md: per pair (K, scaling, stage-1 ppl, val ppl, accuracies, mean)
                                         + baseline and teacher rows (+ the baselines' own teachers)
    matched parameters                   matched.csv/.md: best MoE-to-dense student vs the baselines
    marginal effect of each design axis  marginal.png (mean accuracy per scoring and per grouping)
    selection overlap at K = k           overlap.csv/.md + overlap.png
    effective rank per scoring           erank.csv/.md + erank.png
    validation-loss curves               curves.png
    memory and time                      memory.csv/.md, cost.csv/.md: the plan beside what the run measured
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from m2d_ray.evaluate.paper_tasks import table_columns
from m2d_ray.report.analysis import (
    RunData,
    cost_rows,
    erank_table,
    marginal,
    matched_rows,
    memory_rows,
    overlap,
    selections,
    val_loss_curves,
)
from m2d_ray.report.figures import pyplot, save
from m2d_ray.report.page import Figure, Table


# ---- tables ---------------------------------------------------------------------------------------
def distill_table(data: RunData, rows: list[dict]) -> Table:

    tasks, columns, mean_col, note = table_columns(
        data.tasks(), data.cfg.stage3.tasks
    )  # the paper suite: Wino … MMLU, Avg
    headers = [
        "scoring",
        "grouping",
        "K",
        "scaling",
        "stage-1 ppl",
        "stage 2",
        "final val ppl",
        "stage 3",
        *columns,
        mean_col,
    ]
    body = [
        [
            r["scoring"].upper() if r["kind"] == "student" else r["scoring"],
            r["grouping"].upper(),
            r["K"],
            r["scaling"],
            r["stage1_ppl"],
            r["status"] if r["steps"] is None else f"{r['status']} @ {r['steps']}",
            r["val_ppl"],
            r["eval"],
            *[r["acc"].get(t) for t in tasks],
            r["mean"],
        ]
        for r in rows
    ]
    suite = data.cfg.stage3.tasks
    return Table(
        "distill",
        headers,
        body,
        f"Accuracy on the stage-3 suite `{suite}` (acc_norm for HellaSwag/ARC, else acc), mean unweighted. "
        "Students stopped early by ASHA were not exported and have no accuracy." + note,
    )


def memory_table(data: RunData) -> Table:
    rows = memory_rows(data)

    def mib(v):
        return None if v is None else round(v / 2**20)

    body = [
        [
            r["stage"],
            r["unit"],
            mib(r["planned"]),
            mib(r["measured"]),
            r["ratio"],
            {True: "yes", False: "NO", None: "?"}[r["fits"]],
        ]
        for r in rows
    ]
    return Table(
        "memory",
        ["stage", "unit", "planned MiB per device", "measured peak MiB", "measured / planned", "fits"],
        body,
        "m2d run's memory plan (RUN_DIR/memory_plan.json, checked before calibration) beside what the stages measured: "
        "stage 2 the largest peak over its students, stage 3 each model's: CUDA allocations on a GPU (the plan adds 1 "
        "GiB for the CUDA "
        "context), else the resident memory the work added to its process, which also counts the checkpoint pages "
        "transformers keeps mapped.",
    )


def cost_table(data: RunData) -> Table:
    body = [
        [
            r["stage"],
            f"{r['flops']:.3g}",
            _round(r["estimated_s"]),
            _round(r["measured_s"]),
            r["ratio"],
            r["gpu_hours"],
            r["dollars"],
        ]
        for r in cost_rows(data)
    ]
    return Table(
        "cost",
        ["stage", "FLOPs", "estimated s", "measured s", "measured / estimated", "GPU-hours", "dollars"],
        body,
        "m2d run's bill (RUN_DIR/memory_plan.json, estimated before calibration from configs: FLOPs / (peak x "
        "plan.efficiency or plan.cpu_efficiency) "
        "+ start-up, dollars from node-hours with the idle tail) beside each stage's measured wall time "
        "(RUN_DIR/run.json).",
    )


def _round(v):
    return None if v is None else round(v, 1)


def matched_table(data: RunData, rows: list[dict]) -> Table:
    body = [
        [
            r["label"],
            r["key"],
            r["student_params"],
            r["teacher_active_params"],
            r["s_per_step"],
            r["tokens_per_s"],
            r["val_ppl"],
            r["mean"],
        ]
        for r in matched_rows(data, rows)
    ]
    own = "".join(
        f"{key.split('-', 1)[1]} from its {label}, " for label, key in data.teachers
    )  # baselines with their own teacher
    return Table(
        "matched",
        [
            "student",
            "key",
            "student params",
            "teacher active params",
            "s / training step",
            "tokens/s",
            "final val ppl",
            "stage-3 mean acc",
        ],
        body,
        f"Every student distilled with the same budget (distill.*); {own}{'the others' if own else 'all'} from the MoE "
        "teacher. "
        "Best MoE-to-dense: highest stage-3 mean accuracy (else lowest final val ppl). Parameters: model.parameters() "
        "(tied embeddings once); teacher active: all but the experts a token skips. s / step and tokens/s: the last "
        "validation interval's training time only.",
    )


def overlap_table(data: RunData) -> Table:
    ov = overlap(selections(data, data.k), data.k)
    names = list(ov)
    return Table(
        "overlap",
        ["scoring", *[n.upper() for n in names]],
        [[a.upper(), *[ov[a][b] for b in names]] for a in names],
        f"|S_a ∩ S_b| / K at K = k = {data.k}, averaged over layers.",
    )


def erank_tables(data: RunData) -> Table:
    Ks, er = erank_table(data)
    return Table(
        "erank",
        ["scoring", *[f"K={K}" for K in Ks]],
        [[s.upper(), *[t.get(K) for K in Ks]] for s, t in er.items()],
        "Effective rank (Roy & Vetterli) of the selected experts' output Gram, averaged over layers; at most K.",
    )


# ---- figures --------------------------------------------------------------------------------------
def marginal_figure(data: RunData, rows: list[dict], path: Path) -> Path | None:
    g = data.cfg.grid
    panels = [("scoring", marginal(rows, "scoring", g.scoring)), ("grouping", marginal(rows, "grouping", g.grouping))]
    if not any(v for _, v in panels):
        return None
    refs = {r["scoring"]: r["mean"] for r in rows if r["kind"] != "student" and r["mean"] is not None}
    fig, axes = pyplot().subplots(1, 2, figsize=(9, 3.8), sharey=True)
    for ax, (axis, vals) in zip(axes, panels):
        bars = ax.bar([v.upper() for v in vals], list(vals.values()), color="#4c72b0")
        ax.bar_label(bars, fmt="%.3f", fontsize=7)  # the differences are small next to the baselines
        for i, (name, acc) in enumerate(refs.items()):  # named in one legend: labels at close values would overprint
            color, dash = REF_STYLES[i % len(REF_STYLES)]
            ax.axhline(acc, linestyle=dash, linewidth=1.2, color=color, label=f"{name} {acc:.3f}")
        ax.set_title(f"mean accuracy per {axis}", fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].set_ylabel("mean accuracy")
    if refs:
        fig.legend(
            *axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(refs), 4), fontsize=7, frameon=False
        )
    fig.tight_layout(rect=(0, 0.1 if refs else 0, 1, 1))
    return save(fig, path)


#: (colour, line style) of the marginal figure's reference lines (baselines, then teachers), told apart in its legend
REF_STYLES = [
    ("#c44e52", "-"),
    ("#dd8452", "--"),
    ("#55a868", "-."),
    ("#8172b3", ":"),
    ("#937860", (0, (5, 1))),
    ("#da8bc3", (0, (1, 1))),
    ("#8c8c8c", (0, (3, 1, 1, 1))),
]


def overlap_figure(t: Table, path: Path) -> Path | None:
    if not t.rows:
        return None

    m = np.array([r[1:] for r in t.rows], dtype=float)
    fig, ax = pyplot().subplots(figsize=(1.6 + 0.6 * len(m), 1.2 + 0.5 * len(m)))
    im = ax.imshow(m, vmin=0, vmax=1, cmap="Blues")
    for i in range(len(m)):
        for j in range(len(m)):
            ax.text(
                j,
                i,
                f"{m[i, j]:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if m[i, j] > 0.6 else "black",
            )
    labels = [r[0] for r in t.rows]
    ax.set_xticks(range(len(m)), labels, fontsize=7, rotation=45)
    ax.set_yticks(range(len(m)), labels, fontsize=7)
    ax.set_title(t.note.split(",")[0], fontsize=8)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    return save(fig, path)


def erank_figure(data: RunData, path: Path) -> Path:
    Ks, er = erank_table(data)
    fig, ax = pyplot().subplots(figsize=(5.6, 3.6))
    ax.plot(Ks, Ks, color="#bbbbbb", linestyle=":", label="K (upper bound)")
    for s, t in er.items():
        ax.plot(Ks, [t.get(K) for K in Ks], marker="o", label=s.upper())
    ax.set_xscale("log", base=2)
    ax.set_xticks(Ks, [str(K) for K in Ks])
    ax.set_xlabel("experts kept K")
    ax.set_ylabel("effective rank of the selection")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return save(fig, path)


def curves_figure(data: RunData, path: Path) -> Path | None:
    curves = val_loss_curves(data)
    if not curves:
        return None
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0))
    for label, pts in curves.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker=".", linestyle="--" if "baseline" in label else "-", label=label)
    ax.set_xlabel("distillation step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return save(fig, path)


#: each figure's caption: what it shows and what to read from it
CAPTIONS = {
    "perplexity grid": "Pre-distillation perplexity of every recipe (rows: scoring · grouping · scaling; columns: "
    "experts kept K), "
    "colour on a log scale, darker is better. Read across a row for the cost of keeping fewer experts, down a column "
    'for the best recipe at a given K. Hatched cells marked "partial" were pruned early: the number is the partial '
    "perplexity (first evaluation chunk(s)) they were stopped at, not comparable to a full one; grey cells diverged or "
    "failed.",
    "marginal effect of scoring and grouping": "Mean stage-3 accuracy of the distilled students, averaged per scoring "
    "method (left) and per "
    "grouping method (right); the lines are the baselines and teachers, named in the legend with their accuracy. "
    "A bar above the baselines means that design choice pays off after distillation.",
    "validation-loss curves": "Validation loss (nats/token) of each student during distillation, baselines dashed. "
    "Lower is better; "
    "a curve that stops early was pruned by ASHA; curves still falling at the end would gain from more steps.",
    "overlap matrix": "Fraction of selected experts two scoring methods share at K = k, averaged over layers: 1 means "
    "they keep the same "
    "experts (same student before grouping), low values mean the scorings disagree on what matters.",
    "effective rank per scoring": "Effective rank of the selected experts' outputs against K (dotted: the bound K). "
    "Higher means the kept "
    "experts are more diverse, i.e. less redundant, for the same number kept.",
}


def figure(file: str, alt: str, draw) -> Figure:
    """A report figure with its caption (CAPTIONS[alt])."""
    return Figure(file, alt, CAPTIONS[alt], draw)
