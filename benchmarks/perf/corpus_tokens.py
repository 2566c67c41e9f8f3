"""P9: the distillation corpus tokenised by Ray Data (data/ray_tokens.py) against main's single-task loop, on
a generated Parquet corpus; tokens/s, the token shards' identity, and the pass's peak RSS at two corpus sizes.

    python -m benchmarks.perf.corpus_tokens --mb 200 --modes loop ray1 ray2     # throughput, >= 200 MB corpus
    python -m benchmarks.perf.corpus_tokens --mb 50 --modes ray2                 # peak RSS, a corpus 4x smaller
    python -m benchmarks.perf.corpus_tokens --mb 0.5 --shard-mb 0.25 --modes loop ray1   # plumbing (gpu_acceptance
    --cpu-smoke)

The corpus: documents of 3-40 sentences drawn (seeded) from the embedded corpus' train split, in uncompressed
Parquet shards of ~25 MB (--shard-mb; the file size is the text's size), column `text`; tokenizer: the embedded
teacher's.
The budget is 90% of the corpus's tokens (estimated from its first shard), so every mode reads nearly all of it.
Each mode runs in a fresh process (a local Ray of max(4, N + 2) CPUs for rayN, started before the clock):
  loop  main 31f1149's `_tokenize_task` body: one process, one tokenizer call per document, a Python list buffer
  rayN  `write_tokens(stream=token_blocks(...))` with N tokenizer actors (what runtime/shards.tokens runs)
Peak memory, sampled every 0.2 s: the driver's and the largest Ray worker's (read task / tokenizer actor) RSS, and
their private part (RSS - shared: a Ray process's RSS also counts the object-store pages it has touched, which
grow with the bytes that passed through it, not with what it holds); plus the driver's VmHWM. The last line is
all the rows as JSON ({"p9": [...]}).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import machine_line, python_m, write_json

SEQ_LEN = 2048
SHARD_MB = 25


def make_corpus(root: Path, mb: float, shard_mb: float = SHARD_MB) -> Path:
    """Uncompressed Parquet shards of ~`shard_mb` MB of generated documents until the files hold `mb` MB (cached in
    `root`)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from m2d_ray.data.synthetic import corpus_text

    out = root / (f"corpus-{mb:g}mb" if shard_mb == SHARD_MB else f"corpus-{mb:g}mb-{shard_mb:g}mb")
    if (out / "done").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    sentences = [s.strip() + "." for s in corpus_text("train").replace("\n", " ").split(".") if s.strip()]
    rng = np.random.default_rng(0)
    size, i = 0, 0
    while size < mb * 1e6:
        docs, n = [], 0
        while n < shard_mb * 1e6:
            doc = " ".join(sentences[j] for j in rng.integers(0, len(sentences), rng.integers(3, 41)))
            docs.append(doc)
            n += len(doc)
        path = out / f"part-{i:05d}.parquet"
        pq.write_table(pa.table({"text": docs}), path, compression="none", row_group_size=2048)
        size, i = size + path.stat().st_size, i + 1
    (out / "done").write_text(str(size))
    return out


def budget_blocks(corpus: Path, tokenizer) -> int:
    """90% of the corpus's tokens (tokens per byte of its first shard x all shards' bytes), in blocks."""
    import pyarrow.parquet as pq

    files = sorted(corpus.glob("*.parquet"))
    docs = pq.read_table(files[0]).column("text").to_pylist()
    per_byte = (
        sum(len(ids) + 1 for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]) / files[0].stat().st_size
    )
    return int(0.9 * per_byte * sum(f.stat().st_size for f in files) / SEQ_LEN)


def _main_loop_blocks(tokenizer, spec: str, seq_len: int):
    """main 31f1149's stream: one tokenizer call per document, EOS appended, a Python list cut into blocks."""
    import torch

    from m2d_ray.data.source import documents

    eos, buf = tokenizer.eos_token_id, []
    for doc in documents(spec):
        buf.extend(tokenizer(doc, add_special_tokens=False, return_attention_mask=False)["input_ids"])
        buf.append(eos)
        while len(buf) >= seq_len:
            yield torch.tensor(buf[:seq_len], dtype=torch.int64)
            del buf[:seq_len]


class RssSampler(threading.Thread):
    """Peak RSS and private memory (RSS - shared) of the driver and of its largest Ray worker, every 0.2 s."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"driver_rss": 0, "driver_private": 0, "worker_rss": 0, "worker_private": 0}
        self.stop = threading.Event()

    def _see(self, who: str, mem) -> None:
        self.peak[f"{who}_rss"] = max(self.peak[f"{who}_rss"], mem.rss)
        self.peak[f"{who}_private"] = max(self.peak[f"{who}_private"], mem.rss - mem.shared)

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.stop.is_set():
            self._see("driver", me.memory_info())
            for p in me.children(recursive=True):
                try:
                    if p.name().startswith("ray::") or "default_worker.py" in " ".join(p.cmdline()):
                        self._see("worker", p.memory_info())
                except psutil.Error:
                    pass
            time.sleep(0.2)


def vm_hwm() -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def run_mode(mode: str, corpus: Path, blocks: int) -> dict:
    """One mode in this process: write the token shards, return tokens/s, shard digest and peaks."""
    from m2d_ray.distill.tokens import write_tokens
    from m2d_ray.models import default_teacher, load_tokenizer

    teacher = default_teacher()
    tok = load_tokenizer(teacher)
    spec = str(corpus)
    if mode == "loop":
        stream = _main_loop_blocks(tok, spec, SEQ_LEN)
    else:
        import ray

        from m2d_ray.data.ray_tokens import token_blocks

        actors = int(mode.removeprefix("ray"))
        ray.init(address="local", num_cpus=max(4, actors + 2), include_dashboard=False, log_to_driver=False)
        stream = token_blocks(spec, teacher, SEQ_LEN, blocks, actors)
    sampler = RssSampler()
    sampler.start()
    with tempfile.TemporaryDirectory(prefix="m2d-p9-") as tmp:
        t0 = time.perf_counter()
        manifest = write_tokens(Path(tmp), tok, spec, SEQ_LEN, blocks, "synthetic:valid", 1024, stream=stream)
        wall = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    digest = hashlib.sha256("".join(s["sha256"] for s in manifest["shards"]).encode()).hexdigest()[:16]
    return {
        "mode": mode,
        "tokens": blocks * SEQ_LEN,
        "s": round(wall, 1),
        "tokens_per_s": round(blocks * SEQ_LEN / wall),
        "shards_sha": digest,
        "driver_hwm_mb": round(vm_hwm() / 2**20),
        **{k: round(v / 2**20) for k, v in sampler.peak.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=200)
    ap.add_argument("--shard-mb", type=float, default=SHARD_MB, help="size of one Parquet shard (MB)")
    ap.add_argument("--modes", nargs="+", default=["loop", "ray1", "ray2"])
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "m2d-p9"))
    ap.add_argument("--json-out", help="also write the figures ({p9: rows, corpus_mb}) to this JSON file")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one mode, its figures to --json-out
    ap.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    corpus = make_corpus(Path(args.cache), args.mb, args.shard_mb)
    if args.one:
        write_json(args.json_out, run_mode(args.one, corpus, args.blocks))
        return
    from m2d_ray.models import default_teacher, load_tokenizer

    blocks = budget_blocks(corpus, load_tokenizer(default_teacher()))
    size = sum(f.stat().st_size for f in corpus.glob("*.parquet"))
    print(machine_line())
    print(
        f"corpus {corpus}: {len(list(corpus.glob('*.parquet')))} shards, {size / 1e6:,.0f} MB; budget {blocks:,} "
        f"blocks x {SEQ_LEN} "
        f"= {blocks * SEQ_LEN / 1e6:,.1f}M tokens"
    )
    print(
        "| mode | tokens | s | tokens/s | vs loop | shards sha256 | driver VmHWM MiB | driver RSS / private MiB | "
        "largest Ray worker RSS / private MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base, rows = None, []
    for mode in args.modes:
        one = Path(args.cache) / f"{mode}.json"
        subprocess.run(
            [
                *python_m(__spec__.name),
                "--mb",
                str(args.mb),
                "--shard-mb",
                str(args.shard_mb),
                "--cache",
                args.cache,
                "--one",
                mode,
                "--blocks",
                str(blocks),
                "--json-out",
                one,
            ],
            capture_output=True,
            check=True,
        )
        r = json.loads(one.read_text())
        base = base or (r["tokens_per_s"] if mode == "loop" else None)
        rows.append({**r, "vs_loop": r["tokens_per_s"] / base if base else None})
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(
            f"| {mode} | {r['tokens']:,} | {r['s']} | {r['tokens_per_s']:,} | {ratio} | {r['shards_sha']} | "
            f"{r['driver_hwm_mb']} | "
            f"{r['driver_rss']} / {r['driver_private']} | {r['worker_rss']} / {r['worker_private']} |",
            flush=True,
        )
    result = {"p9": rows, "corpus_mb": round(size / 1e6, 1)}
    print(json.dumps(result))
    write_json(args.json_out, result)


if __name__ == "__main__":
    main()
