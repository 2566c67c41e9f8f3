"""`m2d report RUN_DIR`: the whole run as RUN_DIR/report/ — index.html, tables (CSV + Markdown), figures (PNG).

    pre-distillation perplexity grid     stage1.csv/.md + stage1_heatmap.png (the paper's layout)
    distillation table                   distill.csv/.md: per pair (K, scaling, stage-1 ppl, val ppl, accuracies, mean)
                                         + baseline and teacher rows (+ the d2d baseline's dense teacher)
    matched parameters                   matched.csv/.md: best MoE-to-dense student vs d2d / random FFN / random init
    D2D candidate search                 d2d_candidates.csv/.md (with the d2d baseline): the paper's D2D table
    marginal effect of each design axis  marginal.png (mean accuracy per scoring and per grouping)
    selection overlap at K = k           overlap.csv/.md + overlap.png
    effective rank per scoring           erank.csv/.md + erank.png
    validation-loss curves               curves.png
"""

from __future__ import annotations

import csv
import html
import io
import time
from pathlib import Path

from m2d_ray.artifacts import atomic_dir, write_text_atomic
from m2d_ray.report.analysis import (RunData, cost_rows, distill_rows, memory_rows, erank_table, load_run, marginal, matched_rows, outcome, outcome_line, overlap,
                                     selections, val_loss_curves)
from m2d_ray.report.figures import pyplot, save
from m2d_ray.report.stage1 import heatmap, write_tables
from m2d_ray.run_dir import STAGE1_HEATMAP, STAGE1_MD, RunDir



class Table:
    """A small table written three ways (CSV for tools, Markdown for READMEs, HTML for the report)."""

    def __init__(self, name: str, headers: list[str], rows: list[list], note: str = "") -> None:
        self.name, self.headers, self.rows, self.note = name, headers, rows, note

    def write(self, out: Path) -> list[Path]:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(self.headers)
        w.writerows([["" if v is None else v for v in r] for r in self.rows])
        md = ["| " + " | ".join(self.headers) + " |", "|" + "---|" * len(self.headers)]
        md += ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in self.rows]
        write_text_atomic(out / f"{self.name}.csv", buf.getvalue())
        write_text_atomic(out / f"{self.name}.md", "\n".join(md + (["", self.note] if self.note else [])) + "\n")
        return [out / f"{self.name}.csv", out / f"{self.name}.md"]

    def html(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(v))}</td>" for v in r) + "</tr>" for r in self.rows)
        note = f'<p class="note">{html.escape(self.note)}</p>' if self.note else ""
        return f'<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}<p class="files">{self.name}.csv · {self.name}.md</p>'


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


# ---- tables ---------------------------------------------------------------------------------------
def distill_table(data: RunData, rows: list[dict]) -> Table:
    from m2d_ray.evaluate.paper_tasks import table_columns

    tasks, columns, mean_col, note = table_columns(data.tasks(), data.cfg.stage3.tasks)  # the paper suite: Wino … MMLU, Avg
    headers = ["scoring", "grouping", "K", "scaling", "stage-1 ppl", "stage 2", "final val ppl", "stage 3", *columns, mean_col]
    body = [[r["scoring"].upper() if r["kind"] == "student" else r["scoring"], r["grouping"].upper(), r["K"], r["scaling"], r["stage1_ppl"],
             r["status"] if r["steps"] is None else f"{r['status']} @ {r['steps']}", r["val_ppl"], r["eval"],
             *[r["acc"].get(t) for t in tasks], r["mean"]] for r in rows]
    suite = data.cfg.stage3.tasks
    return Table("distill", headers, body, f"Accuracy on the stage-3 suite `{suite}` (acc_norm for HellaSwag/ARC, else acc), mean unweighted. "
                 "Students stopped early by ASHA were not exported and have no accuracy." + note)


def memory_table(data: RunData) -> Table:
    rows = memory_rows(data)
    mib = lambda v: None if v is None else round(v / 2**20)  # noqa: E731
    body = [[r["stage"], r["unit"], mib(r["planned"]), mib(r["measured"]), r["ratio"], {True: "yes", False: "NO", None: "?"}[r["fits"]]] for r in rows]
    return Table("memory", ["stage", "unit", "planned MiB per device", "measured peak MiB", "measured / planned", "fits"], body,
                 "m2d run's memory plan (RUN_DIR/memory_plan.json, checked before calibration) beside what the stages measured: "
                 "stage 2 the largest peak over its students, stage 3 each model's: CUDA allocations on a GPU (the plan adds 1 GiB for the CUDA "
                 "context), else the resident memory the work added to its process, which also counts the checkpoint pages transformers keeps mapped.")


def cost_table(data: RunData) -> Table:
    body = [[r["stage"], f"{r['flops']:.3g}", _round(r["estimated_s"]), _round(r["measured_s"]), r["ratio"], r["gpu_hours"], r["dollars"]]
            for r in cost_rows(data)]
    return Table("cost", ["stage", "FLOPs", "estimated s", "measured s", "measured / estimated", "GPU-hours", "dollars"], body,
                 "m2d run's bill (RUN_DIR/memory_plan.json, estimated before calibration from configs: FLOPs / (peak x plan.efficiency or plan.cpu_efficiency) "
                 "+ start-up, dollars from node-hours with the idle tail) beside each stage's measured wall time (RUN_DIR/run.json).")


def _round(v):
    return None if v is None else round(v, 1)


def matched_table(data: RunData, rows: list[dict]) -> Table:
    body = [[r["label"], r["key"], r["student_params"], r["teacher_active_params"], r["s_per_step"], r["tokens_per_s"], r["val_ppl"], r["mean"]]
            for r in matched_rows(data, rows)]
    return Table("matched", ["student", "key", "student params", "teacher active params", "s / training step", "tokens/s",
                             "final val ppl", "stage-3 mean acc"], body,
                 "Every student distilled with the same budget (distill.*); d2d from its dense teacher, the others from the MoE teacher. "
                 "Best MoE-to-dense: highest stage-3 mean accuracy (else lowest final val ppl). Parameters: model.parameters() "
                 "(tied embeddings once); teacher active: all but the experts a token skips. s / step and tokens/s: the last "
                 "validation interval's training time only.")


def d2d_table(data: RunData) -> Table:
    """The D2D candidate search in the paper's layout: one row per pruned shape at the budget, the promoted one marked."""
    rows = (data.d2d or {}).get("rows", [])
    body = [[r["candidate"], r["kind"], r["hidden"], r["ffn"], f"{r['heads']} ({r['kv_heads']})", r["layers"], r["params"],
             f"{r['params_vs_target']:+.2%}", r["ppl"], "yes" if r["best"] else ""] for r in rows]
    d = data.d2d or {}
    note = (f"Minitron pruning of {d.get('teacher')} to {d.get('target', 0):,} parameters (the MoE teacher's K = k student); "
            f"importance on {d.get('calib_tokens', 0):,} tokens of {d.get('calib_data')}, perplexity before distillation on "
            f"{d.get('eval_data')}; the lowest is promoted and distilled.") if rows else ""
    return Table("d2d_candidates", ["candidate", "kind", "d", "FFN", "heads (KV)", "layers", "params", "vs budget", "ppl before distillation",
                                    "promoted"], body, note)


def overlap_table(data: RunData) -> Table:
    ov = overlap(selections(data, data.k), data.k)
    names = list(ov)
    return Table("overlap", ["scoring", *[n.upper() for n in names]], [[a.upper(), *[ov[a][b] for b in names]] for a in names],
                 f"|S_a ∩ S_b| / K at K = k = {data.k}, averaged over layers.")


def erank_tables(data: RunData) -> Table:
    Ks, er = erank_table(data)
    return Table("erank", ["scoring", *[f"K={K}" for K in Ks]], [[s.upper(), *[t.get(K) for K in Ks]] for s, t in er.items()],
                 "Effective rank (Roy & Vetterli) of the selected experts' output Gram, averaged over layers; at most K.")


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
        fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=min(len(refs), 4), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.1 if refs else 0, 1, 1))
    return save(fig, path)


#: (colour, line style) of the marginal figure's reference lines (baselines, then teachers), told apart in its legend
REF_STYLES = [("#c44e52", "-"), ("#dd8452", "--"), ("#55a868", "-."), ("#8172b3", ":"), ("#937860", (0, (5, 1))), ("#da8bc3", (0, (1, 1))),
              ("#8c8c8c", (0, (3, 1, 1, 1)))]


def overlap_figure(t: Table, path: Path) -> Path | None:
    if not t.rows:
        return None
    import numpy as np

    m = np.array([r[1:] for r in t.rows], dtype=float)
    fig, ax = pyplot().subplots(figsize=(1.6 + 0.6 * len(m), 1.2 + 0.5 * len(m)))
    im = ax.imshow(m, vmin=0, vmax=1, cmap="Blues")
    for i in range(len(m)):
        for j in range(len(m)):
            ax.text(j, i, f"{m[i, j]:.2f}", ha="center", va="center", fontsize=7, color="white" if m[i, j] > 0.6 else "black")
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


# ---- the page -------------------------------------------------------------------------------------
CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 7px;text-align:right}
td:first-child,th:first-child{text-align:left}tr:nth-child(even){background:#f7f7f7}
img{max-width:100%;border:1px solid #eee}figure{margin:1em 0}figcaption{color:#444;font-size:13px;max-width:80ch;margin-top:.3em}.note,.files,.meta{color:#666;font-size:12px}"""


def write_report(run_dir: str | Path) -> Path:
    """Write RUN_DIR/report/ (replacing the previous report as a whole) and return the path of its index.html."""
    data = load_run(run_dir)
    with atomic_dir(RunDir(data.run_dir).report, "report", overwrite=True, what="report directory") as out:
        g = data.cfg.grid
        order = {"scoring": list(g.scoring), "grouping": list(g.grouping), "scaling": list(g.scaling)}
        write_tables(data.stage1, order, out)
        rows = distill_rows(data)
        tables = {"distill": distill_table(data, rows), "matched": matched_table(data, rows), "d2d": d2d_table(data),
                  "overlap": overlap_table(data), "erank": erank_tables(data), "memory": memory_table(data),
                  "cost": cost_table(data)}
        for name, t in tables.items():
            if t.rows or name not in ("d2d", "memory", "cost"):  # the candidate table only with the d2d baseline, the memory one with a plan
                t.write(out)
        figs = {
            "grid": heatmap(data.stage1, order, out / STAGE1_HEATMAP, title=f"stage 1: pre-distillation perplexity, k={data.k}"),
            "marginal": marginal_figure(data, rows, out / "marginal.png"),
            "overlap": overlap_figure(tables["overlap"], out / "overlap.png"),
            "erank": erank_figure(data, out / "erank.png"),
            "curves": curves_figure(data, out / "curves.png"),
        }
        write_text_atomic(out / "index.html", _page(data, tables, figs, (out / STAGE1_MD).read_text()))
    return RunDir(data.run_dir).report / "index.html"


def _img(path: Path | None, alt: str) -> str:
    """A figure with its caption (CAPTIONS[alt]: what to read from it), or a note when it has no data yet."""
    if not path:
        return f'<p class="note">no data yet for: {html.escape(alt)}</p>'
    return f'<figure><img src="{path.name}" alt="{html.escape(alt)}"><figcaption>{html.escape(CAPTIONS[alt])}</figcaption></figure>'


#: each figure's caption: what it shows and what to read from it
CAPTIONS = {
    "perplexity grid": "Pre-distillation perplexity of every recipe (rows: scoring · grouping · scaling; columns: experts kept K), "
                       "colour on a log scale, darker is better. Read across a row for the cost of keeping fewer experts, down a column "
                       "for the best recipe at a given K. Hatched cells marked \"partial\" were pruned early: the number is the partial "
                       "perplexity (first evaluation chunk(s)) they were stopped at, not comparable to a full one; grey cells diverged or failed.",
    "marginal effect of scoring and grouping": "Mean stage-3 accuracy of the distilled students, averaged per scoring method (left) and per "
                       "grouping method (right); the lines are the baselines and teachers, named in the legend with their accuracy. "
                       "A bar above the baselines means that design choice pays off after distillation.",
    "validation-loss curves": "Validation loss (nats/token) of each student during distillation, baselines dashed. Lower is better; "
                       "a curve that stops early was pruned by ASHA; curves still falling at the end would gain from more steps.",
    "overlap matrix": "Fraction of selected experts two scoring methods share at K = k, averaged over layers: 1 means they keep the same "
                       "experts (same student before grouping), low values mean the scorings disagree on what matters.",
    "effective rank per scoring": "Effective rank of the selected experts' outputs against K (dotted: the bound K). Higher means the kept "
                       "experts are more diverse, i.e. less redundant, for the same number kept.",
}


def _page(data: RunData, tables: dict[str, Table], figs: dict[str, Path | None], stage1_md: str) -> str:
    cfg, p = data.cfg, data.promotions
    timing = " · ".join(f"{k} {v['wall_s']:.0f} s" for k, v in data.timings.items() if "wall_s" in v)
    stage1 = _md_table_html(stage1_md)
    sections = [
        ("Stage 1: pre-distillation perplexity", f"<p class='meta'>{html.escape(p['criterion'])}</p>{stage1}{_img(figs['grid'], 'perplexity grid')}"),
        ("Stage 2 + 3: distilled students", tables["distill"].html() + _img(figs["marginal"], "marginal effect of scoring and grouping")),
        ("Matched parameters: MoE-to-dense against the baselines", tables["matched"].html()),
        *([("Dense-to-dense (Minitron) candidate search", tables["d2d"].html())] if tables["d2d"].rows else []),
        ("Validation loss during distillation", _img(figs["curves"], "validation-loss curves")),
        (f"Selection overlap between scorings at K = k = {data.k}", tables["overlap"].html() + _img(figs["overlap"], "overlap matrix")),
        ("Effective rank of the selected experts", tables["erank"].html() + _img(figs["erank"], "effective rank per scoring")),
        *([("Memory: planned against measured", tables["memory"].html())] if tables["memory"].rows else []),
        *([("Time and money: estimated against measured", tables["cost"].html())] if tables["cost"].rows else []),
    ]
    body = "".join(f"<h2>{html.escape(title)}</h2>{content}" for title, content in sections)
    meta = (f"teacher <code>{html.escape(str(p['teacher']))}</code> · k = {p['k']}, E = {p['E']} · config <code>{html.escape(cfg.name)}</code> · "
            f"{len(data.stage1)} stage-1 configs · {html.escape(outcome_line(outcome(data)))}"
            + (f" · {timing}" if timing else "") + f" · written {time.strftime('%Y-%m-%d %H:%M')}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>m2d report: {html.escape(cfg.name)}</title><style>{CSS}</style></head>"
            f"<body><h1>MoE → dense: {html.escape(cfg.name)}</h1><p class='meta'>{meta}</p>{body}</body></html>")


def _md_table_html(md: str) -> str:
    """The stage-1 Markdown table as HTML (one source for both)."""
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    note = next((ln for ln in md.splitlines() if ln and not ln.startswith("|")), "")
    return Table("stage1", rows[0], rows[2:], note).html() if rows else ""
