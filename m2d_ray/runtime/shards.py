"""What every student of a run reads, made once into the run's storage: the tokenised distillation stream
(and validation ids), and with `stage2.targets` a cached mode, the teacher's targets over it.

Both are content-addressed (STORAGE/tokens/<digest>, STORAGE/targets/<digest>): a second student, a
resumed run or another run on the same storage reuses them; a copy that exists is complete (its marker
is written last).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import numpy as np
import ray
import ray.data
import torch

from m2d_ray import storage
from m2d_ray.accelerators import pin
from m2d_ray.arch.dense import dense_types
from m2d_ray.artifacts import MARKER, atomic_dir, write_marker
from m2d_ray.calibrate.stream import final_hidden_streamed, should_stream
from m2d_ray.catalog.distill import AUTO
from m2d_ray.config import DistillConfig
from m2d_ray.console import say
from m2d_ray.data import source
from m2d_ray.data.ray_tokens import actors_for, token_blocks
from m2d_ray.distill.precision import for_device
from m2d_ray.distill.targets import (
    MANIFEST,
    ShardEntry,
    TargetsManifest,
    blocks_per_shard,
    bytes_per_token,
    fingerprint,
    state_bytes,
    teacher_targets,
    write_shard,
)
from m2d_ray.distill.tokens import TokenShards, manifest_sha256, rank_batches, tokenizer_fingerprint, write_tokens
from m2d_ray.errors import M2DError, RunFailed
from m2d_ray.models import load_distill_teacher, model_config
from m2d_ray.runtime.run_storage import RunStorage
from m2d_ray.weights import open_teacher


def _whole_stage(fn, what: str):
    """`fn()`; a worker's failure there stops stage 2 (every student needs it) with one line, not a traceback;
    what was written stays for the resume. The driver's own refusals (M2DError: bad input) pass as they are."""
    try:
        return fn()
    except M2DError:
        raise
    except Exception as exc:
        cause = getattr(exc, "cause", None) or exc
        raise RunFailed(
            f"{what} failed on a Ray worker ({type(cause).__name__}: {str(cause).strip().splitlines()[-1][:200]}); "
            "fix it and resume the run"
        ) from None


def tokens(
    store: RunStorage, teacher: str, tokenizer, cfg: DistillConfig, eval_data: str, actors: int | None = None
) -> str:
    """The run's token directory (storage URL) for `cfg`'s stream and validation text, made once: Ray Data
    reads the corpus where the workers reach it and `actors` (default: one per 64 MiB of corpus, at most the
    cluster's CPUs; 0 below 64 MiB: the driver) tokenise it with `teacher`'s tokenizer (`tokenizer`: the same,
    on the driver). `teacher`,
    `cfg.train_data` and `eval_data` are as the workers reach them (RunStorage.put_*). Tokens of a corpus
    that changed since (files, sizes, mtimes) are refused, naming the change."""

    key = {
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "source": cfg.train_data,
        "seq_len": cfg.seq_len,
        "blocks": cfg.blocks,
        "valid": eval_data,
        "valid_max_tokens": cfg.eval_max_tokens,
    }
    if cfg.epochs != 1:
        key["epochs"] = cfg.epochs
    url = store.tokens(hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16])
    corpus = source.fingerprint(cfg.train_data)
    if storage.exists(url):
        made = TokenShards(storage.fetch_dir(url)).manifest.get("corpus")
        changed = source.changes(made, corpus) if made else None
        if changed:
            raise M2DError(
                f"training data {cfg.train_data} changed since its tokens in {url} were made ({changed}); "
                "restore it, or start a new run on another storage"
            )
        return url
    n = actors_for(cfg.train_data, int(ray.cluster_resources().get("CPU", 1))) if actors is None else actors
    say(
        f"tokenising {key['blocks']:,} blocks of {cfg.seq_len} tokens of {cfg.train_data} once, for every student "
        f"({f'{n} Ray Data actors' if n else 'a small corpus: here'})"
    )

    def build(dest: Path) -> None:  # built aside and renamed in, its marker last: complete or absent
        with atomic_dir(dest, "tokens", overwrite=True, what="token directory") as tmp:
            write_tokens(
                tmp,
                tokenizer,
                cfg.train_data,
                cfg.seq_len,
                key["blocks"],
                eval_data,
                cfg.eval_max_tokens,
                corpus=corpus,
                stream=token_blocks(cfg.train_data, teacher, cfg.seq_len, key["blocks"], n, cfg.epochs, tokenizer),
            )

    _whole_stage(lambda: storage.save_dir(url, build), "tokenising the distillation data")
    return url


# ---- the teacher once: cached targets (stage2.targets hidden / topk / sampled) ----------------------


class TargetsActor:
    """A Ray Data actor: the teacher (whole when it fits the device, else one decoder layer at a time, as
    streamed calibration) over ranges of token blocks, writing one target shard per range to the storage
    (`hidden`: the final hidden states themselves, in the dtype the teacher runs in)."""

    def __init__(
        self,
        teacher: str,
        tokens_url: str,
        targets_url: str,
        spec,
        teacher_topk: int | None,
        device: str,
        threads: int,
        batch_size: int,
        stream: bool | None,
        max_memory: str | None,
        store: RunStorage | None = None,
        precision: str = AUTO,
    ) -> None:

        if store is not None:
            store.ensure_visible()

        torch.set_num_threads(threads)
        self.tokens = TokenShards(storage.fetch_dir(tokens_url))
        self.url, self.spec = targets_url, spec
        self.hidden, self.head = _teacher_forward(
            teacher, teacher_topk, device, batch_size, stream, max_memory, head=not spec.exact, precision=precision
        )

    def __call__(self, batch: dict) -> dict:

        entries = []
        shards = [_entry(e) for e in self.tokens.manifest["shards"]]
        for first, n in zip(batch["first_block"].tolist(), batch["blocks"].tolist()):
            ids = next(rank_batches(shards, lambda e: {"ids": self.tokens.rows(e)}, n, start_block=first))["ids"]
            parts, done = [], 0
            for h in self.hidden(ids):  # a batch of blocks at a time, in order
                parts.append(
                    {k: v.cpu() for k, v in teacher_targets(h, self.head, self.spec, first_block=first + done).items()}
                )
                done += h.shape[0]
            targets = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            with tempfile.TemporaryDirectory(prefix="m2d-targets-") as tmp:
                local = tmp if storage.is_remote(self.url) else storage.filesystem(self.url)[1]
                entry = write_shard(local, first, targets)
                if local == tmp:
                    storage.put_file(Path(tmp) / entry.file, storage.join(self.url, entry.file))
            storage.write_bytes(
                storage.join(self.url, f"{entry.file}.entry.json"), json.dumps(vars(entry)).encode()
            )  # after the shard
            entries.append(json.dumps(vars(entry)))
        return {"entry": np.array(entries, dtype=object)}


def _entry(d: dict):

    return ShardEntry(**d)


def _teacher_forward(
    name: str,
    teacher_topk: int | None,
    device: str,
    batch_size: int,
    stream: bool | None,
    max_memory: str | None,
    head: bool = True,
    precision: str = AUTO,
):
    """(ids [n, L] -> the final hidden states of `batch_size` blocks at a time on `device`, in order; the output
    projection [V, d], or None when not `head`) of a teacher: an MoE teacher that does not fit its budget is
    streamed one decoder layer at a time over all n blocks (calibrate/stream.py), any other is loaded whole;
    the head is read only when the targets need logits (a streamed teacher's is not read for hidden states). A whole
    teacher computes in distill.precision's dtype (`precision`), as the students' online teacher does."""

    if model_config(name).model_type not in dense_types():
        lazy = open_teacher(name, device=device)
        if teacher_topk is not None:
            lazy.adapter.set_top_k(lazy.skeleton, teacher_topk)
        if should_stream(lazy, device, stream, max_memory):
            w = lazy.module(lazy.name_of(lazy.skeleton.get_output_embeddings())).weight.to(device) if head else None

            def streamed(ids):
                h = final_hidden_streamed(lazy, ids, batch_size, device)
                return (h[i : i + batch_size].to(device) for i in range(0, h.shape[0], batch_size))

            return streamed, w
    teacher = load_distill_teacher(name, dtype=for_device(precision, device).dtype, device=device)
    if teacher_topk is not None:
        teacher.adapter.set_top_k(teacher.model, teacher_topk)
    base = teacher.model.base_model

    @torch.no_grad()
    def whole(ids):
        for i in range(0, ids.shape[0], batch_size):
            yield base(input_ids=ids[i : i + batch_size].to(device), use_cache=False).last_hidden_state

    return whole, teacher.model.get_output_embeddings().weight.detach() if head else None


def targets(store: RunStorage, teacher: str, tokens_url: str, spec, cfg: DistillConfig, calib, ray_cfg) -> str:
    """The teacher's targets over the run's tokens (storage URL), computed once by a Ray Data pass of the
    teacher (`calib` gives its device budget and batch; `ray_cfg` the actors); a killed pass resumes at the
    first shard it had not written. Targets of another teacher, tokenizer, tokens, k' or temperature
    live in another directory (the digest of their fingerprint) and are never mixed."""

    tok_manifest = TokenShards(storage.fetch_dir(tokens_url)).manifest
    fp = fingerprint(
        spec, teacher, tok_manifest["tokenizer"], manifest_sha256(tok_manifest), cfg.teacher_topk, spec.temperature
    )
    url = store.targets(
        hashlib.sha256(json.dumps({**fp, "spec": str(spec), "seed": spec.seed}, sort_keys=True).encode()).hexdigest()[
            :16
        ]
    )
    if storage.exists(url):
        TargetsManifest.load(storage.fetch_dir(url), where=url).check_matches(fp, spec)
        return url
    gpus = ray_cfg.data_gpus_per_actor
    per_token = bytes_per_token(spec, state_bytes(model_config(teacher).hidden_size, gpus > 0))
    per = blocks_per_shard(tok_manifest["seq_len"], per_token)
    done = [
        json.loads(storage.read_bytes(storage.join(url, n)))
        for n in storage.list_names(url)
        if n.endswith(".entry.json")
    ]
    have = {e["first_block"]: e for e in done}  # shards a killed pass wrote (each entry file follows its shard)
    ranges = [(f, min(per, tok_manifest["blocks"] - f)) for f in range(0, tok_manifest["blocks"], per)]
    todo = [(f, n) for f, n in ranges if f not in have]
    say(
        f"teacher targets {spec} over {tok_manifest['blocks']:,} blocks ({len(todo)} of {len(ranges)} shards to "
        "compute, "
        f"{per_token:,} B/token)"
    )
    if todo:
        ds = ray.data.from_items([{"first_block": f, "blocks": n} for f, n in todo])
        out = ds.map_batches(
            TargetsActor,
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=max(1, min(ray_cfg.data_actors, len(todo)))),
            num_gpus=gpus,
            num_cpus=1,
            **({"resources": pin(ray_cfg.data_accelerator)} if gpus > 0 and ray_cfg.data_accelerator else {}),
            fn_constructor_kwargs={
                "teacher": teacher,
                "tokens_url": tokens_url,
                "targets_url": url,
                "spec": spec,
                "teacher_topk": cfg.teacher_topk,
                "device": "cuda" if gpus > 0 else "cpu",
                "threads": ray_cfg.threads_per_worker,
                "batch_size": calib.batch_size,
                "stream": calib.stream,
                "max_memory": calib.max_memory,
                "store": store,
                "precision": cfg.precision,
            },
        )
        for row in _whole_stage(lambda: list(out.iter_rows()), f"the teacher's {spec} targets pass"):
            e = json.loads(row["entry"])
            have[e["first_block"]] = e

    manifest = TargetsManifest(spec, fp, tok_manifest["seq_len"], tuple(_entry(have[f]) for f, _ in ranges), where=url)
    with tempfile.TemporaryDirectory(prefix="m2d-targets-") as tmp:
        manifest.save(tmp)
        write_marker(Path(tmp), "targets")
        for name in (MANIFEST, MARKER):  # the marker last: the directory is complete
            storage.put_file(Path(tmp) / name, storage.join(url, name))
    return url


def targets_here(
    teacher: str,
    tokens_dir: str,
    out: str,
    spec,
    teacher_topk: int | None = None,
    batch_size: int = 8,
    ranges: list[tuple[int, int]] | None = None,
    stream: bool | None = None,
    precision: str = AUTO,
) -> None:
    """The targets pass in this process on CPU (one `TargetsActor`, no Ray) over `ranges` of (first block,
    blocks) (default: all blocks at once), the teacher in distill.precision's dtype (`precision`), with the manifest a
    run writes: for tests and benchmarks."""

    tok_manifest = TokenShards(Path(tokens_dir)).manifest
    ranges = ranges or [(0, tok_manifest["blocks"])]
    actor = TargetsActor(
        teacher, tokens_dir, out, spec, teacher_topk, "cpu", 1, batch_size, stream, None, precision=precision
    )
    rows = actor({"first_block": np.array([f for f, _ in ranges]), "blocks": np.array([n for _, n in ranges])})
    fp = fingerprint(
        spec, teacher, tok_manifest["tokenizer"], manifest_sha256(tok_manifest), teacher_topk, spec.temperature
    )
    shards = tuple(ShardEntry(**json.loads(e)) for e in rows["entry"])
    TargetsManifest(spec, fp, tok_manifest["seq_len"], shards).save(out)
