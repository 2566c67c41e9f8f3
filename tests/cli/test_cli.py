"""The `m2d` command line: end to end on a tiny teacher, and clean one-line failures on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

from m2d_ray.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    from m2d_ray.data.synthetic import corpus_text

    p = tmp_path_factory.mktemp("data") / "calib.txt"
    p.write_text(corpus_text("valid", max_chars=20_000))
    return p


def _calibrate(model, data, out) -> list[str]:
    """`m2d calibrate` of `model` on the text file `data` (2,048 tokens in 64-token sequences) into `out`."""
    return [
        "calibrate",
        "--model",
        str(model),
        "--calib-data",
        str(data),
        "--max-tokens",
        "2048",
        "--seq-len",
        "64",
        "--out",
        str(out),
    ]


@pytest.fixture(scope="module")
def stats_dir(tiny_teacher_dir, calib_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("stats") / "stats"
    assert main(_calibrate(tiny_teacher_dir, calib_file, out)) == 0
    return out


def test_calibrate_then_convert_prints_plan_and_ppl(capsys, tiny_teacher_dir, stats_dir, tmp_path):
    out_dir = tmp_path / "student"
    code, out, err = run(
        capsys,
        "convert",
        "--model",
        str(tiny_teacher_dir),
        "--stats",
        str(stats_dir),
        "--scoring",
        "do-acp",
        "--grouping",
        "oc",
        "--scaling",
        "proportional",
        "--K",
        "4",
        "--eval-data",
        "synthetic:test",
        "--out",
        str(out_dir),
    )
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["dense_class"] == "Qwen3ForCausalLM" and result["K"] == 4
    assert set(result["selected"]) == {"0", "1"} and all(len(v) == 4 for v in result["selected"].values())
    assert len(result["groups"]["0"]) == 2 and sorted(sum(result["groups"]["0"], [])) == sorted(result["selected"]["0"])
    assert result["perplexity"]["ppl"] > 1 and not result["perplexity"]["diverged"]
    assert result["max_rel_error"] < 1e-10
    assert "layer 0: experts" in err
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert type(AutoModelForCausalLM.from_pretrained(out_dir)).__name__ == "Qwen3ForCausalLM"
    AutoTokenizer.from_pretrained(out_dir)


def test_calibrate_reuses_matching_stats(capsys, tiny_teacher_dir, calib_file, stats_dir):
    code, out, _ = run(capsys, *_calibrate(tiny_teacher_dir, calib_file, stats_dir))
    assert code == 0 and json.loads(out)["reused"] is True


def test_baseline_convert(capsys, tiny_teacher_dir, tmp_path):
    code, out, err = run(
        capsys, "convert", "--model", str(tiny_teacher_dir), "--baseline", "random-ffn", "--out", str(tmp_path / "b")
    )
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["baseline"] == "random-ffn"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("llama") / "llama"
    LlamaForCausalLM(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    ).save_pretrained(d)
    return d


BAD = {
    "K below k": (["--K", "1"], "outside [k, E]"),
    "K above E": (["--K", "9"], "outside [k, E]"),
    "unknown scoring": (["--scoring", "do_acp"], "did you mean 'do-acp'"),
    "unknown grouping": (["--grouping", "kmeans"], "unknown grouping"),
    "unknown scaling": (["--scaling", "proportionl"], "did you mean 'proportional'"),
    "unknown baseline": (["--baseline", "random"], "unknown baseline"),
    "missing calib path": (["--calib-data", "/nonexistent/calib.txt"], "neither a file"),
    "missing stats dir": (["--stats", "/nonexistent/stats"], "not a statistics directory"),
    "missing model": (["--model", "/nonexistent/model"], "not found"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_fails_with_one_line_and_writes_nothing(capsys, tiny_teacher_dir, tmp_path, case):
    extra, message = BAD[case]
    args = ["convert", "--model", str(tiny_teacher_dir), "--out", str(tmp_path / "out"), *extra]
    code, out, err = run(capsys, *args)
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("m2d: error:")]
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text,message", [("", "empty"), ("the court", "at least")])
def test_empty_or_short_calibration_text(capsys, tiny_teacher_dir, tmp_path, text, message):
    p = tmp_path / "c.txt"
    p.write_text(text)
    code, _, err = run(
        capsys, "calibrate", "--model", str(tiny_teacher_dir), "--calib-data", str(p), "--out", str(tmp_path / "s")
    )
    assert code == 2 and message in err
    assert not (tmp_path / "s").exists()


def test_non_moe_model_lists_supported_types(capsys, llama_dir, tmp_path):
    code, _, err = run(capsys, "convert", "--model", str(llama_dir), "--out", str(tmp_path / "o"))
    assert code == 2 and "'llama' is not a Mixture-of-Experts family m2d converts" in err and "m2d families" in err
    assert "did you mean" not in err  # llama4_text is a near name, not this model's family


def test_m2d_families_lists_every_family_converted_and_refused(capsys):
    code, out, _ = run(capsys, "families")
    names = {line.split()[0] for line in out.splitlines()}
    assert code in (0, None) and {"qwen3_moe", "glm4_moe", "minimax_m2", "nemotron_h", "phimoe", "zaya"} <= names
    assert any(line.startswith("phimoe") and "sparsemixer" in line for line in out.splitlines())


def test_console_script_exit_code(tmp_path):
    """The installed `m2d` entry point (argparse errors and ours both exit 2)."""
    r = subprocess.run(
        [sys.executable, "-m", "m2d_ray.cli", "convert", "--out", str(tmp_path / "o"), "--K", "0"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "must be positive" in r.stderr


def test_platform_lines_start_a_line_of_their_own_in_the_log(tmp_path):
    """Library output can leave a partial line in the log; the platform's lines still read as '[m2d] …' lines."""
    from m2d_ray import console

    with console.session("probe"):
        console.keep_logs_in(tmp_path)
        console._session.write_log(b"2026-11-23 INFO a library line without its newline")
        console.say("== stage1 ==")
        warnings.warn("a library warning", DeprecationWarning, stacklevel=2)
    lines = next(tmp_path.glob("m2d-probe-*.log")).read_text().splitlines()
    assert "[m2d] == stage1 ==" in lines
    assert any(ln.startswith("[m2d] m2d: 1 library warning, all in ") for ln in lines), lines


def test_a_flag_that_is_a_config_key_takes_the_key_s_default_and_doc():
    """Each default is written once, in the config dataclasses: the flags read theirs (and their help) from there."""
    from m2d_ray.cli import parser
    from m2d_ray.config import AnalysisConfig, CalibConfig, Stage3Config, docs

    p = parser()
    calib = p.parse_args(["calibrate", "--out", "o"])
    assert (calib.max_tokens, calib.seq_len, calib.batch_size) == (
        CalibConfig.max_tokens,
        CalibConfig.seq_len,
        CalibConfig.batch_size,
    )
    assert p.parse_args(["eval", "--model", "m"]).batch_size == Stage3Config.batch_size
    analyze = p.parse_args(["analyze", "--responses", "r.jsonl", "--out", "o"])
    for key in ("per_subject", "max_new_tokens", "temperature", "seed", "batch_size", "judge_rate", "max_unjudged"):
        assert getattr(analyze, key) == getattr(AnalysisConfig, key), key
    sub = next(a for a in p._actions if a.dest == "command").choices
    helps = {a.dest: a.help for a in sub["calibrate"]._actions}
    assert helps["max_tokens"].startswith(docs(CalibConfig)["max_tokens"]) and "32768" in helps["max_tokens"]
    steps = next(a for a in sub["distill"]._actions if a.dest == "steps")
    assert steps.default is None and "distill.steps: 200" in steps.help  # an override: given or the config's


def test_m2d_analyze_reads_the_settings_the_stage_reads():
    """The command's flags become the stage's AnalysisConfig, so the openai judge gets judge_rate and judge_retries
    from either place, and its defaults are the config's."""
    from m2d_ray.cli import parser
    from m2d_ray.commands.analyze import settings
    from m2d_ray.config import AnalysisConfig
    from m2d_ray.evaluate.judges import OpenAIJudge

    args = parser().parse_args(
        ["analyze", "--responses", "r.jsonl", "--out", "o", "--judge-rate", "0.5", "--judge-retries", "0"]
    )
    a = settings(args)
    assert a == AnalysisConfig(judge="none", judge_rate=0.5, judge_retries=0)
    judge = OpenAIJudge.configured("m", a)
    assert (judge.rate, judge.retries, judge.url) == (0.5, 0, AnalysisConfig.judge_url)
    assert OpenAIJudge("m").max_tokens == AnalysisConfig.judge_max_tokens


def test_the_cli_writes_at_most_three_literal_defaults():
    """A default that is a config key's is read from the config (issue 57): cli.py keeps literals only for the
    flags of no config key."""
    import ast

    from conftest import ROOT

    tree = ast.parse((ROOT / "m2d_ray" / "cli.py").read_text())
    literals = [
        ast.unparse(k.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for k in node.keywords
        if k.arg == "default" and isinstance(k.value, (ast.Constant, ast.List, ast.Tuple, ast.Dict))
    ]
    assert len(literals) <= 3, literals


def test_the_plan_says_its_checkpointing_decision_once(capsys):
    """distill.checkpointing=auto: the plan's decision, with what each policy tried needs, is one console line, in
    `m2d plan` and in the check `m2d run` makes before any work."""
    from m2d_ray.commands.plan import check_run
    from m2d_ray.config import load_config

    assert main(["plan", "tiny"]) == 0
    out = capsys.readouterr()
    assert (out.out + out.err).count("distill.checkpointing=auto: none (none: fits)") == 1, out
    assert check_run(load_config("tiny")).decided == {"distill.checkpointing": "none", "distill.zero_stage": "2"}
    out = capsys.readouterr()
    assert (out.out + out.err).count("distill.checkpointing=auto: none (none: fits)") == 1, out
