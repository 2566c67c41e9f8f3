"""MLflow tracking: one parent run per sweep, one nested run per trial, idempotent across resumes.

Runs are addressed by tags (`m2d.sweep_id` on the parent, `m2d.trial` on each child), never created
twice: `trial_run` finds the run a killed driver left behind and continues it, so a resumed sweep
has exactly one run per config. Uses `MlflowClient` (no global active-run state), so the Tune
callbacks on the driver can log from any thread.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from m2d_ray.errors import M2DError
from m2d_ray.run_dir import TEACHER_KEY, RunDir

# Imported inside functions: MLflow (seconds to import; only where a run is tracked).

PARENT_TAG, TRIAL_TAG, LOGGED_TAG = "m2d.sweep_id", "m2d.trial", "m2d.logged"
#: MLflow 3's experiment kind: a model-training experiment opens on its runs table, not on the GenAI overview
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
NOTE_TAG = "mlflow.note.content"  # a run's description in the UI (Markdown)
# : the runs-table view m2d prints the link of: an experiment tag MLflow's UI reads as a shared view
# (`viewStateShareKey`)
VIEW_KEY = "m2d-compare"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
#: each stage's key metric, under one name in every nested run of that stage (one runs-table column compares them);
#: the analysis (what the models write): the catastrophic-failure rate, the paper's headline figure of it
KEY_METRICS = {1: "perplexity", 2: "final_val_ppl", 3: "mean_acc", "analysis": "catastrophic"}


def run_tracking_uri(cfg, rd: RunDir, override: str | None = None) -> str:
    """--tracking-uri, else the config's mlflow.tracking_uri, else the run directory's sqlite store
    (plain-folder stores raise in MLflow 3.x)."""
    return override or cfg.mlflow.tracking_uri or f"sqlite:///{rd.mlflow_db}"


def run_tracker(cfg, rd: RunDir, override: str | None = None) -> Tracker:
    """The tracker of a run directory (artifacts under RUN_DIR/mlartifacts for a sqlite store). The run directory's own
    store is first made to name its artifacts where the directory is now (`follow_moved_run`)."""
    uri = run_tracking_uri(cfg, rd, override)
    if uri == f"sqlite:///{rd.mlflow_db}":
        follow_moved_run(rd.mlflow_db, rd.mlartifacts)
    return Tracker(uri, cfg.mlflow.experiment, rd.mlartifacts)


def follow_moved_run(db: Path, artifacts: Path) -> int:
    """Point a run directory's own MLflow store (`db`) at its artifacts (`artifacts`, RUN_DIR/mlartifacts) where the
    directory is now; returns how many locations changed (0 where it never moved).

    MLflow keeps absolute artifact locations (the experiment's `file:///home/ray/runs/x/mlartifacts`, each run's
    `.../mlartifacts/RUN_ID/artifacts`), so a run directory copied off its cluster (`kubectl cp`, `ray rsync-down`)
    opens in `mlflow ui` with its metrics and every artifact link broken. MLflow has no call that changes a location,
    so this rewrites the two columns of its schema that hold them (experiments.artifact_location, runs.artifact_uri),
    only for locations that end in `/mlartifacts` (the ones m2d chose) and are not already this directory's. Any m2d
    command that opens the run (`m2d report RUN_DIR`) does it, once, before MLflow reads the store."""
    if not db.is_file():
        return 0
    new = Path(artifacts).resolve().as_uri()
    changed = 0
    with closing(sqlite3.connect(db)) as con, con:  # one transaction: all locations move, or none
        olds = {
            loc
            for (loc,) in con.execute("SELECT artifact_location FROM experiments")
            if loc and loc.startswith("file:") and loc.endswith("/mlartifacts") and loc != new
        }
        for old in olds:
            changed += con.execute(
                "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) WHERE substr(artifact_uri, 1, ?) = ?",
                (new, len(old) + 1, len(old) + 1, f"{old}/"),
            ).rowcount
            changed += con.execute(
                "UPDATE experiments SET artifact_location = ? WHERE artifact_location = ?", (new, old)
            ).rowcount
    return changed


class Tracker:
    def __init__(self, tracking_uri: str, experiment: str, artifact_root: str | Path | None = None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self._mlflow = mlflow
        self.uri = tracking_uri
        self.client = MlflowClient(tracking_uri=tracking_uri)
        try:
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                location = (
                    Path(artifact_root).resolve().as_uri()
                    if artifact_root and tracking_uri.startswith("sqlite")
                    else None
                )
                self.experiment_id = self.client.create_experiment(
                    experiment, artifact_location=location, tags=dict([EXPERIMENT_KIND])
                )
            else:
                self.experiment_id = exp.experiment_id
                if EXPERIMENT_KIND[0] not in exp.tags:  # an experiment of an older m2d; a kind someone chose is kept
                    self.client.set_experiment_tag(self.experiment_id, *EXPERIMENT_KIND)
            if exp is None or exp.tags.get(VIEW_TAG) != COMPARE_VIEW:
                self.client.set_experiment_tag(self.experiment_id, VIEW_TAG, COMPARE_VIEW)
        except Exception as exc:  # unreachable server, bad URI ...
            raise M2DError(
                f"MLflow tracking at {tracking_uri} is not usable ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0][:160]}); check --tracking-uri"
            ) from None

    def ui_url(self) -> str:
        return ui_url(self.uri, self.experiment_id)

    # ---- runs ------------------------------------------------------------------------------
    def _find(self, tag: str, value: str, parent: str | None = None) -> str | None:
        flt = f"tags.`{tag}` = '{value}'" + (f" and tags.`mlflow.parentRunId` = '{parent}'" if parent else "")
        runs = self.client.search_runs([self.experiment_id], filter_string=flt, max_results=2)
        return runs[0].info.run_id if runs else None

    def parent_run(self, sweep_id: str, name: str, params: dict, tags: dict) -> str:
        """The run's parent run (created once; found again by the run's id), with `params` it lacks and `tags` logged:
        whichever stage logs first creates it, the stage that knows the run's parameters adds them."""
        run_id = self._find(PARENT_TAG, sweep_id)
        if run_id is None:
            run_id = self.client.create_run(
                self.experiment_id, run_name=name, tags={PARENT_TAG: sweep_id, **_str(tags)}
            ).info.run_id
            self.log(run_id, params=params)
            return run_id
        self.client.update_run(run_id, status="RUNNING")
        if params or tags:
            have = self.client.get_run(run_id).data.params if params else {}
            self.log(run_id, params={k: v for k, v in params.items() if k not in have}, tags=tags)
        return run_id

    def trial_run(self, parent: str, key: str, params: dict) -> str:
        run_id = self._find(TRIAL_TAG, key, parent)
        if run_id is None:
            tags = {"mlflow.parentRunId": parent, TRIAL_TAG: key}
            run_id = self.client.create_run(self.experiment_id, run_name=key, tags=tags).info.run_id
            self.log(run_id, params=params)
        return run_id

    def logged_trials(self, parent: str) -> set[str]:
        """Keys of the nested runs of `parent` whose results were fully logged (tag m2d.logged)."""
        flt = f"tags.`mlflow.parentRunId` = '{parent}' and tags.`{LOGGED_TAG}` = '1'"
        runs = self.client.search_runs([self.experiment_id], filter_string=flt, max_results=50_000)
        return {r.data.tags[TRIAL_TAG] for r in runs if TRIAL_TAG in r.data.tags}

    # ---- logging ---------------------------------------------------------------------------
    def log(
        self,
        run_id: str,
        params: dict | None = None,
        metrics: dict | None = None,
        tags: dict | None = None,
        steps: dict[str, list[tuple[int, float]]] | None = None,
    ) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, 0) for k, v in (metrics or {}).items() if _finite(v)]
        for k, series in (steps or {}).items():
            ms += [Metric(k, float(v), now, int(s)) for s, v in series if _finite(v)]
        self.client.log_batch(
            run_id,
            metrics=ms,
            params=[Param(k, str(v)) for k, v in (params or {}).items()],
            tags=[RunTag(k, v) for k, v in _str(tags or {}).items()],
        )

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    def artifacts(self, run_id: str, paths: list[str | Path]) -> None:
        for p in paths:
            if Path(p).exists():
                self.client.log_artifact(run_id, str(p))


def ui_url(tracking_uri: str, experiment_id: str) -> str:
    """An experiment's runs table opened on the comparison view, in the tracking server's UI (a local store: in
    `mlflow ui` on its default address). MLflow 3's UI starts on its GenAI pages; `workflowType` picks model
    training."""
    host = tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    return f"{host}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"


def _compare_view() -> str:
    """The comparison view as MLflow's UI stores a shared view (search facets + UI state, JSON). Table: runs grouped
    by stage (stage-1 configs, students, evaluations; each group open), the recipe and every stage's key metric as
    columns. Charts, one per run (not per group): parallel coordinates of K and scaling against stage 1's
    perplexity, and a bar per run of stage 2's and stage 3's key metrics."""

    columns = (
        [f"params.`{p}`" for p in ("K", "scaling")]
        + [f"tags.`{t}`" for t in ("pair", "kind")]
        + [f"metrics.`{m}`" for m in KEY_METRICS.values()]
    )
    card = {"runsCountToCompare": 100, "metricSectionId": "m2d", "deleted": False, "isGenerated": False}
    charts = [
        {
            **card,
            "uuid": "m2d-grid",
            "type": "PARALLEL",
            "selectedParams": ["K", "scaling"],
            "selectedMetrics": [KEY_METRICS[1]],
            "showAllRuns": True,
        },
        *({**card, "uuid": f"m2d-{m}", "type": "BAR", "metricKey": m} for m in (KEY_METRICS[2], KEY_METRICS[3])),
    ]
    return json.dumps(
        {
            "searchFilter": "",
            "orderByKey": "attributes.start_time",
            "orderByAsc": True,
            "startTime": "ALL",
            "lifecycleFilter": "Active",
            "modelVersionFilter": "All Runs",
            "datasetsFilter": [],
            "selectedColumns": columns,
            "runsHiddenMode": "SHOW_ALL",
            "groupBy": {"aggregateFunction": "min", "groupByKeys": [{"mode": "tag", "groupByData": "stage"}]},
            "groupsExpanded": {f"tag.stage.{s}": True for s in KEY_METRICS},
            "useGroupedValuesInCharts": False,
            "compareRunCharts": charts,
            "compareRunSections": [
                {
                    "uuid": "m2d",
                    "name": "m2d: recipes (stage 1), students (stage 2), accuracy (stage 3)",
                    "display": True,
                    "isReordered": False,
                    "deleted": False,
                    "isGenerated": False,
                }
            ],
        },
        sort_keys=True,
    )


COMPARE_VIEW = _compare_view()


def run_tags(stage: int | str, pair: str, kind: str) -> dict[str, str]:
    """What a nested run is, as tags the UI groups and filters by (`tags.stage = '1'`, Group by `pair`):
    kind is `config` (a stage-1 grid point), `promoted` (its pair's best, and that student in stages 2 and 3),
    `baseline` or `teacher`."""
    return {"stage": str(stage), "pair": pair, "kind": kind}


def model_kind(key: str) -> str:
    """The kind of a stage-2/3 model from its key (`baseline-NAME`, the teachers' `teacher` and `teacher-NAME`, else a
    promoted config)."""
    return (
        "teacher"
        if key == TEACHER_KEY or key.startswith(f"{TEACHER_KEY}-")
        else "baseline"
        if key.startswith("baseline-")
        else "promoted"
    )


def run_description(name: str, rd: RunDir, teacher: str, configs: int) -> str:
    """The parent run's description (Markdown): what the run is, where its report is, how to compare its runs."""
    return (
        f"**m2d run `{name}`**: MoE → dense recipes for `{teacher}`. Stage 1 scores {configs} recipe configs by "
        "pre-distillation perplexity (nested runs tagged `stage=1`, metric `perplexity`); stage 2 distils each "
        "(scoring, grouping) pair's best and the baselines (`stage=2`, `final_val_ppl`); stage 3 evaluates them and "
        "the "
        "teacher (`stage=3`, `mean_acc`); with `stage3.analysis` each model's answers are put in the paper's error "
        "taxonomy (`stage=analysis`, `catastrophic`).\n\n"
        f"Report: `{rd.report / 'index.html'}` (also in this run's Artifacts, `report/`).\n\n"
        "Compare: search `tags.stage = '1'` (or `'2'`, `'3'`), *Group by* the tag `pair` or `kind`, add the metric's "
        "column, "
        "or open *Chart* → parallel coordinates (params K, scaling against `perplexity`)."
    )


def _finite(v) -> bool:
    return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def _str(d: dict) -> dict[str, str]:
    return {k: str(v) for k, v in d.items() if v is not None}
