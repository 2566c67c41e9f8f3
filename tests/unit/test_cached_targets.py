"""Stage 2's teacher-once data path without Ray: token shards read back in train_batches' order, the
teacher's targets computed over them, and students trained from cached targets without teacher weights; a GPU's
bf16 dtypes rehearsed on the CPU, and training steps that read nothing back to the host."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch
from conftest import SYNTHETIC_DISTILL, forbid
from torch.overrides import TorchFunctionMode

from m2d_ray.config import DistillConfig
from m2d_ray.data.synthetic import build_tokenizer
from m2d_ray.distill.data import train_batches
from m2d_ray.distill.loop import DistillJob, WorkerIO, run_distill
from m2d_ray.distill.targets import loss_metric, parse_targets
from m2d_ray.distill.tokens import TokenShards, write_tokens
from m2d_ray.errors import M2DError
from m2d_ray.models import default_teacher

CFG = dataclasses.replace(
    SYNTHETIC_DISTILL, steps=6, warmup_steps=1, batch_size=4, seq_len=64, eval_every=3, eval_max_tokens=1024
)
BLOCKS = CFG.steps * CFG.batch_size


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from m2d_ray.models import load_tokenizer

    d = tmp_path_factory.mktemp("tokens")
    write_tokens(
        d,
        load_tokenizer(default_teacher()),
        CFG.train_data,
        CFG.seq_len,
        BLOCKS,
        "synthetic:valid",
        CFG.eval_max_tokens,
        shard_blocks=10,
    )
    return d


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    from m2d_ray.commands.convert import convert_one

    out = tmp_path_factory.mktemp("init") / "random-ffn"
    convert_one(None, "sf", "rr", "uniform", None, out, baseline="random-ffn")
    return out


def make_targets(out, tokens, text: str, cfg: DistillConfig = CFG, stream: bool | None = None):
    """The targets pass of one actor (runtime/shards.TargetsActor, here without Ray) over two block ranges."""
    from m2d_ray.runtime.shards import targets_here

    spec = parse_targets(text, cfg.temperature, cfg.seed)
    targets_here(
        default_teacher(),
        str(tokens),
        str(out),
        spec,
        cfg.teacher_topk,
        4,
        [(0, 14), (14, BLOCKS - 14)],
        stream,
        cfg.precision,
    )
    return spec


def test_token_shards_give_train_batches_batches_for_every_rank_and_resume(tmp_path):
    tok = build_tokenizer()
    write_tokens(tmp_path, tok, "synthetic:train", 32, 50, "synthetic:valid", 500, shard_blocks=7)
    shards = TokenShards(tmp_path)
    for world, bs, start in [(1, 1, 0), (2, 3, 0), (3, 2, 5), (2, 4, 9)]:
        for rank in range(world):
            n = (50 - start) // (world * bs)
            want = list(itertools.islice(train_batches(tok, "synthetic:train", 32, bs, rank, world, start), n))
            got = list(itertools.islice(shards.batches(bs, rank, world, start), n))
            assert len(got) == n and all(torch.equal(a, b) for a, b in zip(want, got)), (world, bs, start, rank)
    assert shards.valid_ids().numel() == 500


def test_a_damaged_token_shard_is_named_and_another_tokenizer_refused(tmp_path):
    tok = build_tokenizer()
    write_tokens(tmp_path, tok, "synthetic:train", 32, 20, "synthetic:valid", 100, shard_blocks=7)
    shards = TokenShards(tmp_path)
    with pytest.raises(M2DError, match="seq_len"):
        shards.check(tok, 64, "synthetic:train")
    path = tmp_path / "tokens-00001.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(M2DError, match="tokens-00001.safetensors is damaged"):
        list(itertools.islice(shards.batches(4), 3))


def _train(student, out, tokens, targets=None, spec=None, cfg: DistillConfig = CFG):
    reports = []
    job = DistillJob(
        default_teacher(),
        str(student),
        cfg,
        "synthetic:valid",
        out=str(out),
        tokens=str(tokens),
        targets=targets,
        target_spec=spec,
    )
    run_distill(job, WorkerIO(report=lambda m, ckpt: reports.append(m)))
    return reports


_ONLINE: dict = {}


def _online(student, tokens, tmp_path, cfg: DistillConfig = CFG):
    """The online teacher's reports for `cfg` (trained once per module)."""
    if cfg not in _ONLINE:
        _ONLINE[cfg] = _train(student, tmp_path / "online", tokens, cfg=cfg)
    return _ONLINE[cfg]


def _no_teacher_weights(monkeypatch):
    from m2d_ray import models

    for name in ("load_distill_teacher", "load_teacher"):
        forbid(monkeypatch, models, name, "a student with cached targets loaded teacher weights")


def test_cached_topk_over_the_whole_vocabulary_trains_as_the_online_teacher(student, tokens, tmp_path, monkeypatch):
    """K = vocabulary: the cached loss is the online loss (up to the fp16 log-probs), and no teacher weights load."""
    from m2d_ray import models

    online = _online(student, tokens, tmp_path)
    vocab = models.model_config(default_teacher()).vocab_size
    spec = make_targets(tmp_path / "targets", tokens, f"topk:{vocab}")
    _no_teacher_weights(monkeypatch)
    cached = _train(student, tmp_path / "cached", tokens, str(tmp_path / "targets"), spec)
    assert [r["step"] for r in cached] == [r["step"] for r in online] == [3, 6]
    for a, b in zip(online, cached):  # top-K's loss is reported apart (a lower bound of the KL; here K = V: the KL)
        assert "train_loss" not in b and b["train_loss_buckets"] == pytest.approx(a["train_loss"], rel=2e-3)
        assert b["val_ppl"] == pytest.approx(a["val_ppl"], rel=2e-3)
    assert cached[-1]["peak_rss_bytes"] > 0


EXPANDED = dataclasses.replace(CFG, loss="rkl", temperature=2.0, teacher_topk=4)


@pytest.mark.parametrize("cfg,stream", [(CFG, False), (EXPANDED, True)], ids=["fkl-whole", "rkl-T2-k4-streamed"])
def test_hidden_targets_train_report_for_report_as_the_online_teacher(
    student, tokens, tmp_path, monkeypatch, cfg, stream
):
    """Cached final hidden states + the teacher's head alone = the online loss: forward and reverse KL, a
    temperature, the expanded routing k' (the pass runs the teacher with it), the whole or layer-streamed pass."""
    from m2d_ray.distill import loop

    online = _online(student, tokens, tmp_path, cfg)
    spec = make_targets(tmp_path / "targets", tokens, "hidden", cfg, stream=stream)
    _no_teacher_weights(monkeypatch)
    heads = []
    read_head = loop.read_output_head
    monkeypatch.setattr(
        loop, "read_output_head", lambda *a: heads.append(a) or read_head(*a)
    )  # where the rank calls it
    cached = _train(student, tmp_path / "cached", tokens, str(tmp_path / "targets"), spec, cfg)
    assert len(heads) == 1 and [r["step"] for r in cached] == [r["step"] for r in online] == [3, 6]
    for a, b in zip(online, cached):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5) and b["val_ppl"] == pytest.approx(
            a["val_ppl"], rel=1e-5
        )
    assert cached[-1]["val_ppl"] < cached[-1]["val_ppl_initial"]


def test_hidden_targets_of_another_routing_or_teacher_are_refused_by_the_rank(student, tokens, tmp_path):
    """The rank checks the manifest against its own job (teacher, k', tokens), not against the manifest itself."""
    spec = make_targets(tmp_path / "t", tokens, "hidden")
    with pytest.raises(M2DError, match="teacher_topk None, this run's is 4"):
        _train(student, tmp_path / "s", tokens, str(tmp_path / "t"), spec, dataclasses.replace(CFG, teacher_topk=4))


@pytest.mark.parametrize("text", ["topk:8", "sampled:8"])
def test_sparse_targets_distil(student, tokens, tmp_path, text):
    spec = make_targets(tmp_path / "t", tokens, text)
    reports = _train(student, tmp_path / "s", tokens, str(tmp_path / "t"), spec)
    assert reports[-1]["val_ppl"] < reports[-1]["val_ppl_initial"] and all(
        np.isfinite(r[loss_metric(spec)]) for r in reports
    )


def test_targets_of_another_token_stream_are_refused(student, tokens, tmp_path):
    spec = make_targets(tmp_path / "t", tokens, "topk:4")
    m = json.loads((tmp_path / "t" / "manifest.json").read_text())
    m["fingerprint"]["tokens"] = "0" * 64
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(M2DError, match="tokens"):
        _train(student, tmp_path / "s", tokens, str(tmp_path / "t"), spec)


# ---- a GPU's dtypes rehearsed on the CPU (distill.precision=bf16-mixed: the code path a GPU takes with auto) ------

BF16 = dataclasses.replace(CFG, precision="bf16-mixed")


def _spy(monkeypatch, module, name: str, seen: list, what) -> None:
    """Record what(result, *args) of every call of module.name (looked up by name at call time)."""
    fn = getattr(module, name)

    def spied(*args, **kwargs):
        out = fn(*args, **kwargs)
        seen.append(what(out, *args))
        return out

    monkeypatch.setattr(module, name, spied)


def _shard_dtypes(directory) -> dict:
    from m2d_ray.distill.targets import TargetsManifest, read_shard

    return {k: v.dtype for e in TargetsManifest.load(directory).shards for k, v in read_shard(directory, e).items()}


def _rank_dtypes(monkeypatch) -> tuple[list, list]:
    """Spies on a rank's boundaries: (the head applied: (states, head, log-probs) dtypes; each micro-batch's loss
    dtype)."""
    from m2d_ray.distill import losses, step

    heads, loss = [], []
    _spy(monkeypatch, losses, "log_probs", heads, lambda out, h, w, t: (h.dtype, w.dtype, out.dtype))
    _spy(monkeypatch, step.StudentLoss, "forward", loss, lambda out, *a: out.dtype)
    return heads, loss


def test_bf16_on_the_cpu_hidden_targets_train_as_the_online_teacher(student, tokens, tmp_path, monkeypatch):
    """A GPU's dtypes, on the CPU: the teacher in bf16 (online and in the targets pass), its hidden states stored in
    bf16, its head applied to them in bf16 with the log-softmax and KL in float32, the student in bf16; the cached
    `hidden` loss is the online one within bf16's tolerance, 1e-2 (on this CPU it is bitwise the same: the same bf16
    products; a GPU's kernels may differ with the batch's shape), and the float32 test above holds it to 1e-5."""
    from m2d_ray.distill import step

    t_last, heads_online, loss_online = [], *_rank_dtypes(monkeypatch)
    _spy(monkeypatch, step, "teacher_outputs", t_last, lambda out, *a: out[0].dtype)
    online = _train(student, tmp_path / "online", tokens, cfg=BF16)
    assert set(t_last) == {torch.bfloat16} and len(t_last) == BF16.steps
    assert set(heads_online) == {(torch.bfloat16, torch.bfloat16, torch.float32)} and set(loss_online) == {
        torch.float32
    }

    spec = make_targets(tmp_path / "targets", tokens, "hidden", BF16, stream=False)
    assert _shard_dtypes(tmp_path / "targets") == {"hidden": torch.bfloat16}
    monkeypatch.undo()
    heads, loss = _rank_dtypes(monkeypatch)
    cached = _train(student, tmp_path / "cached", tokens, str(tmp_path / "targets"), spec, BF16)
    assert (
        set(heads) == {(torch.bfloat16, torch.bfloat16, torch.float32)}
        and set(loss) == {torch.float32}
        and len(loss) == BF16.steps
    )
    assert [r["step"] for r in cached] == [r["step"] for r in online] == [3, 6]
    for a, b in zip(online, cached):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-2) and b["val_ppl"] == pytest.approx(
            a["val_ppl"], rel=1e-2
        )
    fp32 = _online(student, tokens, tmp_path)  # bf16 really ran: its losses are not float32's to float32's precision
    assert online[-1]["train_loss"] != pytest.approx(fp32[-1]["train_loss"], rel=1e-5)
    assert cached[-1]["val_ppl"] < cached[-1]["val_ppl_initial"]


STORED = {
    "topk:8": {"ids": torch.int32, "logp": torch.float16, "tail": torch.float32},
    "sampled:8": {"ids": torch.int32, "counts": torch.uint8, "logp": torch.float16},
}


@pytest.mark.parametrize("text", sorted(STORED))
def test_bf16_on_the_cpu_sparse_targets_reach_the_loss_in_their_stored_dtypes(
    student, tokens, tmp_path, monkeypatch, text
):
    """The bf16 teacher's top-K / sampled targets are stored in their own dtypes (int32 ids, fp16 log-probs, fp32 tail,
    uint8 counts) and reach the loss in them, beside the bf16 student's states and head (nothing widened on the way)."""
    from m2d_ray.distill import step

    spec = make_targets(tmp_path / "t", tokens, text, BF16)
    assert _shard_dtypes(tmp_path / "t") == STORED[text]
    name = "sparse_kl" if spec.mode == "topk" else "sampled_kl"
    seen: list = []
    _spy(
        monkeypatch,
        step,
        name,
        seen,
        lambda out, h, w, *t: (h.dtype, w.dtype, {k: x.dtype for k, x in zip(STORED[text], t)}, out.dtype),
    )
    reports = _train(student, tmp_path / "s", tokens, str(tmp_path / "t"), spec, BF16)
    assert (
        set(map(str, seen)) == {str((torch.bfloat16, torch.bfloat16, STORED[text], torch.float32))}
        and len(seen) == BF16.steps
    )
    assert reports[-1]["val_ppl"] < reports[-1]["val_ppl_initial"] and all(
        np.isfinite(r[loss_metric(spec)]) for r in reports
    )


# ---- device-agnostic steps: no host read-back, no CUDA named, inside a training step -------------------------------


class HostProbe(TorchFunctionMode):
    """Every torch call, while active, that reads a tensor back to the host (`.item()`, `.tolist()`, `.numpy()`,
    `.cpu()`, `float(t)`, `int(t)`, `bool(t)` as in `if t:`, formatting) or names a CUDA device (`.cuda()`, a
    `"cuda"` / cuda `torch.device` argument): (call, file, line) of its innermost caller outside torch."""

    READS = frozenset(
        {
            "item",
            "tolist",
            "numpy",
            "cpu",
            "__float__",
            "__int__",
            "__index__",
            "__bool__",
            "__complex__",
            "__format__",
            "__repr__",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        cuda = any(
            (isinstance(a, str) and a.startswith("cuda")) or (isinstance(a, torch.device) and a.type == "cuda")
            for a in (*args, *kwargs.values())
        )
        if name in self.READS or name == "cuda" or cuda:
            self.seen.append((name + " naming cuda" * cuda, *_caller()))
        return func(*args, **kwargs)


def _caller() -> tuple[str, str]:
    """(file, source line) of the innermost frame outside torch and the probe."""
    import linecache
    import os
    import sys

    frame, torch_dir = sys._getframe(1), os.path.dirname(torch.__file__)
    while frame.f_code.co_filename.startswith(torch_dir) or frame.f_code.co_name == "__torch_function__":
        frame = frame.f_back
    return frame.f_code.co_filename, linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()


#: read-backs in third-party code that a step runs, each allowed for a reason (file suffix, source line)
KNOWN_READS = {
    # transformers 5 looks for packed sequences in position_ids whenever no attention mask is given: one bool per
    # model forward (the teacher's and the student's), on a GPU too; the MoE forward takes no prepared mask mapping
    # and a 4-D mask would give up SDPA's causal path, so it stays (benchmarks/RESULTS.md, "The GPU acceptance call")
    (
        "transformers/masking_utils.py",
        "if not is_tracing(packed_sequence_mask) and (packed_sequence_mask[:, -1] == 0).all():",
    ),
    # the eager experts loop, which only a CPU runs (models.load_model: eager on CPU; a GPU runs grouped_mm)
    ("transformers/models/qwen3_moe/modeling_qwen3_moe.py", "if expert_idx == self.num_experts:"),
}


def test_the_host_probe_sees_read_backs_and_cuda():
    """The probe below can fail: each kind of read-back and a named CUDA device is recorded, at this file's caller."""
    x, probe = torch.ones(2), HostProbe()
    with probe:
        x[0].item(), float(x[0]), int(x[0]), bool(x[0]), x.tolist(), x.numpy(), x.cpu(), f"{x[0]}"
        for make in (lambda: x.cuda(), lambda: x.to("cuda"), lambda: torch.zeros(1, device=torch.device("cuda"))):
            with contextlib.suppress(Exception):  # no CUDA here: recorded, then refused by torch
                make()
    assert [c for c, _, _ in probe.seen] == [
        "item",
        "__float__",
        "__int__",
        "__bool__",
        "tolist",
        "numpy",
        "cpu",
        "__format__",
        "cuda",
        "to naming cuda",
        "device naming cuda",
        "zeros naming cuda",
    ]
    assert {f for _, f, _ in probe.seen} == {__file__}


PROBED = dataclasses.replace(CFG, steps=2, eval_every=2, grad_accum=2)


@pytest.mark.parametrize(
    "targets,loss", [("online", "fkl+mse"), ("hidden", "rkl"), ("topk:8", "fkl"), ("sampled:8", "fkl")]
)
def test_a_training_step_reads_nothing_back_to_the_host_and_names_no_device(
    student, tokens, tmp_path, monkeypatch, targets, loss
):
    """Inside `DistillStep.step` (teacher, student, loss, backward, clip, AdamW; every micro-batch of an
    accumulation) no tensor is read back to the host and no CUDA device is named: on a GPU a read-back stalls the
    queue every step, and a hard-coded device breaks a CPU worker. Reads belong to the reporting points
    (`take_loss`, validation, the stop poll), which run outside `step`.

    A probe (a TorchFunctionMode) on real steps on the CPU rather than an AST scan of distill/: `float(t)`, `int(t)`
    and `if t:` look like `float(temperature)` to a parser but are calls of `Tensor.__float__` / `__bool__` to the
    probe, and the probe also sees what the step calls elsewhere (arch/, transformers, torch.optim): a library's
    read-back fails the test too unless KNOWN_READS lists it with its reason. What it cannot see: branches the CPU
    never takes (DDP, DeepSpeed's engine) and `.to("cpu")`, which on the CPU cannot be told from `.to(device)`."""
    from m2d_ray.distill.step import DistillStep

    cfg = dataclasses.replace(PROBED, loss=loss)
    spec = make_targets(tmp_path / "t", tokens, targets, cfg) if targets != "online" else None
    probe, step = HostProbe(), DistillStep.step

    def probed(self, micro_batches):
        assert len(micro_batches) == cfg.grad_accum
        with probe:
            step(self, micro_batches)

    monkeypatch.setattr(DistillStep, "step", probed)
    reports = _train(student, tmp_path / "s", tokens, str(tmp_path / "t") if spec else None, spec, cfg)
    unknown = {
        (call, f"{file}: {line}")
        for call, file, line in probe.seen
        if not any(file.endswith(f) and line == t for f, t in KNOWN_READS)
    }
    assert unknown == set() and reports[-1]["step"] == cfg.steps and np.isfinite(reports[-1][loss_metric(spec)])
