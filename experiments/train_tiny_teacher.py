#!/usr/bin/env python
"""Train the embedded tiny Qwen3-MoE teacher from scratch on the synthetic multi-domain corpus (CPU, minutes).

    python experiments/train_tiny_teacher.py --out m2d_ray/assets/tiny_qwen3_moe
    python experiments/train_tiny_teacher.py --dense --threads 2 --out m2d_ray/assets/tiny_qwen3_dense

Model: ``Qwen3MoeForCausalLM``, 4 layers, hidden 64, 4 heads x 16 (2 KV heads), 16 routed experts of width 32,
top-2 with renormalised routing, word-level vocabulary from ``m2d_ray.data.synthetic.build_tokenizer`` (padded to
a multiple of 8), fp32. Training: AdamW, linear warm-up + cosine decay, batches of 16 x 128 tokens packed from
the synthetic ``train`` split (documents concatenated exactly as ``corpus_text`` tokenises, each sequence seen
once), load-balancing aux loss (coefficient 0.01) on. Deterministic for a given ``--seed`` and ``--threads``.

Domain warm-up of the router. Trained plainly (``--domain-warmup-steps 0``) this model routes by token identity
(OpenMoE's "context-independent specialisation"): the same perplexity, but I(domain; expert) / H(domain) is only
about 0.03 because each domain's words are hashed over all 16 experts. Experts that specialise by domain are the
point of this teacher, so by default the first 30% of the steps add ``0.1 x`` a routing-guide loss (``-log`` of
the router probability mass on the experts assigned to the token's domain, expert e <-> domain e % 6, every
layer), which then fades out linearly over 15% of the steps; the remaining 55% are plain training (CE + aux
loss), and the specialisation that survives them is what ``train_info.json`` reports. The saved model is a
standard ``Qwen3MoeForCausalLM``: nothing of the guide remains but the weights.

``--dense`` trains its dense twin for the dense-to-dense (Minitron) pruning baseline at matched parameters: a
``Qwen3ForCausalLM`` with the same attention, embeddings, norms and tokenizer and one SwiGLU FFN of width
E x expert width = 512 per layer (555,712 parameters against the MoE's 559,808: the difference is the routers),
trained on the same token stream in the same order with the same optimizer, schedule, clipping and seed, on
cross-entropy alone (no router, so no aux or routing-guide loss and no routing figures).

The output directory gets the model (safetensors), the tokenizer and ``train_info.json`` with the held-out
perplexity (synthetic ``test`` split, non-overlapping 128-token windows) against uniform and unigram baselines,
and per-layer routing specialisation by domain. It is written to a temporary sibling directory and renamed into
place.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from m2d_ray.data import synthetic  # noqa: E402

DEFAULT_OUT = REPO / "m2d_ray" / "assets" / "tiny_qwen3_moe"
DEFAULT_DENSE_OUT = REPO / "m2d_ray" / "assets" / "tiny_qwen3_dense"


# ----------------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------------
def make_config(vocab_size: int, seq_len: int = 128):
    from m2d_ray.arch.qwen3_moe import moe_config

    shape = dict(hidden=64, ffn=128, layers=4, heads=4, kv_heads=2, head_dim=16, experts=16, top_k=2, expert_width=32)
    training = dict(router_aux_loss_coef=0.01, output_router_logits=True, use_cache=False, decoder_sparse_step=1)
    ids = dict(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    vocab = int(math.ceil(vocab_size / 8) * 8)
    return moe_config(vocab=vocab, max_positions=max(256, seq_len), **shape, **training, **ids, dtype="float32")


def make_dense_config(vocab_size: int, seq_len: int = 128):
    """The MoE's dense twin: same attention, embeddings and norms, FFN width = E x expert width."""
    from transformers import Qwen3Config

    from m2d_ray.arch.base import copy_config

    moe = make_config(vocab_size, seq_len)
    return copy_config(
        Qwen3Config,
        moe,
        intermediate_size=moe.num_experts * moe.moe_intermediate_size,
        architectures=["Qwen3ForCausalLM"],
    )


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
def encode_documents(tok, docs) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the documents concatenated (= ids of ``"\\n\\n".join(texts)``) and each token's domain index."""
    enc = tok([d.text for d in docs], add_special_tokens=False)["input_ids"]
    dom_index = {name: i for i, name in enumerate(synthetic.DOMAINS)}
    ids = torch.tensor([t for seq in enc for t in seq], dtype=torch.long)
    doms = torch.tensor([dom_index[d.domain] for d, seq in zip(docs, enc) for _ in seq], dtype=torch.long)
    return ids, doms


def train_stream(tok, n_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At least ``n_tokens`` token ids from the train split and their domain indices (generated in growing,
    prefix-stable chunks)."""
    n_docs = max(1, n_tokens // (55 * len(synthetic.DOMAINS)) + 1)
    while True:
        docs = synthetic.generate_documents("train", n_docs, seed=seed)
        ids, doms = encode_documents(tok, docs)
        if ids.numel() >= n_tokens:
            return ids, doms
        n_docs = int(n_docs * 1.2) + 1


def windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len)


# ----------------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, ids: torch.Tensor, doms: torch.Tensor, seq_len: int = 128, batch_size: int = 32) -> dict:
    """Perplexity over non-overlapping ``seq_len`` windows (last partial window dropped; every position but the
    first of a window is predicted) and router top-k counts per (layer, domain, expert) (none for a dense model)."""
    was_training = model.training
    model.eval()
    cfg = model.config
    moe = hasattr(cfg, "num_experts")
    E, k = (cfg.num_experts, cfg.num_experts_per_tok) if moe else (0, 0)
    L, D = cfg.num_hidden_layers, len(synthetic.DOMAINS)
    x_all, d_all = windows(ids, seq_len), windows(doms, seq_len)
    nll_sum = torch.zeros(D, dtype=torch.float64)
    nll_cnt = torch.zeros(D, dtype=torch.float64)
    counts = torch.zeros(L, D, E, dtype=torch.float64)
    for start in range(0, x_all.shape[0], batch_size):
        x, dm = x_all[start : start + batch_size], d_all[start : start + batch_size]
        out = (
            model(input_ids=x, output_router_logits=True, use_cache=False)
            if moe
            else model(input_ids=x, use_cache=False)
        )
        logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
        nll = -logp.gather(-1, x[:, 1:, None])[..., 0].double()
        tgt_dom = dm[:, 1:]
        nll_sum += torch.zeros(D, dtype=torch.float64).index_add_(0, tgt_dom.reshape(-1), nll.reshape(-1))
        nll_cnt += torch.bincount(tgt_dom.reshape(-1), minlength=D).double()
        flat_dom = dm.reshape(-1)
        for layer, logits in enumerate(out.router_logits if moe else ()):
            top = logits.topk(k, dim=-1).indices  # [B*T, k]
            pair = flat_dom[:, None] * E + top
            counts[layer] += torch.bincount(pair.reshape(-1), minlength=D * E).double().view(D, E)
    if was_training:
        model.train()
    return {
        "n_windows": int(x_all.shape[0]),
        "n_predicted_tokens": int(nll_cnt.sum()),
        "perplexity": math.exp(float(nll_sum.sum() / nll_cnt.sum())),
        "per_domain_perplexity": {
            name: math.exp(float(nll_sum[i] / nll_cnt[i])) for i, name in enumerate(synthetic.DOMAINS)
        },
        "counts": counts if moe else None,
    }


def unigram_perplexity(train_ids: torch.Tensor, eval_ids: torch.Tensor, vocab_size: int, seq_len: int) -> float:
    """Add-one-smoothed unigram model of the training tokens, scored on the same positions as ``evaluate``."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    logp = torch.log(counts / counts.sum())
    targets = windows(eval_ids, seq_len)[:, 1:]
    return math.exp(float(-logp[targets].mean()))


def routing_specialisation(counts: torch.Tensor) -> dict:
    """Per layer: for each domain the share of its top-k selections on its ``m = round(E / D)`` most-used experts
    (uniform routing would give ``m / E``) next to the share those same experts get of the other domains'
    selections, and the normalised mutual information ``I(domain; expert) / H(domain)`` of the (token domain,
    selected expert) pairs (0 = routing independent of the domain, 1 = the expert determines the domain)."""
    L, D, E = counts.shape
    m = max(1, round(E / D))
    layers = []
    for layer in range(L):
        c = counts[layer]
        order = c.sort(dim=1, descending=True).indices[:, :m]
        share = (c.gather(1, order).sum(1) / c.sum(1)).tolist()
        top_experts = order.tolist()
        # the same experts' share of the other domains' selections (= the share they get "by accident")
        other = []
        for i in range(D):
            rest = torch.cat([c[:i], c[i + 1 :]]).sum(0)
            other.append(float(rest[order[i]].sum() / rest.sum()))
        p = c / c.sum()
        pd, pe = p.sum(1, keepdim=True), p.sum(0, keepdim=True)
        nz = p > 0
        mi = float((p[nz] * (p[nz] / (pd * pe).expand_as(p)[nz]).log()).sum())
        h_d = float(-(pd[pd > 0] * pd[pd > 0].log()).sum())
        load = (c.sum(0) / c.sum()).tolist()
        layers.append(
            {
                "layer": layer,
                "nmi_domain_expert": mi / h_d,
                "top_m_share": {name: share[i] for i, name in enumerate(synthetic.DOMAINS)},
                "top_m_share_other_domains": {name: other[i] for i, name in enumerate(synthetic.DOMAINS)},
                "top_m_experts": {name: top_experts[i] for i, name in enumerate(synthetic.DOMAINS)},
                "max_expert_load_over_uniform": max(load) * E,
                "min_expert_load_over_uniform": min(load) * E,
            }
        )
    return {
        "m": m,
        "uniform_top_m_share": m / E,
        "mean_nmi": sum(x["nmi_domain_expert"] for x in layers) / L,
        "mean_top_m_share": {name: sum(x["top_m_share"][name] for x in layers) / L for name in synthetic.DOMAINS},
        "mean_top_m_share_other_domains": {
            name: sum(x["top_m_share_other_domains"][name] for x in layers) / L for name in synthetic.DOMAINS
        },
        "layers": layers,
    }


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------
def per_layer_aux_loss(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Switch-Transformer load-balancing loss computed for every MoE layer separately and summed over layers.

    transformers' ``load_balancing_loss_func`` pools the router logits of all layers before computing the loss, so
    an expert index overloaded in one layer and idle in another counts as balanced; per layer it is not."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    return sum(load_balancing_loss_func((g,), num_experts, top_k) for g in router_logits)


def domain_guide_loss(router_logits, token_group_mask: torch.Tensor) -> torch.Tensor:
    """Mean over layers and tokens of ``-log`` (router probability mass on the experts assigned to the token's
    domain); ``token_group_mask`` is [tokens, E] with 1 on those experts."""
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        losses.append(-torch.log((probs * token_group_mask).sum(-1).clamp_min(1e-9)).mean())
    return torch.stack(losses).mean()


def warmup_factor(step: int, full_steps: int, decay_steps: int) -> float:
    """1 for the first ``full_steps`` steps, then linearly down to 0 over ``decay_steps`` steps."""
    if step < full_steps:
        return 1.0
    if decay_steps <= 0 or step >= full_steps + decay_steps:
        return 0.0
    return 1.0 - (step - full_steps) / decay_steps


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output directory (replaced atomically; default {DEFAULT_OUT.relative_to(REPO)}, with --dense "
        f"{DEFAULT_DENSE_OUT.relative_to(REPO)})",
    )
    ap.add_argument(
        "--dense",
        action="store_true",
        help="train the dense twin (Qwen3, FFN width E x expert width) on cross-entropy alone",
    )
    ap.add_argument("--steps", type=int, default=3500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (keep 1-2 on a shared machine)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--experts-implementation", default="grouped_mm", choices=["grouped_mm", "eager", "batched_mm"])
    ap.add_argument(
        "--eval-chars",
        type=int,
        default=synthetic.DEFAULT_CORPUS_CHARS,
        help="characters of the synthetic test split used for the held-out figures",
    )
    ap.add_argument(
        "--aux-per-layer",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="balance every layer separately (sum of per-layer losses) instead of transformers' pooled loss",
    )
    ap.add_argument(
        "--domain-warmup-steps",
        type=int,
        default=None,
        help="steps during which the router is also pushed towards the experts assigned to each token's "
        "domain (expert e <-> domain e %% 6); default 30%% of --steps; 0 = plain training",
    )
    ap.add_argument(
        "--domain-warmup-decay",
        type=int,
        default=None,
        help="steps over which that push then fades out linearly (default 15%% of --steps)",
    )
    ap.add_argument("--domain-warmup-coef", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--valid-every", type=int, default=1000)
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = DEFAULT_DENSE_OUT if args.dense else DEFAULT_OUT
    if args.dense:
        args.domain_warmup_steps = args.domain_warmup_decay = 0
    if args.domain_warmup_steps is None:
        args.domain_warmup_steps = round(0.3 * args.steps)
    if args.domain_warmup_decay is None:
        args.domain_warmup_decay = round(0.15 * args.steps) if args.domain_warmup_steps > 0 else 0
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM, Qwen3MoeForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    t0 = time.time()

    tok = synthetic.build_tokenizer()
    if args.dense:
        config = make_dense_config(len(tok), args.seq_len)
        model = Qwen3ForCausalLM._from_config(config)
    else:
        config = make_config(len(tok), args.seq_len)
        model = Qwen3MoeForCausalLM._from_config(config, experts_implementation=args.experts_implementation)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())

    tokens_needed = args.steps * args.batch_size * args.seq_len + 1
    train_ids, train_doms = train_stream(tok, tokens_needed, args.seed)
    train_windows, train_dom_windows = windows(train_ids, args.seq_len), windows(train_doms, args.seq_len)
    # expert e is "assigned" to domain e % D; only used by the router's domain warm-up
    D = len(synthetic.DOMAINS)
    group_mask = (
        torch.arange(getattr(config, "num_experts", 0))[None, :] % D == torch.arange(D)[:, None]
    ).float()  # [D, E]
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(train_windows.shape[0], generator=gen)
    print(
        f"params {n_params:,}  vocab {len(tok)} (model {config.vocab_size})  train tokens {train_ids.numel():,} "
        f"({time.time() - t0:.1f}s to generate)",
        flush=True,
    )

    valid_docs = synthetic.corpus_documents("valid", 20_000)
    valid_ids, valid_doms = encode_documents(tok, valid_docs)

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    coef = None if args.dense else config.router_aux_loss_coef
    history = []
    t_train = time.time()
    ce_acc = aux_acc = guide_acc = 0.0
    n_acc = 0
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, args.warmup, args.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = order[step * args.batch_size : (step + 1) * args.batch_size]
        x = train_windows[idx]
        guide = args.domain_warmup_coef * warmup_factor(step, args.domain_warmup_steps, args.domain_warmup_decay)
        if args.dense:
            out = model(input_ids=x, labels=x, use_cache=False)
            loss = ce = out.loss
            aux_t = torch.zeros(())
        elif args.aux_per_layer:
            out = model(input_ids=x, output_router_logits=True, use_cache=False)
            ce = torch.nn.functional.cross_entropy(
                out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1)
            )
            aux_t = per_layer_aux_loss(out.router_logits, config.num_experts, config.num_experts_per_tok)
            loss = ce + coef * aux_t
        else:
            out = model(input_ids=x, labels=x, output_router_logits=True, use_cache=False)
            loss, aux_t = out.loss, out.aux_loss
            ce = loss - coef * aux_t
        if guide > 0:
            g_loss = domain_guide_loss(out.router_logits, group_mask[train_dom_windows[idx].reshape(-1)])
            loss = loss + guide * g_loss
            guide_acc += g_loss.detach().item()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = aux_t.detach().item()
        ce_acc += ce.detach().item()
        aux_acc += aux
        n_acc += 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            rec = {
                "step": step + 1,
                "lr": lr,
                "train_ce": ce_acc / n_acc,
                "aux_loss": aux_acc / n_acc,
                "domain_guide_coef": guide,
                "domain_guide_loss": guide_acc / n_acc,
                "elapsed_s": round(time.time() - t_train, 1),
            }
            if (step + 1) % args.valid_every == 0 or step + 1 == args.steps:
                rec["valid_ppl"] = evaluate(model, valid_ids, valid_doms, args.seq_len)["perplexity"]
            history.append(rec)
            print(json.dumps(rec), flush=True)
            ce_acc = aux_acc = guide_acc = 0.0
            n_acc = 0
    train_time = time.time() - t_train

    # ---- held-out figures --------------------------------------------------------------------------------------
    model.eval()
    test_docs = synthetic.corpus_documents("test", args.eval_chars)
    test_ids, test_doms = encode_documents(tok, test_docs)
    check = tok(synthetic.corpus_text("test", args.eval_chars), add_special_tokens=False)["input_ids"]
    assert check == test_ids.tolist(), "per-document encoding differs from encoding the corpus text"
    ev = evaluate(model, test_ids, test_doms, args.seq_len)
    spec = None if args.dense else routing_specialisation(ev["counts"])
    uniform = len(tok)
    unigram = unigram_perplexity(train_ids, test_ids, config.vocab_size, args.seq_len)
    info = {
        "command": "python experiments/train_tiny_teacher.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seed": args.seed,
        "threads": args.threads,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        "train_wall_time_s": round(train_time, 1),
        "total_wall_time_s": None,  # filled below
        "optimizer": {
            "name": "AdamW",
            "lr": args.lr,
            "betas": [0.9, 0.95],
            "weight_decay": args.weight_decay,
            "schedule": f"linear warm-up {args.warmup} steps, cosine to {args.min_lr_ratio} x lr",
            "grad_clip": 1.0,
        },
        "experts_implementation_for_training": None if args.dense else args.experts_implementation,
        "router_aux_loss_coef": coef,
        "router_aux_loss": None
        if args.dense
        else "per layer, summed over layers"
        if args.aux_per_layer
        else "transformers' load_balancing_loss_func (router logits of all layers pooled)",
        "domain_warmup": None
        if args.dense
        else {
            "steps": args.domain_warmup_steps,
            "decay_steps": args.domain_warmup_decay,
            "coef": args.domain_warmup_coef,
            "free_steps_after": max(0, args.steps - args.domain_warmup_steps - args.domain_warmup_decay),
            "expert_assignment": f"expert e <-> domain DOMAINS[e % {len(synthetic.DOMAINS)}]",
            "loss": "mean over layers and tokens of -log(router probability mass on the token's domain experts)",
        },
        "n_parameters": n_params,
        "tokenizer_vocab_size": len(tok),
        "model_vocab_size": config.vocab_size,
        "eval": {
            "split": "test",
            "chars": len(synthetic.corpus_text("test", args.eval_chars)),
            "protocol": f"m2d_ray.data.synthetic.corpus_text('test', {args.eval_chars}) tokenised with the bundled "
            f"tokenizer, non-overlapping {args.seq_len}-token windows (last partial window dropped), "
            "mean cross-entropy over every predicted position",
            "n_windows": ev["n_windows"],
            "n_predicted_tokens": ev["n_predicted_tokens"],
        },
        "heldout_perplexity": ev["perplexity"],
        "per_domain_perplexity": ev["per_domain_perplexity"],
        "uniform_perplexity": float(uniform),
        "unigram_perplexity": unigram,
        "routing": spec,
        "history": history,
    }

    # ---- save (temp dir, reload check, atomic rename) --------------------------------------------------------
    if not args.dense:
        model.config.output_router_logits = False
    model.config.use_cache = True
    out_dir = args.out.resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(
            tmp, **({} if args.dense else {"experts_implementation": "eager"})
        ).eval()
        tok2 = AutoTokenizer.from_pretrained(tmp)
        x = test_ids[: args.seq_len][None]
        with torch.no_grad():
            diff = (reloaded(input_ids=x).logits - model(input_ids=x).logits).abs().max().item()
        assert diff < 1e-4, f"reloaded model differs: {diff}"
        assert tok2(test_docs[0].text)["input_ids"] == tok(test_docs[0].text)["input_ids"]
        info["reload_max_abs_logit_diff"] = diff
        info["total_wall_time_s"] = round(time.time() - t0, 1)
        (tmp / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it 0700 (and safetensors writes 0600 files)
        for f in tmp.iterdir():
            f.chmod(0o644)
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)

    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    print(
        json.dumps(
            {
                k: info[k]
                for k in ("heldout_perplexity", "uniform_perplexity", "unigram_perplexity", "train_wall_time_s")
            }
        )
    )
    if spec is not None:
        print(
            json.dumps(
                {
                    "mean_nmi": spec["mean_nmi"],
                    "mean_top_m_share": spec["mean_top_m_share"],
                    "per_layer_nmi": [x["nmi_domain_expert"] for x in spec["layers"]],
                }
            )
        )
    print(f"saved to {out_dir} ({size / 1e6:.2f} MB)")
    return info


if __name__ == "__main__":
    main()
