"""The run directory's trial ledger: one JSON file per finished config, written atomically.

The ledger, not Tune's experiment state, is the source of truth for resume: a file exists only once
the trial's result is complete, so after a SIGKILL every config with a file is done and every other
config is run again. Tune only executes; MLflow is reconciled from the ledger.
"""

from __future__ import annotations

import json
from pathlib import Path

from m2d_ray.artifacts import write_json_atomic

#: trial outcomes: ok (full perplexity), pruned (early-stopped), diverged (NaN/inf), failed (raised)
STATUSES = ("ok", "pruned", "diverged", "failed")


class Ledger:
    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir) / "trials"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def done(self) -> set[str]:
        return {p.stem for p in self.dir.glob("*.json")}

    def write(self, record: dict) -> None:
        assert record["status"] in STATUSES, record["status"]
        write_json_atomic(self.path(record["key"]), record)

    def read(self, key: str) -> dict:
        return json.loads(self.path(key).read_text())

    def records(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.dir.glob("*.json"))]
