"""The report's page: tables written three ways, figures with their captions, and RUN_DIR/report/index.html made
of the sections the stages add (`Stage.sections`), in the pipeline's order.

A section renders itself into the report directory (`render(parts)`: its tables as CSV + Markdown, its figures as
PNG) and gives its HTML; `write_page` writes the whole report aside and swaps it in.
"""

from __future__ import annotations

import csv
import html
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from m2d_ray.artifacts import atomic_dir, write_text_atomic


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
        md += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in self.rows]
        write_text_atomic(out / f"{self.name}.csv", buf.getvalue())
        write_text_atomic(out / f"{self.name}.md", "\n".join(md + (["", self.note] if self.note else [])) + "\n")
        return [out / f"{self.name}.csv", out / f"{self.name}.md"]

    def html(self) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in self.headers)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(v))}</td>" for v in r) + "</tr>" for r in self.rows)
        note = f'<p class="note">{html.escape(self.note)}</p>' if self.note else ""
        files = f'<p class="files">{self.name}.csv · {self.name}.md</p>'
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}{files}"


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3f}"
    return str(v)


@dataclass(frozen=True)
class Figure:
    """A figure drawn into the report directory as `file` (`draw(path)`: None when there is no data yet), with the
    caption that says what to read from it."""

    file: str
    alt: str
    caption: str
    draw: Callable[[Path], Path | None]


Part = Table | Figure | str | Callable[[Path], str]


def render(parts: Sequence[Part]) -> Callable[[Path], str]:
    """A section's renderer: writes its tables and figures into the report directory and returns their HTML (a
    `str` part is HTML as it is; a callable writes what it needs into the directory and gives its HTML)."""

    def into(out: Path) -> str:
        return "".join(_part(p, out) for p in parts)

    return into


def _part(p: Part, out: Path) -> str:
    if isinstance(p, Table):
        p.write(out)
        return p.html()
    if isinstance(p, Figure):
        path = p.draw(out / p.file)
        if not path:
            return f'<p class="note">no data yet for: {html.escape(p.alt)}</p>'
        caption = f"<figcaption>{html.escape(p.caption)}</figcaption>"
        return f'<figure><img src="{path.name}" alt="{html.escape(p.alt)}">{caption}</figure>'
    return p if isinstance(p, str) else p(out)


def md_table_html(md: str, name: str) -> str:
    """A Markdown table (the stage-1 table's file) as HTML: one source for both."""
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    note = next((ln for ln in md.splitlines() if ln and not ln.startswith("|")), "")
    return Table(name, rows[0], rows[2:], note).html() if rows else ""


CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px
7px;text-align:right}
td:first-child,th:first-child{text-align:left}tr:nth-child(even){background:#f7f7f7}
img{max-width:100%;border:1px solid #eee}figure{margin:1em
0}figcaption{color:#444;font-size:13px;max-width:80ch;margin-top:.3em}.note,.files,.meta{color:#666;font-size:12px}"""


def write_page(report: Path, title: str, meta: str, sections: Sequence) -> Path:
    """RUN_DIR/report/ (`report`) with every section rendered into it, replacing the previous report as a whole;
    returns its index.html. `meta`: the line under the title (HTML)."""
    with atomic_dir(report, "report", overwrite=True, what="report directory") as out:
        body = "".join(f"<h2>{html.escape(s.title)}</h2>{s.render(out)}" for s in sections)
        page = (
            "<!doctype html><html><head><meta charset='utf-8'><title>m2d report: "
            f"{html.escape(title)}</title><style>{CSS}</style></head>"
            f"<body><h1>MoE → dense: {html.escape(title)}</h1><p class='meta'>{meta} · written "
            f"{time.strftime('%Y-%m-%d %H:%M')}</p>"
            f"{body}</body></html>"
        )
        write_text_atomic(out / "index.html", page)
    return report / "index.html"
