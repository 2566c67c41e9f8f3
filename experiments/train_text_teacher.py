#!/usr/bin/env python
"""Train a small Qwen3-MoE teacher on real text, and its dense twin: the recipe of the real-text tutorial's teachers
(docs/tutorials/real-text-teacher.md), for whoever has no ../shared/teachers/.

    python experiments/train_text_teacher.py --data wikitext2:train --out teachers/wiki-moe
    python experiments/train_text_teacher.py --data wikitext2:train --dense --tokenizer teachers/wiki-moe \
        --out teachers/wiki-dense

The MoE (the shape of ../shared/teachers/qwen3moe-wiki4): `Qwen3MoeForCausalLM`, 4 layers, hidden 128, 4 heads x 32
(2 KV heads), 32 routed experts of width 64, top-4 with renormalised routing, a byte-level BPE vocabulary of 4,096
trained on the same text, fp32. `--dense`: its dense twin for the dense-to-dense baseline at matched parameters, a
`Qwen3ForCausalLM` with the same attention, embeddings, norms and tokenizer (`--tokenizer DIR`: the MoE's) and one
SwiGLU FFN of width 32 x 64 = 2,048 per layer. Training: AdamW (lr 3e-3, betas 0.9/0.95, weight decay 0.01), linear
warm-up then cosine decay to 0.1 x lr, gradient clipping at 1, batches of 16 x 256 tokens drawn from the text's token
stream (the MoE: plus the router's load-balancing loss, 0.01). `--data` is any m2d data spec (docs/how-to/own-corpus.md:
files, a directory, `wikitext2:train` from the hub, ...). Deterministic for a given `--seed` and `--threads`.

The output directory gets the model (safetensors), the tokenizer and `train_info.json` (the command, the shapes, the
steps, the last training loss and the wall time); it is written to a temporary sibling and renamed into place.
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
SHAPE = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "head_dim": 32, "experts": 32, "width": 64, "top_k": 4}
EOS = "<|endoftext|>"


def train_tokenizer(text: str, vocab: int):
    """A byte-level BPE of `vocab` tokens over `text`, as transformers loads it (end of text: its one special token)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=vocab, min_frequency=2, special_tokens=[EOS], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, pad_token=EOS, bos_token=EOS)


def model_config(vocab: int, dense: bool, seq_len: int):
    """The teacher's (or its twin's) transformers config."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    s = SHAPE
    common = dict(
        vocab_size=vocab,
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=max(1024, seq_len),
        tie_word_embeddings=False,
    )
    if dense:
        return Qwen3Config(intermediate_size=s["experts"] * s["width"], **common)
    return Qwen3MoeConfig(
        intermediate_size=2 * s["hidden"],
        moe_intermediate_size=s["width"],
        num_experts=s["experts"],
        num_experts_per_tok=s["top_k"],
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        **common,
    )


def schedule(step: int, steps: int, warmup: int) -> float:
    """The learning rate's factor: linear warm-up, then cosine to 0.1."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def train(model, ids: torch.Tensor, args, moe: bool) -> float:
    """`args.steps` AdamW steps on random windows of `ids`; returns the last step's loss."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: schedule(s, args.steps, max(1, args.steps // 20)))
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(args.steps):
        start = torch.randint(0, len(ids) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([ids[i : i + args.seq_len] for i in start.tolist()])
        out = model(input_ids=batch, labels=batch, **({"output_router_logits": True} if moe else {}))
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % max(1, args.steps // 20) == 0 or step == args.steps - 1:
            print(f"step {step + 1}/{args.steps}: loss {loss.item():.3f}", flush=True)
    return loss.item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="the text: an m2d data spec (wikitext2:train, files, a directory)")
    p.add_argument("--out", required=True, help="the teacher's directory (must not exist)")
    p.add_argument("--dense", action="store_true", help="the dense twin (give --tokenizer: the MoE teacher's)")
    p.add_argument("--tokenizer", help="a directory whose tokenizer to use (default: train one on --data)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-chars", type=int, default=None, help="read the text only this far")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        p.error(f"--out {out} exists; give a new directory")
    if args.dense and not args.tokenizer:
        p.error("--dense needs --tokenizer DIR (the MoE teacher's), so that the twins share it")
    sys.path.insert(0, str(REPO))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from m2d_ray.data.text import load_text, tokenize

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    began = time.time()
    text = load_text(args.data, max_chars=args.max_chars)
    tok = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else train_tokenizer(text, args.vocab)
    ids = tokenize(tok, text)
    if len(ids) <= args.seq_len + 1:
        p.error(f"--data {args.data} has {len(ids)} tokens: fewer than one sequence of {args.seq_len}")
    model = AutoModelForCausalLM.from_config(model_config(len(tok), args.dense, args.seq_len))
    loss = train(model, ids, args, moe=not args.dense)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        info = {
            "command": " ".join(["python", "experiments/train_text_teacher.py", *(argv or sys.argv[1:])]),
            "dense": args.dense,
            "shape": SHAPE,
            "vocab": len(tok),
            "tokens": len(ids),
            "steps": args.steps,
            "batch": [args.batch_size, args.seq_len],
            "last_loss": round(loss, 4),
            "wall_time_s": round(time.time() - began, 1),
        }
        (tmp / "train_info.json").write_text(json.dumps(info, indent=1) + "\n")
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"teacher written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
