"""Save a pruned student natively and prove it reloads as asked before the directory appears.

OUT holds the model (`save_pretrained`, the teacher's class: `AutoModelForCausalLM.from_pretrained(OUT)`),
the tokenizer, `importance.safetensors` (the float64 importance it was pruned by), `m2d_prune.json`
(teacher, sizes, parameters, the importance definitions, calibration, perplexity) and, after a search,
`candidates.csv` / `candidates.md` (the D2D candidate table). Written atomically as an m2d "pruned" output.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoModelForCausalLM

from m2d_ray.arch.dense import DenseSizes, get_dense_adapter
from m2d_ray.artifacts import atomic_dir
from m2d_ray.prune.importance import Importance

if TYPE_CHECKING:
    from transformers import PreTrainedModel

INFO_FILE = "m2d_prune.json"
IMPORTANCE_FILE = "importance.safetensors"
TABLE_COLUMNS = (
    "candidate",
    "kind",
    "hidden",
    "ffn",
    "heads",
    "kv_heads",
    "layers",
    "params",
    "params_vs_target",
    "ppl",
    "best",
)


def candidates_table(rows: list[dict]) -> tuple[str, str]:
    """(CSV, Markdown) of the candidate rows: one per shape, the promoted one marked."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, TABLE_COLUMNS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    fmt = {"params": "{:,}", "params_vs_target": "{:+.2%}", "ppl": "{:.3f}"}

    def cell(k, v):
        return "--" if v is None else ("**yes**" if v is True else "" if v is False else fmt.get(k, "{}").format(v))

    md = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    md += ["| " + " | ".join(cell(k, r.get(k)) for k in TABLE_COLUMNS) + " |" for r in rows]
    return buf.getvalue(), "\n".join(md) + "\n"


def check_reloaded(path: Path, model: PreTrainedModel, sizes: DenseSizes) -> None:
    """The saved model reloads natively as the same class, at `sizes`, with every tensor bit for bit."""
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=next(model.parameters()).dtype)
    if type(reloaded) is not type(model):
        raise RuntimeError(f"reloaded as {type(reloaded).__name__}, expected {type(model).__name__}")
    got = get_dense_adapter(reloaded.config).sizes(reloaded.config)
    if got != sizes:
        raise RuntimeError(f"reloaded at sizes {got}, expected {sizes}")
    want = model.state_dict()
    new = reloaded.state_dict()
    differ = [k for k in want if k not in new or not torch.equal(new[k], want[k].to(new[k].device))]
    if differ or new.keys() != want.keys():
        raise RuntimeError(
            f"reloaded model differs from the pruned model in {(differ or sorted(new.keys() ^ want.keys()))[:3]}"
        )


def export_pruned(
    model: PreTrainedModel,
    tokenizer,
    out: str | Path,
    sizes: DenseSizes,
    importance: Importance,
    info: dict,
    rows: list[dict] | None = None,
    overwrite: bool = False,
) -> None:
    with atomic_dir(out, "pruned", overwrite) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        check_reloaded(tmp, model, sizes)
        importance.save(tmp / IMPORTANCE_FILE)
        if rows:
            table_csv, table_md = candidates_table(rows)
            (tmp / "candidates.csv").write_text(table_csv)
            (tmp / "candidates.md").write_text(table_md)
        (tmp / INFO_FILE).write_text(json.dumps({**info, "candidates": rows}, indent=1))
