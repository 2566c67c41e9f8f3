"""Output paths: m2d replaces only its own previous output of the same kind, only on request, and atomically."""

from __future__ import annotations

import json

import pytest
from conftest import SMALL_CALIB

from m2d_ray.artifacts import MARKER, atomic_dir, check_output, output_kind
from m2d_ray.cli import main
from m2d_ray.errors import M2DError


def _write(tmp, name="a.txt", text="new"):
    (tmp / name).write_text(text)


def test_new_path_and_empty_directory_are_written(tmp_path):
    with atomic_dir(tmp_path / "x" / "y" / "out", "student") as tmp:
        _write(tmp)
    assert (tmp_path / "x/y/out/a.txt").read_text() == "new" and output_kind(tmp_path / "x/y/out") == "student"
    (tmp_path / "empty").mkdir()
    with atomic_dir(tmp_path / "empty", "statistics") as tmp:
        _write(tmp)
    assert output_kind(tmp_path / "empty") == "statistics"


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda p: p.write_text("my notes"), "existing file"),
        (lambda p: (p.mkdir(), (p / "thesis.tex").write_text("x")), "did not write"),
        (
            lambda p: (
                p.mkdir(),
                (p / MARKER).write_text(json.dumps({"kind": "statistics"})),
                (p / "s").write_text("x"),
            ),
            "not a student",
        ),
        (
            lambda p: (p.mkdir(), (p / MARKER).write_text(json.dumps({"kind": "student"})), (p / "s").write_text("x")),
            "pass --overwrite",
        ),
    ],
)
def test_what_m2d_did_not_write_or_was_not_asked_to_replace_is_refused_untouched(tmp_path, setup, message):
    target = tmp_path / "out"
    setup(target)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(M2DError, match=message):
        with atomic_dir(target, "student") as tmp:
            _write(tmp)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_overwrite_replaces_only_once_the_new_output_is_complete(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out, "student") as tmp:
        _write(tmp, text="old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_dir(out, "student", overwrite=True) as tmp:
            _write(tmp, text="half")
            raise RuntimeError("boom")
    assert (out / "a.txt").read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out"]
    with atomic_dir(out, "student", overwrite=True) as tmp:
        _write(tmp, "b.txt")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt", MARKER] and [p.name for p in tmp_path.iterdir()] == [
        "out"
    ]


def test_a_failure_removes_the_parents_it_created(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_dir(tmp_path / "a" / "b" / "out", "student"):
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_check_output_allows_a_path_under_a_new_directory(tmp_path):
    assert check_output(tmp_path / "new" / "deeper", "run") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()


def test_convert_overwrite_through_the_cli(tiny_teacher_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "student"
    base = [
        "convert",
        "--model",
        str(tiny_teacher_dir),
        *SMALL_CALIB,
    ]
    assert main([*base, "--K", "2", "--out", str(out)]) == 0
    first = (out / "model.safetensors").read_bytes()
    assert main([*base, "--K", "4", "--out", str(out)]) == 2 and "pass --overwrite" in capsys.readouterr().err
    # a conversion that fails half-way leaves the previous student as it was
    import m2d_ray.convert.export as export

    monkeypatch.setattr(export, "verify_student", lambda *a, **k: {0: 1.0})
    assert main([*base, "--K", "4", "--out", str(out), "--overwrite"]) == 1
    assert "internal error" in capsys.readouterr().err and (out / "model.safetensors").read_bytes() == first
    monkeypatch.undo()
    assert main([*base, "--K", "4", "--out", str(out), "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["K"] == 4
    assert (out / "model.safetensors").read_bytes() != first and [p.name for p in tmp_path.iterdir()] == ["student"]
