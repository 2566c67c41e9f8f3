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
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, extra = ap.parse_known_args(argv)
    if args.command == "sweep" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra  # key=value overrides may follow the options
    elif extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        from m2d_ray import pipeline

        calib = {k: getattr(args, k) for k in ("max_tokens", "seq_len", "batch_size") if hasattr(args, k)}
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
    except M2DError as exc:
        print(f"m2d: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("m2d: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
