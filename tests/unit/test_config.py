"""Sweep configs: every shipped YAML loads and fits its teacher; bad values fail with one actionable line."""

from __future__ import annotations

from pathlib import Path

import pytest

from m2d_ray.cli import main
from m2d_ray.config import SweepConfig, k_values, load_config
from m2d_ray.errors import M2DError
from m2d_ray.pipeline import check_config
from m2d_ray.shipped import EXPERIMENTS

#: (top-k, experts) of the paper's teachers (method.md), checked offline against each YAML's K list
TEACHERS = {
    None: (2, 16),  # the embedded tiny teacher
    "Qwen/Qwen3-30B-A3B": (8, 128),
    "deepseek-ai/DeepSeek-V2-Lite": (6, 64),
    "openai/gpt-oss-20b": (4, 32),
    "../shared/teachers/qwen3moe-wiki4": (4, 32),
    "teachers/wiki-moe": (4, 32),  # experiments/train_text_teacher.py's, the same shape (train_text_teacher.SHAPE)
}


#: runnable configs sized for tests (m2d_ray/experiments/smoke.yaml: the tests' whole runs start there), not experiments
TEST_SIZED = {"smoke.yaml"}


@pytest.mark.parametrize("path", sorted(EXPERIMENTS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_loads_and_fits_its_teacher(path):
    cfg = load_config(path)
    check_config(cfg)  # what its stages check from the config alone (the baselines' names and settings)
    assert isinstance(cfg, SweepConfig)
    if path.name.startswith("_") or path.name in TEST_SIZED:  # an include-only base; a test-size run (one K)
        return
    k, E = TEACHERS[cfg.model]
    Ks = k_values(cfg.grid.K, k, E)
    assert Ks[0] == k and Ks[-1] == E


def test_paper_grid_is_350_configs():
    cfg = load_config(EXPERIMENTS / "qwen3_30b_a3b.yaml")
    assert (
        len(cfg.grid.scoring) * len(cfg.grid.grouping) * len(cfg.grid.scaling) * len(k_values(cfg.grid.K, 8, 128))
        == 350
    )
    assert cfg.calib.seq_len == 2048 and cfg.ray.gpus_per_trial == "auto"  # from the included base


def test_auto_K_and_overrides():
    assert k_values("auto", 2, 16) == [2, 4, 8, 16]
    assert k_values("auto", 6, 64) == [6, 12, 24, 48, 64]
    cfg = load_config(
        EXPERIMENTS / "tiny.yaml",
        ["grid.scoring=[sf,do-acp]", "grid.K=[4,2]", "search.early_stop=false", "eval.max_chars=null"],
    )
    assert cfg.grid.scoring == ("sf", "do-acp") and k_values(cfg.grid.K, 2, 16) == [2, 4]
    assert cfg.search.early_stop is False and cfg.eval.max_chars is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("grid.scoring=[sf,do-acpp]", "did you mean 'do-acp'"),
        ("grid.grouping=[rr,oc,xx]", "unknown grouping 'xx'"),
        ("grid.K=[]", "grid.K is empty"),
        ("grid.scaling=[]", "grid.scaling is empty"),
        ("grid.K=many", "grid.K='many'"),
        ("serch.early_stop=false", "did you mean search"),
        ("search.stop_factr=2", "did you mean search.stop_factor"),
        ("eval.chunks=two", "eval.chunks='two' should be int"),
        ("eval.chunks=0", "eval.chunks must be >= 1"),
        ("grid", "not key=value"),
        ("stage2.baselines=[random-init,d2dd]", "did you mean 'd2d'"),
        ("stage2.baselines=[randominit]", "did you mean 'random-init'"),
        ("stage2.targets=top:16", "unknown mode 'top'"),
        ("stage2.targets=sampled:300", "sampled"),
        ("distill.dtype=bfloat16", "distill.dtype is now distill.precision: bfloat16 -> bf16-mixed"),
        ("distill.precision=bf16", "unknown distill.precision 'bf16'; did you mean 'bf16-pure' or 'bf16-mixed'"),
        ("distill.kl_kernel=liger", "distill.kl_kernel=liger runs on CUDA devices only"),
        ("distill.deepspeed=maybe", "distill.deepspeed='maybe': use true, false or auto"),
        ("distill.kl_kernel=fused", "unknown distill.kl_kernel 'fused'"),
        ("distill.loss=fkll", "distill.loss: unknown loss 'fkll'; did you mean 'fkl'"),
        ("distill.checkpointing=ful", "did you mean 'full'"),
        ("distill.zero_stage=4", "distill.zero_stage=4: use 0, 1, 2, 3 or auto"),
        ("stage=3", "stage=3: use 1 or 2"),
        ("stage3.analysis.questions=mmul", "stage3.analysis.questions='mmul': did you mean mmlu"),
    ],
)
def test_bad_values_fail_with_one_line(override, message):
    with pytest.raises(M2DError, match=message.replace("[", r"\[").replace(".", r"\.")):
        _checked(EXPERIMENTS / "tiny.yaml", override)


def test_each_closed_set_is_declared_once_and_checked_by_the_loader():
    """A Literal-typed key is checked by the loader against its type's values, which come from the catalog's
    registries: no section check names them again."""
    import inspect

    from m2d_ray.catalog.distill import CHECKPOINTING, KL_KERNELS, LOSSES, PRECISIONS
    from m2d_ray.config import checks
    from m2d_ray.config.fields import REGISTRIES

    assert set(REGISTRIES.values()) == {PRECISIONS, KL_KERNELS, CHECKPOINTING, LOSSES}
    source = inspect.getsource(checks)
    assert not [name for name in ("PRECISIONS", "KL_KERNELS", "CHECKPOINTING", "LOSSES", "SETS") if name in source]


def test_pure_bf16_is_refused_beside_deepspeed():
    """DeepSpeed's bf16 mode keeps float32 masters: asking it for pure bfloat16 would silently train mixed."""
    with pytest.raises(M2DError, match="bf16-pure: DeepSpeed keeps float32 master weights"):
        _checked(EXPERIMENTS / "tiny.yaml", "distill.precision=bf16-pure", "distill.deepspeed=true")
    with pytest.raises(M2DError, match="bf16-pure"):  # auto is DeepSpeed above one worker
        _checked(
            EXPERIMENTS / "tiny.yaml", "distill.precision=bf16-pure", "distill.deepspeed=auto", "distill.workers=2"
        )
    _checked(EXPERIMENTS / "tiny.yaml", "distill.precision=bf16-pure", "distill.deepspeed=auto")


def _checked(path: Path, *overrides: str) -> SweepConfig:
    """A config loaded and checked as every command that plans or runs its stages checks it."""
    cfg = load_config(path, list(overrides))
    check_config(cfg)
    return cfg


@pytest.mark.parametrize("loss", ["rkl", "fkl+mse"])
def test_losses_that_need_the_whole_teacher_refuse_cached_targets(loss):
    assert (
        load_config(EXPERIMENTS / "tiny.yaml", [f"distill.loss={loss}"]).target_spec() is None
    )  # online: every loss works
    with pytest.raises(M2DError, match=f"distill.loss={loss.replace('+', '.')}"):
        load_config(EXPERIMENTS / "tiny.yaml", [f"distill.loss={loss}", "stage2.targets=topk:16"])


def test_d2d_needs_a_dense_teacher_and_the_baseline():
    cfg = load_config(EXPERIMENTS / "tiny.yaml")
    assert (
        "d2d" in cfg.stage2.baselines and cfg.stage2.d2d_teacher is None
    )  # the embedded pair: the dense twin by default
    assert load_config(EXPERIMENTS / "wiki4.yaml").stage2.d2d_teacher == "../shared/teachers/qwen3dense-wiki4"
    with pytest.raises(
        M2DError, match="no stage2.d2d_teacher: give the dense model matched to ../shared/teachers/qwen3moe-wiki4"
    ):
        _checked(EXPERIMENTS / "wiki4.yaml", "stage2.d2d_teacher=null")
    with pytest.raises(M2DError, match="d2d_teacher is set but d2d is not in stage2.baselines"):
        _checked(EXPERIMENTS / "tiny.yaml", "stage2.baselines=[random-init]", "stage2.d2d_teacher=some/dense")
    assert main(["sweep", str(EXPERIMENTS / "tiny.yaml"), "stage2.baselines=[d2]", "--out", "/nonexistent/x"]) == 2


def test_K_outside_range():
    with pytest.raises(M2DError, match=r"outside \[k, E\] = \[2, 16\]"):
        k_values((2, 32), 2, 16)
    with pytest.raises(M2DError, match="outside"):
        k_values((1,), 2, 16)


def test_bad_yaml_files(tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.yaml").write_text("grid: [unclosed\n")
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    for name, msg in [
        ("list.yaml", "must be a mapping"),
        ("broken.yaml", "not valid YAML"),
        ("a.yaml", "include cycle"),
        ("missing.yaml", "not found"),
    ]:
        with pytest.raises(M2DError, match=msg):
            load_config(tmp_path / name)


def test_cli_sweep_rejects_bad_config_before_writing(capsys, tmp_path):
    out = tmp_path / "run"
    code = main(["sweep", str(EXPERIMENTS / "tiny.yaml"), "--out", str(out), "grid.scoring=[sf,cpp]"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "did you mean" in err and "'cp'" in err
    code = main(["sweep", str(EXPERIMENTS / "tiny.yaml"), "--out", str(out), "grid.K=[2,64]"])
    err = capsys.readouterr().err
    assert code == 2 and "outside [k, E] = [2, 16]" in err
    assert not out.exists()
    assert main(["sweep", "--resume", str(out)]) == 2 and "is not an m2d run directory" in capsys.readouterr().err


def test_a_relative_d2d_teacher_reaches_ray_workers_as_an_absolute_path(tmp_path, monkeypatch):
    """Ray Train runs trials in their own directories: `d2d_teacher: ../shared/…` relative to where m2d was started
    failed there ("model … not found") until the driver made it absolute."""
    import os

    from m2d_ray.models import default_dense_teacher
    from m2d_ray.stages.baselines import BASELINES

    monkeypatch.chdir(tmp_path)
    rel = os.path.relpath(default_dense_teacher(), tmp_path)
    cfg = load_config(EXPERIMENTS / "tiny.yaml", [f"stage2.d2d_teacher={rel}"])
    assert not Path(cfg.stage2.d2d_teacher).is_absolute()
    assert BASELINES["d2d"].teacher(cfg) == str(Path(default_dense_teacher()).resolve())


def test_every_unit_kind_has_a_start_on_cpus_and_a_measured_one_on_a_gpu():
    """The unit kinds are names (catalog/units.py): plan.<unit>_s on CPUs, measured_gpu.json's start_s on a GPU."""
    from m2d_ray import measured
    from m2d_ray.catalog.units import UNITS
    from m2d_ray.config import PlanConfig

    plan = PlanConfig()
    assert set(measured.gpu().start_s) == set(UNITS)
    assert [plan.start_s(u, gpu=False) for u in UNITS] == [plan.actor_s, plan.trial_s, plan.student_s, plan.model_s]
    assert all(plan.start_s(u, gpu=True) == measured.gpu().start_s[u] for u in UNITS)


def test_distill_gradient_checkpointing_of_earlier_versions_reads_as_checkpointing(capsys):
    """A saved run's distill.gradient_checkpointing keeps running: true is full, false none, said in one line; with
    both keys, or a value that is no boolean, one line asks for distill.checkpointing."""
    assert load_config(None, ["distill.gradient_checkpointing=true"]).distill.checkpointing == "full"
    assert load_config(None, ["distill.gradient_checkpointing=false"]).distill.checkpointing == "none"
    assert capsys.readouterr().err.count("is read as distill.checkpointing=") == 2
    for bad in (
        ["distill.gradient_checkpointing=true", "distill.checkpointing=none"],
        ["distill.gradient_checkpointing=2"],
    ):
        with pytest.raises(M2DError, match="distill.checkpointing"):
            load_config(None, bad)
    with pytest.raises(M2DError, match="did you mean 'selective'"):
        load_config(None, ["distill.checkpointing=selectiv"])
    assert load_config(None).distill.checkpointing == "auto"


def test_a_shipped_config_is_found_by_name_and_copied_out_with_its_base(tmp_path, monkeypatch, capsys):
    """`m2d run tiny` from any directory: a file that exists wins, else a shipped name; `m2d cp` writes a copy that
    reads as the original (its include beside it) and never overwrites a file."""
    from m2d_ray.shipped import configs

    monkeypatch.chdir(tmp_path)
    assert load_config("tiny") == load_config("tiny.yaml") == load_config(EXPERIMENTS / "tiny.yaml")
    assert "_paper" not in configs() and {"tiny", "smoke", "qwen3_30b_a3b"} <= set(configs())
    with pytest.raises(M2DError, match="did you mean qwen3_30b_a3b"):
        load_config("qwen3_30b_a3")
    assert main(["cp", "qwen3_30b_a3b", "mine.yaml"]) == 0
    assert (tmp_path / "_paper.yaml").read_text() == (EXPERIMENTS / "_paper.yaml").read_text()
    assert load_config("mine.yaml") == load_config("qwen3_30b_a3b")
    (tmp_path / "tiny.yaml").write_text("name: mine\n")
    assert load_config("tiny.yaml").name == "mine"  # the file here, not the shipped one
    capsys.readouterr()
    assert main(["cp", "tiny", "."]) == 2 and "never overwrites" in capsys.readouterr().err
    assert main(["configs"]) == 0 and "tiny  " in capsys.readouterr().out
