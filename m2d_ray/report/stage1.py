"""The stage-1 table in the paper's layout (rows scoring x grouping x scaling, columns K) and a heatmap."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import numpy as np

from m2d_ray.artifacts import write_text_atomic
from m2d_ray.report.figures import pyplot, save
from m2d_ray.run_dir import STAGE1_CSV, STAGE1_MD

# Imported inside functions: matplotlib (only where a figure is drawn).

#: how a non-ok cell reads in the table ("--" is the paper's mark for numerical instability)
MARKS = {"diverged": "--", "pruned": "pruned", "failed": "failed"}


def table(records: list[dict], order: dict[str, list]) -> tuple[list[int], list[tuple[str, str, str, dict[int, dict]]]]:
    """(K columns, rows) with rows in the grid's order; `order` maps scoring/grouping/scaling/K to lists."""
    by_row: dict[tuple[str, str, str], dict[int, dict]] = {}
    for r in records:
        by_row.setdefault((r["scoring"], r["grouping"], r["scaling"]), {})[r["K"]] = r
    pos = {axis: {v: i for i, v in enumerate(vals)} for axis, vals in order.items()}
    keys = sorted(
        by_row,
        key=lambda t: (pos["scoring"].get(t[0], 99), pos["grouping"].get(t[1], 99), pos["scaling"].get(t[2], 99)),
    )
    Ks = sorted({r["K"] for r in records})
    return Ks, [(*t, by_row[t]) for t in keys]


def cell(r: dict | None, fmt: str = "{:.2f}", marks: dict[str, str] = MARKS) -> str:
    if r is None:
        return ""
    if r["status"] == "ok":
        return fmt.format(r["ppl"])
    return marks.get(r["status"], r["status"])


def write_tables(records: list[dict], order: dict[str, list], out_dir: str | Path) -> list[Path]:
    """The table as CSV and Markdown in `out_dir` (the run directory, or its report; atomic writes); returns the
    paths."""
    Ks, rows = table(records, order)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["scoring", "grouping", "scaling", *[f"K={K}" for K in Ks]])
    for s, g, c, cells in rows:
        w.writerow([s, g, c, *[cell(cells.get(K), "{:.6g}", {}) for K in Ks]])
    md = [
        "| scoring | grouping | scaling | " + " | ".join(f"K={K}" for K in Ks) + " |",
        "|---|---|---|" + "---:|" * len(Ks),
    ]
    for s, g, c, cells in rows:
        md.append(
            f"| {s.upper()} | {g.upper()} | {c} | " + " | ".join(cell(cells.get(K), "{:,.1f}") for K in Ks) + " |"
        )
    md.append("")
    md.append(
        "Pre-distillation perplexity. `--` diverged (NaN/inf), `pruned` stopped early (far worse than its pair's best)."
    )
    csv_path, md_path = Path(out_dir) / STAGE1_CSV, Path(out_dir) / STAGE1_MD
    write_text_atomic(csv_path, buf.getvalue())
    write_text_atomic(md_path, "\n".join(md) + "\n")
    return [csv_path, md_path]


def partial_ppl(r: dict | None) -> float | None:
    """A pruned config's last measured partial perplexity (the probe's first chunk, or further), else None."""
    if r is None or r["status"] != "pruned":
        return None
    pts = [p for _, p in r.get("partials") or [] if p is not None and math.isfinite(p)]
    return pts[-1] if pts else None


def heatmap(
    records: list[dict], order: dict[str, list], path: str | Path, title: str = "stage 1: pre-distillation perplexity"
) -> Path:
    """log10 perplexity per row x K; a pruned cell is coloured and labelled by the partial perplexity it was
    stopped at, hatched and marked "partial"; diverged / failed cells are grey and labelled."""
    from matplotlib.patches import Rectangle

    plt = pyplot()

    Ks, rows = table(records, order)
    vals = np.full((len(rows), len(Ks)), np.nan)
    partial = np.zeros_like(vals, dtype=bool)
    for i, (_, _, _, cells) in enumerate(rows):
        for j, K in enumerate(Ks):
            r = cells.get(K)
            p = partial_ppl(r)
            if r is not None and r["status"] == "ok" and math.isfinite(r["ppl"]):
                vals[i, j] = math.log10(r["ppl"])
            elif p is not None and p > 0:
                vals[i, j], partial[i, j] = math.log10(p), True
    fig, ax = plt.subplots(figsize=(2.6 + 1.0 * len(Ks), 1.3 + 0.24 * len(rows)))
    cmap = plt.get_cmap("viridis_r")
    cmap = cmap.with_extremes(bad="#cccccc")
    im = ax.imshow(np.ma.masked_invalid(vals), aspect="auto", cmap=cmap)
    lo, hi = (np.nanmin(vals), np.nanmax(vals)) if np.isfinite(vals).any() else (0.0, 1.0)
    for i, (_, _, _, cells) in enumerate(rows):
        for j, K in enumerate(Ks):
            v = vals[i, j]
            dark = np.isfinite(v) and (v - lo) > 0.6 * (hi - lo)
            text = f"{10**v:.0f} partial" if partial[i, j] else cell(cells.get(K), "{:.0f}")
            if partial[i, j]:
                ax.add_patch(
                    Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#ffffff88", linewidth=0)
                )
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                fontsize=6,
                color="white" if dark else "black",
                fontstyle="italic" if partial[i, j] else "normal",
            )
    ax.set_xticks(range(len(Ks)), [f"K={K}" for K in Ks])
    ax.set_yticks(range(len(rows)), [f"{s}·{g}·{c}" for s, g, c, _ in rows], fontsize=6)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="log10 perplexity")
    fig.tight_layout()
    return save(fig, path)
