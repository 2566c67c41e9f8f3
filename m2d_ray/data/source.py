"""One grammar for every text a run reads (calibration, evaluation, validation, distillation), and one reader.

A data spec is one of
* ``synthetic[:split]`` – the embedded multi-domain corpus (train / valid / test; default test), offline;
* ``wikitext2[:split]`` / ``wikitext103[:split]`` – WikiText raw through `datasets` (default test);
* ``fineweb-edu`` – HuggingFaceFW/fineweb-edu sample-10BT, streamed (the paper's distillation data);
* ``hf:NAME[:CONFIG[:SPLIT]]`` – a hub dataset (split default train), streamed online, from the
  `datasets` cache offline;
* a file, a directory or a glob (``*``, ``?``, ``[``) of ``.parquet``, ``.jsonl`` / ``.json`` (one object per
  line; also ``.gz`` / ``.zst``) or text files, local or a ``s3://`` / ``gs://`` URL (what `pyarrow.fs`
  reaches; ``?endpoint_override=…`` kept). A directory is read recursively (hidden and ``_`` files skipped).

Any spec but synthetic / wikitext may end in ``#column=NAME`` (default ``text``) for a Parquet / JSON / hub
column. Documents come in a fixed order: files sorted by path, rows in file order; a text file is one
document, read with universal newlines (`decode`); null and empty rows are skipped. synthetic and wikitext
are one document each (their text).
"""

from __future__ import annotations

import fnmatch
import io
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from m2d_ray import storage
from m2d_ray.artifacts import MARKER
from m2d_ray.data.synthetic import SPLITS, corpus_text
from m2d_ray.errors import M2DError

# Imported inside functions: what may be missing (optional packages, Ray's internal API), where its absence is handled;
# datasets (only for a hub dataset).

FINEWEB = ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train")
WIKITEXT = {"wikitext2": "wikitext-2-raw-v1", "wikitext103": "wikitext-103-raw-v1"}
WIKITEXT_SPLITS = ("train", "validation", "test")
DATASET_SPECS = ("synthetic", *WIKITEXT, "fineweb-edu", "hf:NAME")
PARQUET, JSONL, TEXT = "parquet", "jsonl", "text"
_COMPRESSION = {".gz": "gzip", ".zst": "zstd"}
_FORMATS = {".parquet": PARQUET, ".pq": PARQUET, ".jsonl": JSONL, ".json": JSONL, ".ndjson": JSONL, ".txt": TEXT}
_SNIFF = 8192  # bytes read to tell text from binary
_BATCH = 1024  # documents per batch read


@dataclass(frozen=True)
class CorpusFile:
    """One file of a corpus: where every node reads it, and what identifies its content."""

    url: str
    size: int
    mtime_ns: int

    @property
    def name(self) -> str:
        return self.url.partition("?")[0].rsplit("/", 1)[-1]

    @property
    def format(self) -> str:
        return file_format(self.name)

    @property
    def compression(self) -> str | None:
        return _COMPRESSION.get(Path(self.name).suffix)


@dataclass(frozen=True)
class Source:
    """A parsed data spec (see the module docstring)."""

    spec: str
    kind: str  # synthetic | wikitext | hf | files
    location: str = ""  # files: path, directory, glob or URL; wikitext/hf: dataset name; synthetic: ""
    config: str | None = None
    split: str | None = None
    column: str = "text"

    @property
    def one_document(self) -> bool:
        return self.kind in ("synthetic", "wikitext")


def file_format(name: str) -> str:
    """parquet | jsonl | text, from a file name (compression suffix ignored); unknown suffixes are text."""
    stem = name[: -len(Path(name).suffix)] if Path(name).suffix in _COMPRESSION else name
    return _FORMATS.get(Path(stem).suffix.lower(), TEXT)


def parse(spec: str, what: str = "data") -> Source:
    """The Source of a spec; an unknown split or an empty column name is refused (one line)."""

    body, sep, suffix = str(spec).partition("#")
    column = "text"
    if sep:
        key, _, column = suffix.partition("=")
        if key != "column" or not column:
            raise M2DError(f"{what} {spec!r}: after '#' write column=NAME (e.g. {body}#column=content)")
    name, has_split, split = body.partition(":")
    if name in ("synthetic", *WIKITEXT) and not storage.is_remote(body):
        splits = SPLITS if name == "synthetic" else WIKITEXT_SPLITS
        if has_split and split not in splits:
            raise M2DError(f"{what} {spec!r}: unknown split {split!r}; use {name}:" + f" or {name}:".join(splits))
        if sep:
            raise M2DError(f"{what} {spec!r}: {name} has no columns; drop #{suffix}")
        if name == "synthetic":
            return Source(spec, "synthetic", split=split or "test")
        return Source(spec, "wikitext", "wikitext", WIKITEXT[name], split or "test")
    if body == "fineweb-edu":
        return Source(spec, "hf", *FINEWEB, column=column)
    if body.startswith("hf:"):
        parts = body[3:].split(":")
        if not parts[0] or len(parts) > 3:
            raise M2DError(f"{what} {spec!r}: write hf:NAME[:CONFIG[:SPLIT]]")
        name, config, split = (parts + [None, None])[:3]
        return Source(spec, "hf", name, config or None, split or "train", column)
    return Source(spec, "files", body, column=column)


# ---- files ------------------------------------------------------------------------------------------
def _glob(location: str) -> bool:
    return (
        any(c in location.partition("?")[0] for c in "*?[")
        if storage.is_remote(location)
        else any(c in location for c in "*?[")
    )


def _with_query(path: str, location: str) -> str:
    """A pyarrow path back as a storage URL of `location`'s scheme and query."""
    if not storage.is_remote(location):
        return path
    scheme = location.split("://", 1)[0]
    query = location.partition("?")[2]
    return f"{scheme}://{path}" + (f"?{query}" if query else "")


def files(src: Source, what: str = "data") -> list[CorpusFile]:
    """The files of a files spec, sorted by path (one line when nothing matches)."""

    loc = src.location
    if _glob(loc):
        base, _, query = loc.partition("?")
        prefix = base[: min(base.index(c) for c in "*?[" if c in base)]
        root, _, rest = prefix.rpartition("/")
        rest = base[len(root) + 1 :] if root or prefix.startswith("/") else base
        fs, root_path = storage.filesystem(
            (root or ("/" if prefix.startswith("/") else ".")) + (f"?{query}" if query else "")
        )
        pattern = f"{root_path.rstrip('/')}/{rest}"
        infos = [
            i
            for i in fs.get_file_info(pafs.FileSelector(root_path, recursive=True, allow_not_found=True))
            if i.type == pafs.FileType.File and fnmatch.fnmatchcase(i.path, pattern)
        ]
        if not infos:
            raise M2DError(f"{what} {src.spec!r}: no file matches {loc}; check the pattern")
    else:
        fs, path = storage.filesystem(loc)
        try:
            info = fs.get_file_info(path)
        except OSError as exc:
            raise M2DError(
                f"{what} {src.spec!r} cannot be listed ({str(exc).splitlines()[0][:160]}); check the URL and "
                "credentials"
            ) from None
        if info.type == pafs.FileType.NotFound:
            raise M2DError(
                f"{what} {src.spec!r} is neither a file nor one of {', '.join(DATASET_SPECS)}; "
                "give an existing file, directory or glob"
            )
        if info.type == pafs.FileType.File:
            infos = [info]
        else:
            infos = [
                i
                for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                if i.type == pafs.FileType.File
                and not i.base_name.startswith((".", "_"))
                and i.base_name != MARKER
                and (Path(i.base_name).suffix in _FORMATS or Path(i.base_name).suffix in _COMPRESSION)
            ]
            if not infos:
                raise M2DError(
                    f"{what} {src.spec!r} is a directory with no .parquet, .jsonl, .json or .txt file; "
                    "give a directory of corpus shards, or a file"
                )
    out = sorted((CorpusFile(_with_query(i.path, loc), i.size, i.mtime_ns or 0) for i in infos), key=lambda f: f.url)
    formats = {f.format for f in out}
    if len(formats) > 1:
        raise M2DError(
            f"{what} {src.spec!r} mixes {' and '.join(sorted(formats))} files; give one format (e.g. a glob such as "
            "DIR/*.parquet)"
        )
    return out


def _open(f: CorpusFile):
    """A binary stream of a file's (decompressed) bytes."""
    fs, path = storage.filesystem(f.url)
    return fs.open_input_stream(path, compression=f.compression)


def decode(raw: bytes) -> str:
    """A text file's bytes as Python's text mode reads them: UTF-8 (undecodable bytes replaced) with universal
    newlines (``\\r\\n`` and a lone ``\\r`` become ``\\n``), so a corpus gives the same tokens whichever system
    wrote its line endings. Every reader of a text file goes through here; JSON Lines and Parquet values do not."""
    text = raw.decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def _text_of(f: CorpusFile) -> str:
    with _open(f) as s:
        return decode(s.read())


def file_documents(f: CorpusFile, column: str = "text") -> Iterator[list[str]]:
    """The documents of one file in batches of up to `_BATCH`, in order (the one reader of corpus files)."""
    if f.format == TEXT:
        text = _text_of(f)
        if text:
            yield [text]
    elif f.format == PARQUET:
        fs, path = storage.filesystem(f.url)
        with fs.open_input_file(path) as raw:
            for batch in pq.ParquetFile(raw).iter_batches(columns=[column], batch_size=_BATCH):
                docs = [t for t in batch.column(0).to_pylist() if t]
                if docs:
                    yield docs
    else:
        batch: list[str] = []
        with _open(f) as s:
            for n, line in enumerate(io.TextIOWrapper(s, encoding="utf-8", errors="replace"), 1):
                if not line.strip():
                    continue
                try:
                    doc = json.loads(line)[column]
                except (ValueError, KeyError, TypeError):
                    raise M2DError(
                        f"{f.url}:{n} is not a JSON object with a {column!r} field; fix the line or give #column=NAME"
                    ) from None
                if doc:
                    batch.append(doc)
                if len(batch) == _BATCH:
                    yield batch
                    batch = []
        if batch:
            yield batch


# ---- every source ------------------------------------------------------------------------------------
def parts(src: Source) -> list:
    """The independent pieces of a source, in order: its files, or the one stream of a dataset."""
    return files(src) if src.kind == "files" else [None]


def part_documents(src: Source, part) -> Iterator[list[str]]:
    """Batches of documents of one piece of `parts(src)`."""
    if src.kind == "files":
        yield from file_documents(part, src.column)
    elif src.kind == "synthetic":
        yield [corpus_text(src.split)]
    elif src.kind == "wikitext":
        yield ["".join(_hub_rows(src, streaming=False)["text"])]
    else:
        yield from _hub_batches(src)


def documents(spec: str) -> Iterator[str]:
    """The documents of a spec, in its fixed order."""
    src = parse(spec)
    for part in parts(src):
        for batch in part_documents(src, part):
            yield from batch


def read_text(spec: str, max_chars: int | None = None) -> str:
    """The text of a spec (documents joined by a blank line), read only up to `max_chars` characters."""
    out, n = [], 0
    for doc in documents(spec):
        out.append(doc)
        n += len(doc) + 2
        if max_chars is not None and n >= max_chars:
            break
    text = "\n\n".join(out)
    return text[:max_chars] if max_chars is not None else text


def _offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes") for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def _hub_rows(src: Source, streaming: bool):
    """A hub dataset (streamed, or from the local cache); one line naming how to get it when it cannot be had."""
    try:
        import datasets

        return datasets.load_dataset(src.location, src.config, split=src.split, streaming=streaming)
    except Exception as exc:  # offline without a cache, unknown dataset or split ...
        how = (
            f"run once online (python -c \"import datasets; datasets.load_dataset('{src.location}', "
            f"{src.config!r}, split='{src.split}')\") to cache it, or pass local Parquet / JSON Lines files"
        )
        raise M2DError(
            f"cannot load {src.location}{':' + src.config if src.config else ''} ({src.split}) through datasets "
            f"({type(exc).__name__}{', offline' if _offline() else ''}); {how}"
        ) from None


def _hub_batches(src: Source) -> Iterator[list[str]]:
    rows = _hub_rows(src, streaming=not _offline())
    batch: list[str] = []
    for row in rows:
        if src.column not in row:
            raise M2DError(f"{src.spec!r} has no column {src.column!r} (columns: {', '.join(row)}); add #column=NAME")
        if row[src.column]:
            batch.append(row[src.column])
        if len(batch) == _BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


# ---- checks and identity (driver, before any work) ------------------------------------------------------
def check(spec: str, what: str = "data") -> Source:
    """Refuse, in one line, a spec that cannot be read: no file matches, a shard that is corrupt, lacks the
    column or is binary, a hub dataset not reachable (offline without a cache). Reads footers and first lines.
    WikiText is not fetched here: calibration falls back to the embedded corpus when it cannot be had."""
    src = parse(spec, what)
    if src.kind == "hf":
        rows = _hub_rows(src, streaming=not _offline())
        first = next(iter(rows), None)
        if first is None:
            raise M2DError(f"{what} {spec!r} holds no rows; give another dataset or split")
        if src.column not in first:
            raise M2DError(
                f"{what} {spec!r} has no column {src.column!r} (columns: {', '.join(first)}); add #column=NAME"
            )
    elif src.kind == "files":
        found = files(src, what)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda f: _check_file(f, src.column, what), found))
    return src


def _check_file(f: CorpusFile, column: str, what: str) -> None:
    try:
        if f.format == PARQUET:
            import pyarrow.parquet as pq

            fs, path = storage.filesystem(f.url)
            with fs.open_input_file(path) as raw:
                names = pq.ParquetFile(raw).schema_arrow.names
            if column not in names:
                raise M2DError(
                    f"{what}: {f.url} has no column {column!r} (columns: {', '.join(names)}); add #column=NAME to the "
                    "spec"
                )
            return
        with _open(f) as s:
            head = s.read(_SNIFF)
    except M2DError:
        raise
    except Exception as exc:  # a truncated / corrupt Parquet footer, a bad gzip or zstd stream, no permission ...
        raise M2DError(
            f"{what}: {f.url} is corrupt or unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); "
            "fix or remove that file"
        ) from None
    if b"\0" in head or _undecodable(head):
        raise M2DError(f"{what} {f.url} is not a UTF-8 text file (binary content); give plain text")
    if f.format == JSONL and head.strip():
        line = head.split(b"\n", 1)[0]
        try:
            row = json.loads(line)
        except ValueError:
            if b"\n" in head or len(head) < _SNIFF:
                raise M2DError(f"{what}: {f.url}:1 is not JSON; give one JSON object per line") from None
            return
        if not isinstance(row, dict) or column not in row:
            have = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise M2DError(f"{what}: {f.url} has no field {column!r} (fields: {have}); add #column=NAME to the spec")


def _undecodable(head: bytes) -> bool:
    """More than 1% of the first bytes not UTF-8 (a cut multi-byte character at the end is fine)."""
    text = head.decode("utf-8", errors="replace")
    return text.count("\ufffd") > max(3, len(text) // 100)


def max_tokens(src: Source) -> int | None:
    """An upper bound on the tokens of a files corpus (its text's bytes plus one EOS per document: no
    byte-level tokenizer makes more), or None when unknown (compressed JSON Lines / text, datasets)."""
    if src.kind != "files":
        return None
    total = 0
    for f in files(src):
        if f.format == PARQUET:
            fs, path = storage.filesystem(f.url)
            with fs.open_input_file(path) as raw:
                meta = pq.ParquetFile(raw).metadata
            col = meta.schema.to_arrow_schema().get_field_index(src.column)
            total += sum(
                meta.row_group(g).column(col).total_uncompressed_size + 2 * meta.row_group(g).num_rows
                for g in range(meta.num_row_groups)
            )
        elif f.compression is None:
            total += f.size + 1
        else:
            return None
    return total


def fingerprint(spec: str) -> dict:
    """What identifies a spec's content: its files (names, sizes, mtimes), or the dataset and revision asked for."""
    src = parse(spec)
    if src.kind == "files":
        return {
            "spec": spec,
            "column": src.column,
            "files": [[f.url.partition("?")[0], f.size, f.mtime_ns] for f in files(src)],
        }
    return {"spec": spec, "column": src.column, "dataset": [src.location, src.config, src.split]}


def changes(old: dict, new: dict) -> str | None:
    """What differs between two fingerprints, in words (None: the same corpus)."""
    if old == new:
        return None
    if old.get("spec") != new.get("spec") or old.get("column") != new.get("column"):
        was, now = (f"{d.get('spec')!r} (column {d.get('column')!r})" for d in (old, new))
        return f"spec {was} is now {now}"
    a, b = {f[0]: f[1:] for f in old.get("files", [])}, {f[0]: f[1:] for f in new.get("files", [])}
    said = [f"{n} removed" for n in sorted(a.keys() - b.keys())] + [f"{n} added" for n in sorted(b.keys() - a.keys())]
    said += [
        f"{n} size {a[n][0]} -> {b[n][0]}" if a[n][0] != b[n][0] else f"{n} modified"
        for n in sorted(a.keys() & b.keys())
        if a[n] != b[n]
    ]
    return "; ".join(said[:3]) + (f" (+{len(said) - 3} more)" if len(said) > 3 else "") or "the dataset changed"
