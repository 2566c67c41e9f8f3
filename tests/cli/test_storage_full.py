"""A run's storage (issue 54): a disk too small for the plan's peak is refused before any work, and a disk that fills
while stage 2 writes stops the run with one line and exit 3, nothing half-written; after space is freed a resume
gives the students an uninterrupted run gives. On small tmpfs filesystems in private mount namespaces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import multinode_unavailable

from m2d_ray.shipped import EXPERIMENTS

HERE = Path(__file__).resolve().parent
TINY = EXPERIMENTS / "tiny.yaml"


def _namespaces() -> None:
    why = multinode_unavailable()  # unshare, root and the ray CLI: what the two-node tests need too
    if why:
        pytest.skip(why)


def test_a_disk_smaller_than_the_plan_s_peak_is_refused_before_any_work(tmp_path):
    _namespaces()
    small = tmp_path / "small"
    small.mkdir()
    script = (
        f"mount -t tmpfs -o size=12m tmpfs {small} && {sys.executable} -m m2d_ray.cli run {TINY} --out {small}/run; "
        f"echo rc=$?; ls -A {small}"
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=300)
    rc = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.stdout.strip().endswith("rc=2"), (out.stdout[-500:], out.stderr[-2000:])
    assert rc == "rc=2"  # `ls -A` printed nothing: nothing was written there
    line = [ln for ln in out.stderr.splitlines() if ln.startswith("m2d: error:")]
    assert len(line) == 1 and f"to {small}/run but its filesystem has 12 MiB free" in line[0], out.stderr[-2000:]
    assert "stage2.keep_training_state" in line[0] and "--out" in line[0]


def test_a_disk_that_fills_in_stage_2_stops_with_one_line_and_a_resume_finishes_as_a_whole_run(tmp_path):
    _namespaces()
    proc = subprocess.run(
        [
            "unshare",
            "-pfm",
            "--kill-child",
            "--mount-proc",
            sys.executable,
            str(HERE / "storage_full.py"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads((tmp_path / "results.json").read_text())
    filled = r["filled"]
    assert filled["rc"] == 3, filled["stderr"][-3000:]
    line = [ln for ln in filled["stderr"].splitlines() if ln.startswith("m2d: ")]
    assert len(line) == 1 and line[0].startswith("m2d: stopped: "), filled["stderr"][-3000:]
    assert "no space left" in line[0] and "where the plan expected" in line[0] and "m2d run --resume" in line[0]
    assert r["resumed"]["rc"] == 0, r["resumed"]["stderr"][-3000:]
    assert r["whole"]["rc"] == 0, r["whole"]["stderr"][-3000:]

    def students(run: Path) -> dict:
        ledger = {p.stem: json.loads(p.read_text()) for p in (run / "stage2" / "trials").glob("*.json")}
        return {k: (v["status"], v["steps"], round(v["val_ppl"], 6)) for k, v in ledger.items()}

    resumed, whole = students(tmp_path / "resumed_run"), students(tmp_path / "whole")
    assert resumed == whole and {s for s, _, _ in whole.values()} == {"ok"} and len(whole) == 1, (resumed, whole)


def test_a_full_disk_is_read_from_an_errno_anywhere_in_the_causes_or_from_the_text_of_a_worker_s_error():
    import errno

    from m2d_ray.errors import full_disk

    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", "/runs/x/ckpt")
        except OSError as inner:
            raise RuntimeError("could not save") from inner
    except RuntimeError as outer:
        assert full_disk(outer) == "over its quota"
    worker = "RayTaskError: safetensors_rust.SafetensorError: I/O error: No space left on device (os error 28)"
    assert full_disk(RuntimeError(worker)) == "no space left" and full_disk(worker) == "no space left"
    assert full_disk(OSError(errno.EROFS, "Read-only file system")) == "read-only"
    assert full_disk(OSError(errno.ENOENT, "No such file")) is None and full_disk("a plain failure") is None


def test_places_on_one_filesystem_add_up_a_resume_counts_what_is_written_and_an_object_store_is_left_out(tmp_path):
    from m2d_ray.plan.space import RECORDS_BYTES, needs, space_problem

    run, store = tmp_path / "run", tmp_path / "store"
    store.mkdir()
    (store / "student.safetensors").write_bytes(b"\0" * 4096)
    peak = 100 << 20
    records = RECORDS_BYTES + int(0.05 * peak)
    assert needs(peak, run, None, resumed=False) == {run: peak + records}
    assert needs(peak, run, str(store), resumed=True) == {store: peak - 4096, run: records}
    assert needs(peak, run, "s3://bucket/run", resumed=False) == {run: records}
    both = needs(peak, run, str(store), resumed=False)
    assert space_problem(both, free=lambda p: peak + records) is None  # each alone fits ...
    line = space_problem(both, free=lambda p: peak + records - 1)  # ... together on one filesystem they do not
    assert line.startswith(f"the run will write 113 MiB to {store} and {run} but its filesystem has 113 MiB free")
