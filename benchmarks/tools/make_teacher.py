"""A random-weight Qwen3-MoE teacher saved like a hub checkpoint (sharded safetensors, per-expert keys),
with the embedded corpus' tokenizer so every `m2d` command runs on it offline.

Used by P6 (memory: a scaled-down Qwen3-30B-A3B, d 512, expert width 256, E 64 or 128, k 4, 8 layers,
5 shards, fp32) and by gpu_acceptance.sh (Qwen3-30B-A3B's full layer shapes: d 2048, expert width 768,
E 128, k 8, bf16, a few layers).

    python -m benchmarks.tools.make_teacher --out /tmp/p6-e64 --E 64
    python -m benchmarks.tools.make_teacher --out /tmp/q30b --d 2048 --I 768 --E 128 --k 8 --layers 4 --heads 32
        --kv-heads 4
    --head-dim 128 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch


def make_teacher(
    out: str | Path,
    *,
    E: int = 64,
    k: int = 4,
    d: int = 512,
    I: int = 256,
    layers: int = 8,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int | None = None,
    dtype: str = "float32",
    shards: int = 5,
    seed: int = 0,
) -> Path:
    """Write the teacher to `out` (skipped when a teacher with the same shape is already there)."""
    from transformers import AutoModelForCausalLM

    from m2d_ray.arch.qwen3_moe import moe_config
    from m2d_ray.data.synthetic import build_tokenizer
    from workshop.random_models import tokenizer_fields

    out = Path(out)
    head_dim = head_dim or d // heads
    shape = dict(E=E, k=k, d=d, I=I, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    shape |= dict(dtype=dtype, shards=shards, seed=seed)  # the stamp: what a teacher already there was made with
    stamp = out / "p6_shape.json"
    if stamp.exists() and json.loads(stamp.read_text()) == shape:
        return out
    tok = build_tokenizer()
    sizes = dict(hidden=d, ffn=4 * d, expert_width=I, experts=E, top_k=k, max_positions=4096)
    cfg = moe_config(
        **sizes, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, **tokenizer_fields(tok, 64)
    )
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # fan-in scaled normals (routers and experts far from uniform), norms at 1
        for name, p in model.named_parameters():
            if "norm" in name:
                value = torch.ones(p.shape)
            else:
                fan_in = p.shape[-1]
                value = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
            owner, _, attr = name.rpartition(".")
            model.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(
                value.to(torch_dtype), requires_grad=False
            )
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # real rotary buffers
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(out, max_shard_size=f"{math.ceil(total / shards / 2**20) + 1}MB")
    tok.save_pretrained(out)
    stamp.write_text(json.dumps(shape))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    for name, default in (
        ("E", 64),
        ("k", 4),
        ("d", 512),
        ("I", 256),
        ("layers", 8),
        ("heads", 8),
        ("kv-heads", 4),
        ("head-dim", None),
        ("shards", 5),
        ("seed", 0),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = p.parse_args(argv)
    out = make_teacher(a.out, **{k: v for k, v in vars(a).items() if k != "out"})
    files = sorted(out.glob("*.safetensors"))
    print(json.dumps({"out": str(out), "shards": len(files), "bytes": sum(f.stat().st_size for f in files)}))


if __name__ == "__main__":
    main()
