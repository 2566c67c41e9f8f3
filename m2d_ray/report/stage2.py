"""The stage-2 table (one row per distilled student) and its validation-perplexity curves."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from m2d_ray.artifacts import write_text_atomic
from m2d_ray.report.figures import pyplot, save
from m2d_ray.run_dir import RunDir

COLUMNS = (
    "key",
    "pair",
    "baseline",
    "stage1_ppl",
    "status",
    "steps",
    "val_ppl_initial",
    "val_ppl",
    "best_val_ppl",
    "tokens_per_s",
    "student_path",
    "targets",
    "duplicate_of",
    "peak_rss_bytes",
    "peak_cuda_bytes",
)
NOTE = "`pruned`: stopped early by ASHA on validation loss; `--`: diverged (NaN/inf)."


def _fmt(v, spec: str = "{:,.2f}") -> str:
    return "" if v is None else spec.format(v) if isinstance(v, (int, float)) else str(v)


def _targets(r: dict) -> str:
    """The targets mode, and the student it shares when a promotion repeated another's plan."""
    mode = r.get("targets") or ""
    return f"{mode} (= {r['duplicate_of']})" if r.get("duplicate_of") else mode


def write_stage2(records: list[dict], order: list[str], run_dir: str | Path) -> list[Path]:
    """The run's stage-2 table (CSV, Markdown) and curves, rows in `order` (promotion order, then baselines)."""
    rd = RunDir(run_dir)
    pos = {k: i for i, k in enumerate(order)}
    rows = sorted(records, key=lambda r: pos.get(r["key"], len(pos)))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(COLUMNS)
    for r in rows:
        w.writerow([r.get(c) if r.get(c) is not None else "" for c in COLUMNS])
    md = [
        "| student | stage-1 ppl | status | steps | val ppl at start | final val ppl | best val ppl | tok/s | targets "
        "| peak RSS / rank (MB) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        final = "--" if r["status"] == "diverged" else _fmt(r.get("val_ppl"))
        md.append(
            f"| {r['pair']} ({r['key']}) | {_fmt(r.get('stage1_ppl'), '{:,.1f}')} | {r['status']} | "
            f"{_fmt(r.get('steps'), '{}')} | "
            f"{_fmt(r.get('val_ppl_initial'))} | {final} | {_fmt(r.get('best_val_ppl'))} | "
            f"{_fmt(r.get('tokens_per_s'), '{:,.0f}')} | "
            f"{_targets(r)} | {_fmt(r['peak_rss_bytes'] / 1e6 if r.get('peak_rss_bytes') else None, '{:,.0f}')} |"
        )
    md += ["", NOTE]
    write_text_atomic(rd.stage2_csv, buf.getvalue())
    write_text_atomic(rd.stage2_md, "\n".join(md) + "\n")
    return [rd.stage2_csv, rd.stage2_md, curves(rows, rd.stage2_curves)]


def curves(records: list[dict], path: Path) -> Path:
    """Validation perplexity against training step, one line per student (log scale)."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.0))
    for r in records:
        pts = [(s, p) for s, p in r.get("curve", []) if p is not None]
        if pts:
            xs, ys = zip(*sorted(set(pts)))
            ax.plot(xs, ys, marker=".", linestyle="--" if r.get("baseline") else "-", label=r["pair"])
    ax.set_yscale("log")
    ax.set_xlabel("distillation step")
    ax.set_ylabel("validation perplexity")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    return save(fig, path)
