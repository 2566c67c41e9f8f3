"""P1: calibration-statistics throughput, batched all-expert path vs a per-expert Python loop.

Our path (`m2d_ray.calibrate.stats.layer_stats`, driven by `collect_stats`'s forward pre-hooks) runs
every expert on every token with one stacked gate/up GEMM, one batched down bmm and one Gram GEMM per
token chunk. The baseline is how REAP / HC-SMoE style tooling observes experts: a hook on the MoE
block that, for every batch, loops over the E experts in Python and runs each one separately on all
tokens exactly as transformers' eager experts do (`F.linear(h, gate_up_proj[e]).chunk(2)`, act,
`F.linear(., down_proj[e])`), accumulating each expert's count / prob sums as it goes and collecting
its output. The Gram is then formed from the collected outputs in one of two forms (--loop-gram):

* ``stack`` (default, the strongest loop baseline): stack the E per-expert outputs and do one
  [E, T*d] @ [T*d, E] GEMM, so only the expert computation is looped;
* ``pairwise``: one dot product per expert pair (i <= j), what a per-expert-hook implementation that
  never materialises the stack does.

Both Grams are formed in the same precision as ours (`gram_dtype`: float64 on CPU, float32 products
summed in float64 on CUDA), so the comparison isolates the loop structure. Both paths see the same
block, the same tokens and the same batches; the script checks that they produce the same statistics
(Gram rel err < 1e-5 in fp32; counts / prob sums equal).

FLOPs counted for "our GFLOP/s": the statistics only, i.e. expert GEMMs 2*T*E*3*I*d plus the Gram
2*E^2*T*d (router, activation and the casts are not counted). In the model mode the model's own forward
(its sparse top-k experts, attention, head) is timed separately without hooks and subtracted, so the
stats-only rate = counted FLOPs / (t_with_stats - t_forward).

Modes
  (default)  the real-text teacher ../shared/teachers/qwen3moe-wiki4 on wiki.valid.tokens (skipped with
             a message when absent) + one synthetic layer shaped like a scaled-down Qwen3-30B-A3B layer
             (d 1024, I 384, E 64, k 8, fp32 random weights) timing only the layer statistics.
  --gpu      one full-size Qwen3-30B-A3B-shaped layer (d 2048, I 768, E 128, k 8, random bf16 weights,
             >= 32k tokens) on CUDA against the bf16 matmul rate. NOT RUN in the session that wrote this
             script (no GPU was available): it is written to work but is untested.

    python -m benchmarks.perf.calibration_stats [--tokens N] [--layer-tokens N] [--repeats R] [--loop-gram
        stack|pairwise|both]
    python -m benchmarks.perf.calibration_stats --gpu [--layer-tokens 32768]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import TEACHER_DIR, WIKI_VALID, interleaved, machine_line, matmul_gflops
from m2d_ray.arch.base import rel_error
from m2d_ray.arch.qwen3_moe import Qwen3MoeAdapter
from m2d_ray.calibrate.collect import collect_stats
from m2d_ray.calibrate.stats import LayerStats, gram_dtype, layer_stats


# --------------------------------------------------------------------------------------------
# The baseline: a Python loop over experts, transformers-eager style.
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def loop_layer_stats(block: nn.Module, h: Tensor, gram_mode: str = "stack") -> LayerStats:
    """Statistics of one Qwen3-MoE-style block (fused gate_up_proj / down_proj) on tokens h [T, d],
    one expert at a time."""
    ex = block.experts
    E = ex.gate_up_proj.shape[0]
    st = LayerStats.zeros(E, device=h.device)
    logits, weight, index = block.gate(h)  # the model's own router, as a hook sees it
    probs = torch.softmax(logits.float(), dim=-1)
    st.tokens += h.shape[0]
    gdt = gram_dtype(h.device)
    outs: list[Tensor] = []
    for e in range(E):
        hit = index == e  # [T, k]
        sel = hit.any(-1)
        st.count[e] += sel.sum().double()
        st.psum[e] += probs[:, e].double().sum()
        st.psel[e] += probs[sel, e].double().sum()
        st.wsel[e] += (weight * hit).double().sum()
        gate, up = F.linear(h, ex.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(ex.act_fn(gate) * up, ex.down_proj[e])  # f_e(h), [T, d]
        outs.append(y.reshape(-1).to(gdt))
    if gram_mode == "stack":
        Y = torch.stack(outs)
        st.gram += (Y @ Y.T).double()
    elif gram_mode == "pairwise":
        for i in range(E):
            for j in range(i, E):
                v = torch.dot(outs[i], outs[j]).double()
                st.gram[i, j] += v
                if j != i:
                    st.gram[j, i] += v
    else:
        raise ValueError(gram_mode)
    return st


@torch.no_grad()
def collect_stats_loop(
    model, adapter, ids: Tensor, mask: Tensor, batch_size: int = 8, gram_mode: str = "stack"
) -> dict[int, LayerStats]:
    """`collect_stats` with the per-expert loop in the hooks (same forward pre-hooks, same masking)."""
    blocks = adapter.moe_blocks(model)
    device = next(model.parameters()).device
    stats = {i: LayerStats.zeros(adapter.num_experts(model.config), device=device) for i in blocks}
    current: dict[str, Tensor] = {}

    def hook(layer: int):
        def fn(module, args):
            h = args[0]
            keep = current["mask"].reshape(-1).bool()
            stats[layer].add_(loop_layer_stats(module, h.reshape(-1, h.shape[-1])[keep], gram_mode))

        return fn

    handles = [b.register_forward_pre_hook(hook(i)) for i, b in blocks.items()]
    try:
        for start in range(0, ids.shape[0], batch_size):
            current["mask"] = mask[start : start + batch_size].to(device)
            model(input_ids=ids[start : start + batch_size].to(device), attention_mask=current["mask"], use_cache=False)
    finally:
        for hd in handles:
            hd.remove()
    return stats


@torch.no_grad()
def forward_only(model, ids: Tensor, mask: Tensor, batch_size: int = 8) -> None:
    device = next(model.parameters()).device
    for start in range(0, ids.shape[0], batch_size):
        model(
            input_ids=ids[start : start + batch_size].to(device),
            attention_mask=mask[start : start + batch_size].to(device),
            use_cache=False,
        )


def stats_flops(T: int, E: int, I: int, d: int) -> float:
    """Counted FLOPs of the statistics of one layer: expert GEMMs + Gram."""
    return 2.0 * T * E * 3 * I * d + 2.0 * E * E * T * d


def compare(a: LayerStats, b: LayerStats) -> dict[str, float]:
    return {
        "gram": rel_error(a.gram, b.gram),
        "count": rel_error(a.count, b.count),
        "psum": rel_error(a.psum, b.psum),
        "psel": rel_error(a.psel, b.psel),
        "wsel": rel_error(a.wsel, b.wsel),
    }


def table(rows: list[tuple], header: tuple) -> str:
    cells = [tuple(str(c) for c in r) for r in [header, *rows]]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        return "| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |"

    return "\n".join([line(cells[0]), "|" + "|".join("-" * (x + 2) for x in w) + "|", *map(line, cells[1:])])


# --------------------------------------------------------------------------------------------
# Synthetic layer
# --------------------------------------------------------------------------------------------
def synthetic_block(d: int, I: int, E: int, k: int, dtype: torch.dtype, device: str, seed: int = 0) -> nn.Module:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from m2d_ray.arch.qwen3_moe import moe_config

    cfg = moe_config(hidden=d, expert_width=I, experts=E, top_k=k)
    block = Qwen3MoeSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(E, d, generator=g) / d**0.5)
        block.experts.gate_up_proj.copy_(torch.randn(E, 2 * I, d, generator=g) / d**0.5)
        block.experts.down_proj.copy_(torch.randn(E, d, I, generator=g) / I**0.5)
    return block.to(device=device, dtype=dtype).eval()


def run_layer(
    args, d: int, I: int, E: int, k: int, T: int, dtype: torch.dtype, device: str, mm_rate: float, tol: float
) -> list[str]:
    adapter = Qwen3MoeAdapter()
    block = synthetic_block(d, I, E, k, dtype, device)
    h = torch.randn(T, d, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    batches = [
        h[s : s + args.batch_tokens] for s in range(0, T, args.batch_tokens)
    ]  # what a hook sees per forward batch
    weights = adapter.experts(block)

    def ours():
        st = LayerStats.zeros(E, device=device)
        for b in batches:
            st.add_(layer_stats(adapter, block, b, weights))
        return st

    def loop(mode):
        def fn():
            st = LayerStats.zeros(E, device=device)
            for b in batches:
                st.add_(loop_layer_stats(block, b, mode))
            return st

        return fn

    print(
        f"\n## Synthetic layer: d={d} I={I} E={E} k={k}, T={T} tokens in batches of {args.batch_tokens}, {dtype}, "
        f"{device}"
    )
    modes = ["stack", "pairwise"] if args.loop_gram == "both" else [args.loop_gram]
    fns = {"ours": ours, **{m: loop(m) for m in modes}}
    timed = interleaved(fns, args.repeats, device, warmup=1 if device == "cuda" else 0)
    t_ours, st_ours = timed["ours"]
    rows, out = [], []
    flops = stats_flops(T, E, I, d)
    gf = flops / t_ours / 1e9
    rows.append(("ours (layer_stats, batched)", f"{t_ours:.3f}", f"{T / t_ours:,.0f}", f"{gf:,.1f}", "1.00x", "-"))
    ratios = {}
    for mode in modes:
        t_loop, st_loop = timed[mode]
        err = compare(st_ours, st_loop)
        ratios[mode] = t_loop / t_ours
        rows.append(
            (
                f"loop over experts (Gram: {mode})",
                f"{t_loop:.3f}",
                f"{T / t_loop:,.0f}",
                f"{flops / t_loop / 1e9:,.1f}",
                f"{t_loop / t_ours:.2f}x",
                f"{err['gram']:.2e}",
            )
        )
        ok = err["gram"] < tol and max(err["count"], err["psum"], err["psel"], err["wsel"]) < tol
        out.append(
            f"check[{mode}]: Gram rel err {err['gram']:.3e} (tol {tol:g}), count {err['count']:.1e}, psum "
            f"{err['psum']:.1e}, "
            f"psel {err['psel']:.1e}, wsel {err['wsel']:.1e} -> {'OK' if ok else 'MISMATCH'}"
        )
        if not ok:
            raise SystemExit(f"P1: loop baseline ({mode}) disagrees with layer_stats: {err}")
    print(table(rows, ("path", "best s", "tokens/s", "stats GFLOP/s", "time / ours", "Gram rel err vs ours")))
    for line in out:
        print(line)
    for mode, r in ratios.items():
        print(
            f"RATIO synthetic-layer speed-up ours vs loop(Gram {mode}): {r:.2f}x  (target >= 5x: "
            f"{'met' if r >= 5 else 'MISSED'})"
        )
    print(f"RATIO synthetic-layer ours {gf:,.1f} GFLOP/s / plain matmul {mm_rate:,.1f} GFLOP/s = {gf / mm_rate:.2f}")
    print(
        f"  counted FLOPs: expert GEMMs {2.0 * T * E * 3 * I * d / 1e9:,.1f} G + Gram {2.0 * E * E * T * d / 1e9:,.1f} "
        "G"
        f" (Gram in {gram_dtype(torch.device(device))})"
    )
    return out


# --------------------------------------------------------------------------------------------
# Real teacher
# --------------------------------------------------------------------------------------------
def run_model(args, mm_rate: float) -> None:
    if not TEACHER_DIR.exists() or not WIKI_VALID.exists():
        print(f"\n## Model: SKIPPED ({TEACHER_DIR} or {WIKI_VALID} absent)")
        return
    from m2d_ray.data.text import calibration_set
    from m2d_ray.models import load_teacher

    teacher = load_teacher(str(TEACHER_DIR), device="cpu")
    model, adapter, cfg = teacher.model, teacher.adapter, teacher.config
    tok = calibration_set(
        teacher.tokenizer, WIKI_VALID.read_text(encoding="utf-8"), seq_len=args.seq_len, max_tokens=args.tokens
    )
    ids, mask = tok.ids, tok.mask
    T = tok.n_tokens
    E, k = adapter.num_experts(cfg), adapter.top_k(cfg)
    block0 = next(iter(adapter.moe_blocks(model).values()))
    I, d, L = adapter.experts(block0).width, cfg.hidden_size, len(adapter.moe_blocks(model))
    print(
        f"\n## Model: {TEACHER_DIR.name} ({L} MoE layers, d={d} I={I} E={E} k={k}), {T} tokens of {WIKI_VALID.name}, "
        f"seq {args.seq_len}, batch {args.batch_size} sequences"
    )
    modes = ["stack", "pairwise"] if args.loop_gram == "both" else [args.loop_gram]
    fns = {
        "fwd": lambda: forward_only(model, ids, mask, args.batch_size),
        "ours": lambda: collect_stats(model, adapter, ids, mask, batch_size=args.batch_size, progress=False),
        **{m: (lambda m=m: collect_stats_loop(model, adapter, ids, mask, args.batch_size, m)) for m in modes},
    }
    timed = interleaved(fns, args.repeats)
    t_fwd, t_ours, st_ours = timed["fwd"][0], *timed["ours"]
    flops = L * stats_flops(T, E, I, d)
    noisy = False

    def stats_s(t: float) -> float | None:
        nonlocal noisy
        if t - t_fwd <= 0.05 * t:  # the forward alone was timed slower than forward + stats: load burst
            noisy = True
            return None
        return t - t_fwd

    rows = [("model forward only (no hooks)", f"{t_fwd:.3f}", f"{T / t_fwd:,.0f}", "-", "-", "-", "-")]
    s_ours = stats_s(t_ours)
    gf_ours = flops / s_ours / 1e9 if s_ours else float("nan")
    rows.append(
        (
            "ours: collect_stats",
            f"{t_ours:.3f}",
            f"{T / t_ours:,.0f}",
            f"{s_ours:.3f}" if s_ours else "n/a",
            f"{gf_ours:,.1f}",
            "1.00x / 1.00x",
            "-",
        )
    )
    ratios, checks = {}, []
    for mode in modes:
        t_loop, st_loop = timed[mode]
        errs = [compare(st_ours[i], st_loop[i]) for i in st_ours]
        worst = {key: max(e[key] for e in errs) for key in errs[0]}
        s_loop = stats_s(t_loop)
        r_stats = s_loop / s_ours if (s_loop and s_ours) else float("nan")
        ratios[mode] = (t_loop / t_ours, r_stats)
        rows.append(
            (
                f"loop hooks (Gram: {mode})",
                f"{t_loop:.3f}",
                f"{T / t_loop:,.0f}",
                f"{s_loop:.3f}" if s_loop else "n/a",
                f"{flops / s_loop / 1e9:,.1f}" if s_loop else "n/a",
                f"{ratios[mode][0]:.2f}x / {r_stats:.2f}x",
                f"{worst['gram']:.2e}",
            )
        )
        ok = worst["gram"] < 1e-5 and max(worst["count"], worst["psum"], worst["psel"], worst["wsel"]) < 1e-5
        checks.append(
            f"check[{mode}]: worst layer Gram rel err {worst['gram']:.3e}, count {worst['count']:.1e}, psum "
            f"{worst['psum']:.1e}, "
            f"psel {worst['psel']:.1e}, wsel {worst['wsel']:.1e} -> {'OK' if ok else 'MISMATCH'}"
        )
        if not ok:
            raise SystemExit(f"P1: loop baseline ({mode}) disagrees with collect_stats: {worst}")
    if noisy:
        checks.append(
            "WARNING: a forward-only time exceeded a forward+stats time: load from another process; stats-only figures "
            "are n/a"
        )
    print(
        table(
            rows,
            (
                "path",
                "best s",
                "tokens/s (end-to-end)",
                "stats s (minus fwd)",
                "stats GFLOP/s",
                "time / ours (e2e / stats)",
                "Gram rel err",
            ),
        )
    )
    for c in checks:
        print(c)
    for mode, (e2e, st) in ratios.items():
        print(
            f"RATIO model speed-up ours vs loop(Gram {mode}): end-to-end {e2e:.2f}x, stats-only {st:.2f}x  (target >= "
            "5x: "
            f"{'met' if st >= 5 else 'MISSED'} on stats-only, {'met' if e2e >= 5 else 'MISSED'} end-to-end)"
        )
    print(
        f"RATIO model ours stats {gf_ours:,.1f} GFLOP/s / plain matmul {mm_rate:,.1f} GFLOP/s = {gf_ours / mm_rate:.2f}"
    )
    print(
        f"  counted FLOPs: {L} layers x (expert GEMMs {2.0 * T * E * 3 * I * d / 1e9:.2f} G + Gram "
        f"{2.0 * E * E * T * d / 1e9:.2f} G)"
        f" = {flops / 1e9:.2f} G; model forward excluded (timed separately: {t_fwd:.3f} s)"
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tokens", type=int, default=16384, help="calibration tokens of the real-teacher run (default 16384)"
    )
    p.add_argument(
        "--layer-tokens", type=int, default=None, help="tokens of the synthetic layer (default 4096 CPU, 32768 --gpu)"
    )
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=None,
        help="tokens per hook call in the layer case (default 2048 CPU, 4096 --gpu)",
    )
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward in the model case")
    p.add_argument(
        "--repeats", type=int, default=2, help="timed rounds (paths take turns within a round); the best is reported"
    )
    p.add_argument(
        "--loop-gram", choices=["stack", "pairwise", "both"], default="both", help="Gram form of the loop baseline"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (default 2). On a 2-core machine shared with a busy process, 2 OpenMP threads make "
        "small ops tens of times slower in bursts; compare --threads 1 then",
    )
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--gpu", action="store_true", help="full-size Qwen3-30B-A3B layer on CUDA in bf16 (untested here)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print("# P1 calibration statistics throughput")
    print(machine_line())

    if args.gpu:
        # Untested in the session that wrote it (no GPU was lent). One Qwen3-30B-A3B MoE layer, bf16 weights and
        # activations; Gram products in fp32 summed in fp64 (gram_dtype on CUDA). The loop baseline holds E fp32
        # output blocks of batch_tokens x d per hook call (128 x 4096 x 2048 x 4 B = 4 GiB), so keep batch_tokens <=
        # 8192.
        if not torch.cuda.is_available():
            raise SystemExit("P1 --gpu: no CUDA device")
        args.layer_tokens = args.layer_tokens or 32768
        args.batch_tokens = args.batch_tokens or 4096
        mm = matmul_gflops(8192, torch.bfloat16, "cuda", iters=20)
        print(f"plain bf16 matmul 8192^3 on CUDA: {mm:,.0f} GFLOP/s")
        run_layer(
            args,
            d=2048,
            I=768,
            E=128,
            k=8,
            T=args.layer_tokens,
            dtype=torch.bfloat16,
            device="cuda",
            mm_rate=mm,
            tol=1e-2,
        )  # bf16 outputs from differently shaped GEMMs differ at ~1e-3
        return

    args.layer_tokens = args.layer_tokens or 4096
    args.batch_tokens = args.batch_tokens or 2048
    mm = matmul_gflops(2048, torch.float32, "cpu")
    mm64 = matmul_gflops(2048, torch.float64, "cpu", iters=5, repeats=2)
    print(f"plain matmul 2048^3 on CPU ({args.threads} threads): fp32 {mm:,.1f} GFLOP/s, fp64 {mm64:,.1f} GFLOP/s")
    if not args.skip_model:
        run_model(args, mm)
    if not args.skip_layer:
        run_layer(
            args, d=1024, I=384, E=64, k=8, T=args.layer_tokens, dtype=torch.float32, device="cpu", mm_rate=mm, tol=1e-5
        )
    print(machine_line())


if __name__ == "__main__":
    main()
