"""`m2d` command line: parsing only; the work is in pipeline.py."""

from __future__ import annotations

import argparse
import json
import sys

from m2d_ray.errors import M2DError


def _positive(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{v!r} is not an integer") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{v!r} must be positive")
    return n


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="teacher directory or hub name (default: the embedded tiny Qwen3-MoE)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def _add_calib(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calib-data", default=None, help="text file, synthetic[:split] or wikitext2[:split] (default: the embedded corpus for the embedded teacher, else wikitext2:train)")
    p.add_argument("--max-tokens", type=_positive, default=32768, help="calibration tokens (default 32768)")
    p.add_argument("--seq-len", type=_positive, default=256, help="calibration sequence length (default 256)")
    p.add_argument("--batch-size", type=_positive, default=8)
    p.add_argument("--max-memory", default=None, help="memory the teacher may take on the device, e.g. 40GB; a bigger teacher is "
                   "streamed layer by layer (default: the device's free memory)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="force (--stream) or forbid (--no-stream) layer-streamed calibration")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="m2d", description="Turn a Mixture-of-Experts LM into a dense one.")
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="one pass of calibration statistics -> a stats artifact")
    _add_model(c)
    _add_calib(c)
    c.add_argument("--out", required=True, help="statistics directory to write")

    v = sub.add_parser("convert", help="score, select, group, merge and export a dense student")
    _add_model(v)
    _add_calib(v)
    v.add_argument("--stats", default=None, help="statistics directory (read; written when --calib-data is also given)")
    v.add_argument("--scoring", default="do-acp", help="sf pp ps cp acp do-cp do-acp (default do-acp)")
    v.add_argument("--grouping", default="rr", help="rr wc rc ab oc (default rr)")
    v.add_argument("--scaling", default="uniform", help="uniform proportional avg-cp (default uniform)")
    v.add_argument("--K", type=_positive, default=None, help="experts kept per layer, k <= K <= E (default k)")
    v.add_argument("--baseline", default=None, help="random-ffn or random-init instead of a conversion")
    v.add_argument("--eval-data", default=None, help="measure perplexity on: text file, synthetic[:split] or wikitext2[:split]")
    v.add_argument("--out", required=True, help="directory for the dense student")

    w = sub.add_parser("sweep", help="stage 1 on Ray: the scoring x grouping x scaling x K grid by pre-distillation perplexity")
    w.add_argument("config", nargs="?", default=None, help="YAML config (experiments/*.yaml); not needed with --resume")
    w.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. grid.K=[2,4] grid.scoring=[sf,do-acp]")
    w.add_argument("--model", default=None, help="overrides `model:`")
    w.add_argument("--calib-data", default=None, help="overrides `calib.data`")
    w.add_argument("--eval-data", default=None, help="overrides `eval.data`")
    w.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>)")
    w.add_argument("--resume", default=None, metavar="RUN_DIR", help="finish a killed or interrupted sweep")
    w.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///RUN_DIR/mlflow.db)")

    r = sub.add_parser("run", help="the whole pipeline: calibrate, stage 1, stage 2 (distil), stage 3 (lm-eval), report")
    r.add_argument("config", nargs="?", default=None, help="YAML config (experiments/*.yaml); not needed with --resume")
    r.add_argument("overrides", nargs="*", default=[], help="key=value overrides, e.g. distill.steps=30 stage3.limit=50")
    r.add_argument("--out", default=None, help="run directory (default runs/<name>-<time>)")
    r.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a killed or interrupted run, stage by stage")
    r.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///RUN_DIR/mlflow.db)")

    rp = sub.add_parser("report", help="RUN_DIR/report/index.html + tables (CSV/Markdown) + figures (PNG) of a run")
    rp.add_argument("run_dir", help="a run directory (m2d run / m2d sweep --out)")
    rp.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default sqlite:///RUN_DIR/mlflow.db)")

    d = sub.add_parser("distill", help="distil one dense student from its MoE teacher (Ray Train + DeepSpeed)")
    d.add_argument("--teacher", default=None, help="teacher directory or hub name (default: the embedded tiny Qwen3-MoE)")
    d.add_argument("--student", required=True, help="initial student directory (m2d convert --out), or random-ffn / random-init")
    d.add_argument("--train-data", default=None, help="fineweb-edu (streamed), hf:NAME[:CONFIG[:SPLIT]], a text / .jsonl / .parquet file, synthetic:train")
    d.add_argument("--eval-data", required=True, help="validation text: a file, synthetic[:split] or wikitext2[:split]")
    d.add_argument("--steps", type=_positive, default=None)
    d.add_argument("--loss", default=None, help="fkl (default), rkl or fkl+mse")
    d.add_argument("--teacher-topk", type=_positive, default=None, help="expanded teacher routing k' (k <= k' <= E)")
    d.add_argument("--deepspeed", action=argparse.BooleanOptionalAction, default=None, help="DeepSpeed ZeRO-2 (default on)")
    d.add_argument("--workers", type=_positive, default=None, help="Ray Train workers")
    d.add_argument("--config", default=None, help="YAML whose distill: section gives the defaults (experiments/*.yaml)")
    d.add_argument("overrides", nargs="*", default=[], help="more distill settings as key=value, e.g. lr=3e-3 seq_len=256 eval_every=20")
    d.add_argument("--out", required=True, help="run directory: student/, train/ (checkpoints), metrics.jsonl, result.json")

    e = sub.add_parser("eval", help="lm-eval benchmarks of one model (a student or a teacher), offline with --tasks local")
    e.add_argument("--model", required=True, help="model directory or hub name")
    e.add_argument("--tasks", default="local", help="local (offline, default), text:PATH (offline, from a WikiText-style file), paper (Winogrande 5, HellaSwag 10, ARC-E 25, ARC-C 25, MMLU 5) or task[:shots],…")
    e.add_argument("--num-fewshot", type=int, default=None, help="shots for every task (default: the suite's own)")
    e.add_argument("--limit", type=_positive, default=None, help="examples per task (a quick look)")
    e.add_argument("--batch-size", type=_positive, default=16)
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return ap


KV_COMMANDS = ("sweep", "run", "distill")  # commands whose key=value overrides may follow the options


def _distill_overrides(args) -> list[str]:
    flags = {"train_data": args.train_data, "steps": args.steps, "loss": args.loss, "teacher_topk": args.teacher_topk,
             "deepspeed": args.deepspeed, "workers": args.workers}
    return [*args.overrides, *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in flags.items() if v is not None)]


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, extra = ap.parse_known_args(argv)
    if args.command in KV_COMMANDS and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra  # key=value overrides may follow the options
    elif extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command in ("sweep", "run") and args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.config)  # `m2d sweep --resume RUN_DIR stage=2`: no config, only overrides
        args.config = None
    try:
        from m2d_ray import pipeline

        calib = {k: getattr(args, k) for k in ("max_tokens", "seq_len", "batch_size", "max_memory", "stream") if hasattr(args, k)}
        if args.command == "calibrate":
            _, art, reused = pipeline.run_calibrate(args.model, args.calib_data, args.out, device=args.device, **calib)
            m = art.manifest
            print(json.dumps({"out": args.out, "reused": reused, "n_tokens": m["n_tokens"], "layers": m["layers"], "num_experts": m["num_experts"], "sha256": m["sha256"]}))
        elif args.command == "convert":
            result = pipeline.convert_one(
                args.model, args.scoring, args.grouping, args.scaling, args.K, args.out,
                stats=args.stats, calib_data=args.calib_data, eval_data=args.eval_data,
                baseline=args.baseline, device=args.device, calib_kwargs=calib,
            )
            for layer, sel in result.get("selected", {}).items():
                print(f"layer {layer}: experts {sel} groups {result['groups'][layer]}", file=sys.stderr)
            print(json.dumps(result))
        elif args.command == "sweep":
            result = pipeline.sweep(
                args.config, args.overrides, out=args.out, resume=args.resume, tracking_uri=args.tracking_uri,
                model=args.model, calib_data=args.calib_data, eval_data=args.eval_data,
            )
            print(json.dumps(result))
        elif args.command == "run":
            result = pipeline.run(args.config, args.overrides, out=args.out, resume=args.resume, tracking_uri=args.tracking_uri)
            print(f"report: {result['report']}\nMLflow UI: {result['mlflow_ui']}  (then open http://127.0.0.1:5000)", file=sys.stderr)
            print(json.dumps(result))
        elif args.command == "report":
            result = pipeline.report(args.run_dir, args.tracking_uri)
            print(f"report: {result['report']}", file=sys.stderr)
            print(json.dumps(result))
        elif args.command == "eval":
            result = pipeline.evaluate_one(args.model, args.tasks, args.num_fewshot, args.limit, args.batch_size, args.device)
            for name, r in result["tasks"].items():
                print(f"{name} ({r['shots']}-shot): {r['score']}", file=sys.stderr)
            print(json.dumps(result))
        elif args.command == "distill":
            result = pipeline.distill_one(args.teacher, args.student, args.out, args.eval_data, config=args.config, overrides=_distill_overrides(args))
            print(json.dumps(result))
    except M2DError as exc:
        print(f"m2d: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("m2d: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
