"""The run report from a stored small run (tests/data/small_run: the ledgers and plans of a real `m2d run`
with the e2e test's settings; models, statistics and MLflow store left out)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from small_run import STORED

from m2d_ray.errors import M2DError
from m2d_ray.pipeline import write_report
from m2d_ray.report.analysis import distill_rows, erank_table, marginal, matched_rows, overlap, selections
from m2d_ray.run_dir import RunDir
from m2d_ray.stages.report import run_data


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return Path(shutil.copytree(STORED, tmp_path / "run"))


def test_overlap_and_effective_rank_from_the_stage1_records(run_dir):
    data = run_data(RunDir(run_dir))
    k = data.k
    sel = selections(data, k)
    ov = overlap(sel, k)
    # brute force from the stage-1 ledger (each record keeps its own selection), not from plans.json
    by_scoring = {r["scoring"]: r["selected"] for r in data.stage1 if r["K"] == k}
    for a in ov:
        assert ov[a][a] == 1.0
        for b in ov:
            layers = by_scoring[a]
            expect = sum(len(set(layers[i]) & set(by_scoring[b][i])) for i in layers) / (k * len(layers))
            assert ov[a][b] == pytest.approx(expect) == ov[b][a]
    Ks, er = erank_table(data)
    for s, t in er.items():
        for K, v in t.items():
            assert 1.0 <= v <= K + 1e-9
            records = [r["effective_rank"] for r in data.stage1 if r["scoring"] == s and r["K"] == K]
            assert v == pytest.approx(records[0])


def test_distill_rows_and_marginal_effects(run_dir):
    data = run_data(RunDir(run_dir))
    rows = distill_rows(data)
    students = [r for r in rows if r["kind"] == "student"]
    assert len(students) == len(data.promotions["pairs"])
    assert [(r["kind"], r["scoring"]) for r in rows[len(students) :]] == [
        ("baseline", "random-init"),
        ("baseline", "d2d"),
        ("teacher", "teacher"),
        ("teacher", "dense teacher"),
    ]
    assert all(r["mean"] is not None and set(r["acc"]) == set(data.tasks()) for r in rows)
    for axis in ("scoring", "grouping"):
        m = marginal(rows, axis, getattr(data.cfg.grid, axis))
        for v, acc in m.items():
            accs = [r["mean"] for r in students if r[axis] == v]
            assert acc == pytest.approx(sum(accs) / len(accs))


def test_matched_parameters_rows(run_dir):
    data = run_data(RunDir(run_dir))
    rows = matched_rows(data, distill_rows(data))
    students = [r for r in distill_rows(data) if r["kind"] == "student"]
    assert [r["label"] for r in rows] == [
        "best MoE-to-dense",
        "d2d",
        "random-init",
    ]  # the run's baselines, in the table's order
    assert rows[0]["mean"] == max(r["mean"] for r in students)
    d = data.cfg.distill
    for r in rows:
        rec = data.stage2[r["key"]]
        assert r["s_per_step"] == pytest.approx(d.batch_size * d.seq_len / rec["tokens_per_s"])
        assert r["student_params"] == rec["student_params"] > 0 and r["val_ppl"] == rec["val_ppl"]
    # matched: within 1% of each other; the D2D student learns from the whole dense twin, the others from k of E experts
    assert max(r["student_params"] for r in rows) / min(r["student_params"] for r in rows) < 1.01
    assert (
        rows[1]["teacher_active_params"]
        == 555_712
        > rows[0]["teacher_active_params"]
        == rows[2]["teacher_active_params"]
    )
    # without accuracies the best student is the one with the lowest final validation perplexity
    for r in students:
        data.stage3.pop(r["key"])
    assert matched_rows(data, distill_rows(data))[0]["val_ppl"] == min(r["val_ppl"] for r in students)


def test_report_files_and_page(run_dir):
    index = write_report(run_dir)
    out = index.parent
    for name in (
        "stage1.csv",
        "stage1.md",
        "distill.csv",
        "distill.md",
        "overlap.csv",
        "overlap.md",
        "erank.csv",
        "erank.md",
    ):
        assert (out / name).stat().st_size > 0, name
    page = index.read_text()
    for img in ("stage1_heatmap.png", "marginal.png", "overlap.png", "erank.png", "curves.png"):
        assert (out / img).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f'src="{img}"' in page
    rows = list(csv.DictReader((out / "distill.csv").open()))
    assert [r["scoring"] for r in rows[-2:]] == ["teacher", "dense teacher"]
    assert float(rows[-2]["mean acc"]) > float(next(r for r in rows if r["scoring"] == "random-init")["mean acc"])
    for name in ("matched", "d2d_candidates"):
        assert (out / f"{name}.csv").stat().st_size > 0 and f"{name}.csv" in page, name
    assert not list(out.glob(".*"))  # no temp files left behind


def test_report_needs_a_finished_stage1(tmp_path):
    with pytest.raises(M2DError, match="no finished stage 1"):
        write_report(tmp_path)


def _texts(fig) -> list[tuple[str, object]]:
    """(text, window extent) of every visible, non-empty text of a drawn figure."""
    from matplotlib.text import Text

    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    return [
        (t.get_text(), t.get_window_extent(r)) for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()
    ]


@pytest.fixture
def figures(monkeypatch) -> dict[str, list]:
    """file name -> the texts of each report figure, captured as it is saved."""
    from m2d_ray.report import figures as fig_module
    from m2d_ray.report import run as run_module
    from m2d_ray.report import stage1 as stage1_module

    seen: dict[str, list] = {}

    def save(fig, path, *a, **kw):
        seen[Path(path).name] = _texts(fig)
        return fig_module.save(fig, path, *a, **kw)

    monkeypatch.setattr(run_module, "save", save)
    monkeypatch.setattr(stage1_module, "save", save)
    return seen


def test_no_two_labels_of_a_figure_overlap_and_references_are_in_a_legend(run_dir, figures):
    index = write_report(run_dir)
    assert set(figures) == {"stage1_heatmap.png", "marginal.png", "overlap.png", "erank.png", "curves.png"}
    for name, texts in figures.items():
        for i, (a, ba) in enumerate(texts):
            for b, bb in texts[i + 1 :]:
                assert not ba.overlaps(bb), f"{name}: {a!r} overlaps {b!r}"
    data = run_data(RunDir(run_dir))
    refs = [r for r in distill_rows(data) if r["kind"] != "student"]
    labels = [t for t, _ in figures["marginal.png"]]
    for r in (
        refs
    ):  # the reference lines (close together here: d2d 0.917, dense teacher 0.938) named once each, with the value
        assert labels.count(f"{r['scoring']} {r['mean']:.3f}") == 1
    assert index.exists()


def test_pruned_stage1_cells_show_their_partial_perplexity(run_dir, figures):
    rec_path = run_dir / "trials" / "do-acp_rr_uniform_K2.json"
    rec = json.loads(rec_path.read_text())
    rec_path.write_text(json.dumps({**rec, "status": "pruned", "ppl": None, "partials": [[1, 61.37], [2, None]]}))
    write_report(run_dir)
    labels = [t for t, _ in figures["stage1_heatmap.png"]]
    assert "61 partial" in labels  # the last finite partial, marked
    full = [r["ppl"] for r in run_data(RunDir(run_dir)).stage1 if r["status"] == "ok"]
    assert all(f"{p:.0f}" in labels for p in full)


def test_every_figure_has_a_caption(run_dir):
    import re

    page = write_report(run_dir).read_text()
    imgs = re.findall(r"<img [^>]*>", page)
    figures = re.findall(r"<figure><img [^>]*><figcaption>([^<]{40,})</figcaption></figure>", page)
    assert len(imgs) == len(figures) == 6  # the stored run has the analysis: its figure too


def _set_status(run_dir: Path, stage_dir: str, status: str, keep: tuple[str, ...] = ()) -> None:
    for p in (run_dir / stage_dir).glob("*.json"):
        r = json.loads(p.read_text())
        if r["key"] not in keep:
            r["status"] = status
            p.write_text(json.dumps(r))


def test_a_run_that_distilled_or_evaluated_no_student_has_failed(run_dir, capsys):
    from m2d_ray.commands.runs import check_outcome
    from m2d_ray.errors import RunFailed

    ok = check_outcome(run_dir)
    assert ok["promoted_distilled"] == ok["promoted"] > 0 and ok["evaluated"] > 0
    assert capsys.readouterr().err.startswith(f"run done: students: {ok['students']['ok']} ok")
    _set_status(run_dir, "stage3/results", "failed", keep=("teacher",))  # every student's evaluation failed
    with pytest.raises(RunFailed, match="no student was evaluated"):
        check_outcome(run_dir)
    _set_status(run_dir, "stage2/trials", "failed", keep=("baseline-random-init",))  # only a baseline was distilled
    with pytest.raises(RunFailed, match="no promoted student was distilled"):
        check_outcome(run_dir)
    page = (write_report(run_dir)).read_text()
    assert "students: 1 ok, 0 pruned, 3 failed" in page  # the report says so too
