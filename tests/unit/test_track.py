"""What a person finds in MLflow after a run (the stored small run, its store rebuilt by the stages' own
recorders): a model-training experiment, a described parent, nested runs tagged for Group by and filters,
one metric name per stage, and the comparison view the printed link opens."""

from __future__ import annotations

import json

import pytest
from small_run import finished_run


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    from mlflow.tracking import MlflowClient

    run_dir, result = finished_run(tmp_path_factory.mktemp("track") / "run")
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("m2d-tiny")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    return run_dir, result, client, exp, runs


def test_experiment_is_model_training_and_opens_on_the_comparison_view(logged):
    from m2d_ray.track import KEY_METRICS, VIEW_KEY, VIEW_TAG

    run_dir, result, _, exp, _ = logged
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # not the GenAI overview
    view = json.loads(exp.tags[VIEW_TAG])
    assert view["groupBy"]["groupByKeys"] == [{"mode": "tag", "groupByData": "stage"}]
    assert {f"metrics.`{m}`" for m in KEY_METRICS.values()} <= set(view["selectedColumns"])
    assert result["mlflow_url"] == (
        f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs"
        f"?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
    )


def test_the_link_points_at_the_tracking_server_or_at_mlflow_ui():
    from m2d_ray.track import ui_url

    assert ui_url("http://mlflow.lan:5000/", "7").startswith(
        "http://mlflow.lan:5000/#/experiments/7/runs?workflowType=machine_learning&"
    )
    assert ui_url("sqlite:////runs/demo/mlflow.db", "1").startswith("http://127.0.0.1:5000/#/experiments/1/runs?")


def test_nested_runs_carry_stage_pair_kind_and_one_key_metric_per_stage(logged):
    from m2d_ray.run_dir import RunDir
    from m2d_ray.track import KEY_METRICS

    run_dir, _, _, _, runs = logged
    rd = RunDir(run_dir)
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    by_stage = {s: [r for r in children if r.data.tags.get("stage") == str(s)] for s in KEY_METRICS}
    assert sum(map(len, by_stage.values())) == len(children)  # every nested run says its stage
    promoted = {p["key"] for p in rd.read_promotions()["pairs"].values()}
    s1 = {r.data.tags["m2d.trial"]: r.data.tags for r in by_stage[1]}
    assert set(s1) == {r["key"] for r in rd.stage1_ledger().records()}
    for rec in rd.stage1_ledger().records():
        assert s1[rec["key"]]["pair"] == f"{rec['scoring']}/{rec['grouping']}"
        assert s1[rec["key"]]["kind"] == ("promoted" if rec["key"] in promoted else "config")
    s2 = {r.data.tags["m2d.trial"]: r.data.tags["kind"] for r in by_stage[2]}
    assert s2 == {f"stage2/{r['key']}": "baseline" if r["baseline"] else "promoted" for r in rd.stage2_records()}
    s3 = {r.data.tags["m2d.trial"]: r.data.tags["kind"] for r in by_stage[3]}
    assert s3["stage3/teacher"] == s3["stage3/teacher-d2d"] == "teacher" and s3["stage3/baseline-d2d"] == "baseline"
    assert {k for k, v in s3.items() if v == "promoted"} == {f"stage3/{k}" for k in promoted}
    for stage, metric in KEY_METRICS.items():  # one column compares a stage's runs
        assert by_stage[stage] and all(
            metric in r.data.metrics for r in by_stage[stage] if r.data.tags["status"] == "ok"
        )


def test_parent_run_says_what_the_run_is_and_where_its_report_is(logged):
    run_dir, result, client, _, runs = logged
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    note = parent.data.tags["mlflow.note.content"]
    assert result["report"] in note and str(run_dir / "report" / "index.html") == result["report"]
    assert "4 recipe configs" in note and "tags.stage" in note
    assert "index.html" in {a.path.split("/")[-1] for a in client.list_artifacts(parent.info.run_id, "report")}


def test_an_existing_experiment_gets_the_kind_unless_it_has_one(tmp_path):
    from mlflow.tracking import MlflowClient

    from m2d_ray.track import VIEW_TAG, Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    old = client.create_experiment("old")  # made by an m2d without the tag
    mine = client.create_experiment("mine", tags={"mlflow.experimentKind": "genai_development"})
    Tracker(uri, "old"), Tracker(uri, "mine")
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"
    assert client.get_experiment(mine).tags["mlflow.experimentKind"] == "genai_development"  # someone's choice is kept
    assert VIEW_TAG in client.get_experiment(mine).tags


def test_a_copied_run_s_artifacts_open_from_the_new_place(logged, tmp_path):
    """The run directory copied off its cluster (`kubectl cp`, `ray rsync-down`) and opened with MLflow's client on the
    laptop: after `m2d report` on the copy, every run's artifacts are listed and downloaded from the copy. An
    experiment whose artifacts m2d did not place (a bucket) keeps its location."""
    import shutil
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from m2d_ray.commands.report import report
    from m2d_ray.track import follow_moved_run

    run_dir, _, _, _, _ = logged
    new = Path(shutil.copytree(run_dir, tmp_path / "laptop" / "runs" / "tiny"))
    client = MlflowClient(f"sqlite:///{new / 'mlflow.db'}")
    exp = client.get_experiment_by_name("m2d-tiny")
    assert exp.artifact_location == (run_dir / "mlartifacts").as_uri()  # as MLflow wrote it: the cluster's place
    theirs = client.create_experiment("theirs", artifact_location="s3://their-bucket/mlflow")

    report(str(new))  # what the laptop runs on the copy (docs/how-to/kubernetes.md, docs/tutorials/cluster.md)

    exp = client.get_experiment_by_name("m2d-tiny")
    assert exp.artifact_location == (new / "mlartifacts").resolve().as_uri()
    assert client.get_experiment(theirs).artifact_location == "s3://their-bucket/mlflow"
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    with_artifacts = [r for r in runs if (new / "mlartifacts" / r.info.run_id / "artifacts").is_dir()]
    assert with_artifacts  # the report, the plan, the tables
    for run in runs:
        assert run.info.artifact_uri.startswith(f"{exp.artifact_location}/{run.info.run_id}/"), run.info.artifact_uri
    for run in with_artifacts:
        on_disk = new / "mlartifacts" / run.info.run_id / "artifacts"
        assert {a.path for a in client.list_artifacts(run.info.run_id)} == {p.name for p in on_disk.iterdir()}
        got = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / run.info.run_id)))
        files = sorted(p.relative_to(on_disk) for p in on_disk.rglob("*") if p.is_file())
        assert files and files == sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file())
        assert all((got / f).read_bytes() == (on_disk / f).read_bytes() for f in files)
    assert follow_moved_run(new / "mlflow.db", new / "mlartifacts") == 0  # once: a second open changes nothing
