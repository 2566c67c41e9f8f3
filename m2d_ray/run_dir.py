"""The run directory on the driver: the one owner of its file names, and the readers of what is in it.

    RUN_DIR/
      m2d_output.json  config.yaml  sweep.json (id, attempts)  run.json (stage wall times)
      memory_plan.json (m2d run's plan: every stage's bytes per device, checked before calibration)
      stats/           the statistics artifact                 plans.json  probes.json  promotions.json
      trials/          stage-1 ledger                          stage1.csv  stage1.md  stage1_heatmap.png
      stage2/          config.yaml  trials/ (ledger)  <baseline>/ (a baseline's records: d2d's search)
      stage2.csv  stage2.md  stage2_curves.png
      stage3/          suite.json  results/<key>.json
      analysis/        settings.json (the questions and sampling a started analysis keeps)  judge.json (name, prompt)
                       results/<key>.json (a model's category counts)  responses/<key>.jsonl (its classified answers)
      report/  logs/  mlflow.db  mlartifacts/

Only the driver touches it; what Ray workers read or write lives in the run's storage (runtime.run_storage).
A ledger, not Tune's experiment state, is the source of truth for resume: a record file exists only once
its trial's result is complete, so after a SIGKILL every key with a file is done and every other is run again.
"""

from __future__ import annotations

import json
from pathlib import Path

from m2d_ray.artifacts import output_kind, write_json_atomic
from m2d_ray.errors import M2DError

#: trial outcomes: ok (finished), pruned (early-stopped), diverged (NaN/inf), failed (raised)
STATUSES = ("ok", "pruned", "diverged", "failed")
TEACHER_KEY = "teacher"  # stage 3's key of the MoE teacher (the table's reference row); a baseline's own: teacher-NAME
STAGE1_CSV, STAGE1_MD, STAGE1_HEATMAP = (
    "stage1.csv",
    "stage1.md",
    "stage1_heatmap.png",
)  # in the run directory and its report


class Ledger:
    """One JSON file per finished key, written atomically."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
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


class RunDir:
    """Paths and readers of one run directory (`RunDir(path)`; nothing is created until written)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()

    def __str__(self) -> str:
        return str(self.path)

    # ---- the run ---------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        """config.yaml: the run's config as it started (a resume reads it, overrides on top)."""
        return self.path / "config.yaml"

    @property
    def state(self) -> Path:
        """sweep.json: the run's id (its MLflow parent) and stage-1 attempts."""
        return self.path / "sweep.json"

    @property
    def timings(self) -> Path:
        """run.json: each stage's wall time (m2d run), with its calibration or targets pass, summed over resumes."""
        return self.path / "run.json"

    @property
    def logs(self) -> Path:
        """logs/: each command's log (Ray, Tune, MLflow, DeepSpeed, transformers, lm-eval and the workers' output)."""
        return self.path / "logs"

    @property
    def report(self) -> Path:
        """report/: index.html, every table as CSV and Markdown, every figure as PNG (rewritten as a whole)."""
        return self.path / "report"

    @property
    def mlflow_db(self) -> Path:
        """mlflow.db: the run's MLflow store when no tracking server is given (sqlite)."""
        return self.path / "mlflow.db"

    @property
    def mlartifacts(self) -> Path:
        """mlartifacts/: the artifacts of the run's MLflow runs (report, plan, tables) with the sqlite store."""
        return self.path / "mlartifacts"

    def is_run(self) -> bool:
        """Made by m2d run / sweep: its marker, or an older run's config and state."""
        return output_kind(self.path) == "run" or (self.config.is_file() and self.state.is_file())

    def sweep_id(self) -> str:
        return json.loads(self.state.read_text())["sweep_id"]

    @property
    def memory_plan(self) -> Path:
        """memory_plan.json: m2d run's plan, made before any work (every stage's bytes per device, storage, bill)."""
        return self.path / "memory_plan.json"

    @property
    def corpora(self) -> Path:
        """The fingerprints of the corpora the run read (data spec key -> files, sizes, mtimes)."""
        return self.path / "corpora.json"

    def read_memory_plan(self) -> dict | None:
        return json.loads(self.memory_plan.read_text()) if self.memory_plan.exists() else None

    def stage_times(self) -> dict:
        return json.loads(self.timings.read_text()).get("stages", {}) if self.timings.exists() else {}

    # ---- stage 1 ---------------------------------------------------------------------------
    @property
    def stats(self) -> Path:
        """stats/: the calibration statistics (safetensors + manifest with teacher, data, tokens and checksum)."""
        return self.path / "stats"

    @property
    def plans(self) -> Path:
        """plans.json: the plan of every config of the grid (selected experts, groups, merge weights, scales)."""
        return self.path / "plans.json"

    @property
    def probes(self) -> Path:
        """First-chunk perplexity of every distinct student (the probe round), saved as they come."""
        return self.path / "probes.json"

    @property
    def promotions(self) -> Path:
        """promotions.json: the best (K, scaling) of every (scoring, grouping) pair: what stage 2 distils."""
        return self.path / "promotions.json"

    @property
    def stage1_csv(self) -> Path:
        """stage1.csv: the pre-distillation perplexity of every config (rows scoring x grouping x scaling, by K)."""
        return self.path / STAGE1_CSV

    @property
    def stage1_md(self) -> Path:
        """stage1.md: the same table in Markdown (the paper's layout)."""
        return self.path / STAGE1_MD

    @property
    def stage1_heatmap(self) -> Path:
        """stage1_heatmap.png: the same table as a heatmap (pruned configs hatched, their partial perplexity)."""
        return self.path / STAGE1_HEATMAP

    def stage1_ledger(self) -> Ledger:
        """trials/: stage 1's ledger, one record per config (the truth a resume trusts)."""
        return Ledger(self.path / "trials")

    def read_plans(self) -> dict:
        return json.loads(self.plans.read_text())

    def read_promotions(self) -> dict:
        if not self.promotions.exists():
            raise M2DError(
                f"{self.path} holds no finished stage 1 (no {self.promotions.name}); run m2d run CONFIG --out "
                f"{self.path} first"
            )
        return json.loads(self.promotions.read_text())

    # ---- stage 2 ---------------------------------------------------------------------------
    @property
    def stage2(self) -> Path:
        """stage2/: stage 2's records (its fixed settings, its ledger, each baseline's own records)."""
        return self.path / "stage2"

    @property
    def stage2_config(self) -> Path:
        """The distillation settings fixed at the first stage-2 start."""
        return self.stage2 / "config.yaml"

    @property
    def stage2_csv(self) -> Path:
        """stage2.csv: one row per student (status, steps, validation perplexity, throughput, its path, peaks)."""
        return self.path / "stage2.csv"

    @property
    def stage2_md(self) -> Path:
        """stage2.md: the same table in Markdown."""
        return self.path / "stage2.md"

    @property
    def stage2_curves(self) -> Path:
        """stage2_curves.png: each student's validation perplexity against its step."""
        return self.path / "stage2_curves.png"

    def stage2_ledger(self) -> Ledger:
        """stage2/trials/: stage 2's ledger, one record per student."""
        return Ledger(self.stage2 / "trials")

    def stage2_records(self) -> list[dict]:
        return self.stage2_ledger().records() if (self.stage2 / "trials").exists() else []

    def baseline(self, name: str) -> Path:
        """A stage-2 baseline's own records (its preparation: the d2d search's candidates, ...); the files in it are
        the baseline's."""
        return self.stage2 / name

    # ---- stage 3 ---------------------------------------------------------------------------
    @property
    def stage3(self) -> Path:
        """stage3/: stage 3's records (its suite, each model's result)."""
        return self.path / "stage3"

    @property
    def suite(self) -> Path:
        """The lm-eval suite a started stage 3 keeps."""
        return self.stage3 / "suite.json"

    @property
    def stage3_results(self) -> Path:
        """stage3/results/: one lm-eval result per model (per-task accuracy, the mean), written as each model ends."""
        return self.stage3 / "results"

    def stage3_result(self, key: str) -> Path:
        return self.stage3_results / f"{key}.json"

    def read_stage3(self) -> dict[str, dict]:
        """key -> lm-eval result record of every model evaluated so far."""
        return _by_key(self.stage3_results)

    # ---- the analysis (what the models write) --------------------------------------------------
    @property
    def analysis(self) -> Path:
        """analysis/: what the models write, each answer in the paper's error taxonomy (stages/analysis.py)."""
        return self.path / "analysis"

    @property
    def analysis_settings(self) -> Path:
        """The questions, prompt and sampling a started analysis keeps."""
        return self.analysis / "settings.json"

    @property
    def analysis_judge(self) -> Path:
        """The judge's name and prompt."""
        return self.analysis / "judge.json"

    @property
    def analysis_results(self) -> Path:
        """analysis/results/: one record per model (its category counts and rates), written as each model ends."""
        return self.analysis / "results"

    def analysis_responses(self, key: str) -> Path:
        return self.analysis / "responses" / f"{key}.jsonl"

    def read_analysis(self) -> dict[str, dict]:
        """key -> the analysis record of every model classified so far."""
        return _by_key(self.analysis_results)


def _by_key(d: Path) -> dict[str, dict]:
    """key -> record of a directory of records (none when it does not exist)."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(d.glob("*.json"))} if d.exists() else {}
