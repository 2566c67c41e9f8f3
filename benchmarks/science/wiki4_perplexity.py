"""Pre-distillation perplexity of every scoring on the real-text teacher ../shared/teachers/qwen3moe-wiki4.

Calibrate once (`commands.calibrate.run_calibrate` on wiki.valid.tokens; the statistics are cached under
--cache so reruns reuse them), then for each of the 7 scorings at K = k and K = 2k, grouping rr, scaling
uniform, build the dense student (`make_plan` + `build_from_plan`, no export) and measure its perplexity
on wiki.test.raw with `commands.convert.evaluate_ppl` (first 300,000 characters, non-overlapping 256-token
windows: the protocol of the teacher's eval.json). Also the teacher itself and the two baselines
(random FFN with the teacher's attention, random init). Prints a Markdown table and the mean effective
rank of the selected experts per scoring at K = k. Skips with a message when the teacher is absent.

    python -m benchmarks.science.wiki4_perplexity [--max-tokens 65536] [--seq-len 256] [--cache DIR] [--threads 1]

--threads defaults to 1: perplexity does not depend on it, and on a 2-core machine shared with another
busy process 2 OpenMP threads make this small model's forward tens of times slower.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import TEACHER_DIR, WIKI_TEST, WIKI_VALID, machine_line

SCORINGS = ("sf", "pp", "ps", "cp", "acp", "do-cp", "do-acp")


def fmt(p) -> str:
    return "diverged" if p.diverged else f"{p.ppl:,.1f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--cache", default="/tmp/m2d_bench_stats/qwen3moe-wiki4")
    p.add_argument("--grouping", default="rr")
    p.add_argument("--scaling", default="uniform")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("# Real-teacher perplexity table")
    print(machine_line())
    if not TEACHER_DIR.exists() or not WIKI_VALID.exists() or not WIKI_TEST.exists():
        print(f"SKIPPED: {TEACHER_DIR}, {WIKI_VALID} or {WIKI_TEST} absent")
        return

    from m2d_ray.catalog.methods import RANDOM_BASELINES
    from m2d_ray.commands.calibrate import run_calibrate
    from m2d_ray.commands.convert import evaluate_ppl
    from m2d_ray.convert.build import build_from_plan
    from m2d_ray.convert.plan import make_plan

    t0 = time.perf_counter()
    teacher, art, reused = run_calibrate(
        str(TEACHER_DIR), str(WIKI_VALID), args.cache, max_tokens=args.max_tokens, seq_len=args.seq_len, device="cpu"
    )
    k, E = teacher.adapter.top_k(teacher.config), teacher.adapter.num_experts(teacher.config)
    print(
        f"calibration: {art.manifest['n_tokens']} tokens, {len(art.layers)} MoE layers, E={E}, k={k}, "
        f"{'reused' if reused else 'computed'} in {time.perf_counter() - t0:.1f} s -> {args.cache}"
    )
    eval_spec = str(WIKI_TEST)

    def ppl(model):
        return evaluate_ppl(model, teacher.tokenizer, eval_spec, seq_len=args.seq_len)

    t = time.perf_counter()
    teacher_ppl = ppl(teacher.model)
    eval_s = time.perf_counter() - t
    print(
        f"teacher: ppl {fmt(teacher_ppl)} over {teacher_ppl.tokens} predicted tokens, {teacher_ppl.windows} windows "
        f"({eval_s:.1f} s)"
    )

    Ks = (k, 2 * k)
    res: dict[str, dict[int, object]] = {}
    erank: dict[str, float] = {}
    for scoring in SCORINGS:
        res[scoring] = {}
        for K in Ks:
            plan = make_plan(teacher, art.layers, scoring, args.grouping, args.scaling, K)
            student = build_from_plan(teacher, plan)
            res[scoring][K] = ppl(student)
            if K == k:
                erank[scoring] = sum(lp.erank for lp in plan.layers.values()) / len(plan.layers)
            print(f"  {scoring:7s} K={K}: ppl {fmt(res[scoring][K])}")
            del student
    base = {}
    for name in ("random-ffn", "random-init"):
        base[name] = ppl(RANDOM_BASELINES[name](teacher))
        print(f"  {name}: ppl {fmt(base[name])}")

    print()
    print(
        f"Perplexity on wiki.test.raw (first 300,000 chars, {args.seq_len}-token windows, {teacher_ppl.tokens} "
        "predicted tokens); "
        f"grouping {args.grouping}, scaling {args.scaling}; calibration {art.manifest['n_tokens']} tokens of "
        "wiki.valid.tokens"
    )
    print()
    print(f"| scoring | K={Ks[0]} (=k) | K={Ks[1]} (=2k) | mean erank at K={k} |")
    print("|---|---|---|---|")
    for scoring in SCORINGS:
        print(f"| {scoring} | {fmt(res[scoring][Ks[0]])} | {fmt(res[scoring][Ks[1]])} | {erank[scoring]:.2f} |")
    print(f"| teacher (MoE) | {fmt(teacher_ppl)} | | |")
    for name, v in base.items():
        print(f"| baseline {name} | {fmt(v)} | | |")
    best = min(SCORINGS, key=lambda s: min(res[s][K].ppl for K in Ks))
    print(f"\nbest scoring: {best}; ordering at K={k}: " + " < ".join(sorted(SCORINGS, key=lambda s: res[s][k].ppl)))
    print(f"ordering at K={2 * k}: " + " < ".join(sorted(SCORINGS, key=lambda s: res[s][2 * k].ppl)))
    print(f"total {time.perf_counter() - t0:.1f} s")
    print(machine_line())
    if args.json:
        out = {
            "teacher": teacher_ppl.to_json(),
            "baselines": {n: v.to_json() for n, v in base.items()},
            "scorings": {s: {str(K): res[s][K].to_json() for K in Ks} for s in SCORINGS},
            "erank_at_k": erank,
            "calibration_tokens": art.manifest["n_tokens"],
            "grouping": args.grouping,
            "scaling": args.scaling,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
