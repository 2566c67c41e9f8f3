"""Lazy teacher weights and layer-streamed calibration, per family (tests/families.py).

(a) a student built from a `LazyTeacher` is bitwise the one built from the loaded teacher (same plan),
    from the hub layout (`save_pretrained`: per-expert keys, or fused for GPT-OSS) and from a fused
    in-memory layout, and its export check passes reading each layer's experts lazily;
(b) only the experts a plan merges are read;
(c) streamed calibration equals the whole-model pass (float64 round-off), hidden states spilled or not;
(d) damaged checkpoints: a NaN names the tensor, layer and expert; a truncated file names the file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import forbid
from families import FAMILIES, FAMILY_IDS, tiny_model
from safetensors.torch import save_file

from m2d_ray.arch import get_adapter
from m2d_ray.arch.base import rel_error
from m2d_ray.calibrate import calibrate
from m2d_ray.calibrate.collect import collect_stats
from m2d_ray.calibrate.stream import HiddenStates, collect_stats_streamed, should_stream
from m2d_ray.catalog.methods import RANDOM_BASELINES
from m2d_ray.checkpoint import Checkpoint, Shard
from m2d_ray.convert.build import build_from_plan
from m2d_ray.convert.export import export_student
from m2d_ray.convert.plan import make_plan, make_plans
from m2d_ray.data.synthetic import build_tokenizer
from m2d_ray.errors import M2DError
from m2d_ray.models import Teacher
from m2d_ray.sizes import parse_size
from m2d_ray.weights import check_finite, open_teacher

FIELDS = ("tokens", "count", "psum", "psel", "wsel", "gram", "shared_gate")


def save(model, out, layout: str):
    """`hub`: save_pretrained (what the hub holds); `fused`: the in-memory tensors under their own names."""
    if layout == "hub":
        model.save_pretrained(out)
    else:
        out.mkdir(parents=True)
        model.config.save_pretrained(out)
        save_file(
            {
                k: v.contiguous()
                for k, v in model.state_dict().items()
                if k != "lm_head.weight" or not model.config.tie_word_embeddings
            },
            str(out / "model.safetensors"),
        )
    build_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=FAMILIES, ids=FAMILY_IDS)
def family(request, tmp_path_factory):
    model = tiny_model(request.param, seed=0)
    eager = Teacher(name=request.param.id, model=model, tokenizer=None, adapter=get_adapter(model.config))
    ids = torch.randint(0, model.config.vocab_size, (5, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # right padding
    mask[4, :5] = 0  # left padding
    stats = collect_stats(model, eager.adapter, ids, mask, batch_size=2, progress=False)
    hub = save(model, tmp_path_factory.mktemp(request.param.id) / "hub", "hub")
    return request.param, eager, stats, ids, mask, hub


def same_state(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    bufs = zip(a.named_buffers(), b.named_buffers())
    return (
        sa.keys() == sb.keys()
        and all(sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)
        and all(n == m and torch.equal(x, y) for (n, x), (m, y) in bufs)
    )


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_lazy_student_is_bitwise_the_eager_one(family, layout, tmp_path):
    spec, eager, stats, _, _, hub = family
    lazy = open_teacher(str(hub if layout == "hub" else save(eager.model, tmp_path / "fused", "fused")))
    assert lazy.dtype == eager.dtype
    k = eager.adapter.top_k(eager.config)
    for recipe in [("do-acp", "oc", "uniform", k), ("acp", "wc", "proportional", 2 * k), ("cp", "ab", "avg-cp", 2 * k)]:
        plan = make_plan(eager, stats, *recipe)
        assert make_plan(lazy, stats, *recipe).to_json() == plan.to_json(), recipe
        student = build_from_plan(lazy, plan)
        assert type(student).__name__ == spec.student_class
        assert same_state(student, build_from_plan(eager, plan)), recipe
    record = export_student(
        student, lazy.tokenizer, tmp_path / "s", teacher=lazy, plan=plan
    )  # the float64 check, lazily
    assert record["max_rel_error"] < 1e-10
    assert same_state(RANDOM_BASELINES["random-ffn"](lazy), RANDOM_BASELINES["random-ffn"](eager))


def _record_reads(monkeypatch) -> list[tuple[str, list[int] | None]]:
    """(tensor name, rows or None for all) of every read from a checkpoint shard from now on."""
    read: list[tuple[str, list[int] | None]] = []
    original = Shard.read
    monkeypatch.setattr(
        Shard,
        "read",
        lambda self, name, rows=None, out=None: read.append((name, rows)) or original(self, name, rows, out),
    )
    return read


def test_only_the_planned_experts_are_read(family, monkeypatch):
    spec, eager, stats, _, _, hub = family
    lazy = open_teacher(str(hub))
    plan = make_plan(eager, stats, "sf", "rr", "uniform", 2 * eager.adapter.top_k(eager.config))
    read = _record_reads(monkeypatch)
    build_from_plan(lazy, plan)
    for i, p in plan.layers.items():
        got = set()
        for name, rows in read:
            if f"layers.{i}." not in name or ".experts." not in name:
                continue
            per_expert = re.search(r"\.experts\.(\d+)\.", name)
            assert per_expert or rows is not None, f"{name} read whole"
            got.update([int(per_expert[1])] if per_expert else rows)
        assert got == set(p.selected), (i, sorted(got), sorted(p.selected))


def test_planning_reads_only_the_experts_a_recipe_selects(family, monkeypatch):
    """Weight clustering reads the selected experts of a layer, not all E (planning memory)."""
    spec, eager, stats, _, _, hub = family
    lazy = open_teacher(str(hub))
    k, E = eager.adapter.top_k(eager.config), eager.adapter.num_experts(eager.config)
    if 2 * k >= E:
        pytest.skip("every expert is selected at K = 2k")
    recipes = [("acp", "wc", "proportional", 2 * k), ("sf", "wc", "uniform", 2 * k)]
    read = _record_reads(monkeypatch)
    plans = make_plans(lazy, stats, recipes)
    assert [p.to_json() for p in plans] == [p.to_json() for p in make_plans(eager, stats, recipes)]
    for i in stats:
        got = set()
        for name, rows in read:
            if f"layers.{i}." in name and ".experts." in name:
                per_expert = re.search(r"\.experts\.(\d+)\.", name)
                got.update([int(per_expert[1])] if per_expert else rows)
        assert got == {e for p in plans for e in p.layers[i].selected}, i


def test_reading_a_checkpoint_maps_none_of_its_files(tiny_teacher_dir, tmp_path):
    """Positional reads, not a memory map: a mapped shard keeps pages around every read resident."""
    import shutil

    copy = Path(shutil.copytree(tiny_teacher_dir, tmp_path / "teacher"))  # files no other test's loaded model maps
    ck = Checkpoint(copy)
    for name in sorted(ck.names()):
        t = ck.read(name)
        dst = torch.empty_like(t)
        assert ck.read(name, out=dst) is dst and torch.equal(dst, t)
        assert torch.equal(ck.read(name, rows=[0]), t[:1])
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert not any(str(f.resolve()) in maps.read_text() for f in copy.glob("*.safetensors"))
    name = next(n for n in sorted(ck.names()) if ck.shard(n).dtype(n).is_floating_point)
    with pytest.raises(ValueError, match="cannot read"):
        ck.read(name, out=torch.empty(ck.shard(name).shape(name), dtype=torch.float64))


def test_streamed_calibration_equals_whole_model(family):
    spec, eager, stats, ids, mask, hub = family
    lazy = open_teacher(str(hub))
    for spill in (None, 0):  # hidden states in memory, then in a file
        streamed = collect_stats_streamed(lazy, ids, mask, batch_size=2, progress=False, spill_above=spill)
        assert sorted(streamed) == sorted(stats)
        for i, st in stats.items():
            for f in FIELDS:
                assert rel_error(getattr(streamed[i], f), getattr(st, f)) <= 1e-12, (i, f)
    assert float(stats[min(stats)].tokens) == int(mask.sum())


def test_calibrate_streams_when_the_teacher_does_not_fit(tiny_teacher_dir, tiny_teacher, tmp_path):
    from m2d_ray.data.text import calibration_set, load_text

    lazy = open_teacher(str(tiny_teacher_dir))
    assert should_stream(lazy, "cpu", max_memory="1MB") and not should_stream(lazy, "cpu", max_memory="1TB")
    assert should_stream(lazy, "cpu", stream=True, max_memory="1TB") and not should_stream(
        lazy, "cpu", stream=False, max_memory=1
    )
    tokens = calibration_set(lazy.tokenizer, load_text("synthetic:valid")[:3000], seq_len=64, max_tokens=None)
    whole, _ = calibrate(tiny_teacher, tokens, "x", out=tmp_path / "whole", progress=False)
    streamed, reused = calibrate(lazy, tokens, "x", out=tmp_path / "streamed", progress=False, max_memory="1MB")
    assert not reused and streamed.manifest["engine"] == "streamed" and whole.manifest["engine"] == "whole"
    assert streamed.manifest["model"] == whole.manifest["model"]
    for i, st in whole.layers.items():
        for f in FIELDS:
            assert rel_error(getattr(streamed.layers[i], f), getattr(st, f)) <= 1e-12, (i, f)
    assert calibrate(lazy, tokens, "x", out=tmp_path / "whole", progress=False)[1]  # reused across engines


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hidden_states_spill_to_a_file_exactly(dtype):
    shapes = [(2, 5, 3), (1, 5, 3)]
    values = [torch.randn(s).to(dtype) for s in shapes]
    for spill, on_disk in ((1 << 30, False), (0, True)):
        store = HiddenStates(shapes, dtype, spill)
        assert store.spilled == on_disk
        for b, v in enumerate(values):
            store.put(b, v)
        assert all(torch.equal(store.get(b), v) and store.get(b).dtype == dtype for b, v in enumerate(values))
        if not on_disk:  # written in place: one buffer, no new host tensor per batch and layer
            ptr = store.get(0).data_ptr()
            store.put(0, values[0] * 2)
            assert store.get(0).data_ptr() == ptr and torch.equal(store.get(0), values[0] * 2)
        store.close()


def test_parse_size():
    assert parse_size("24GB") == 24 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("2e9") == 2 * 10**9
    assert parse_size(None) is None and parse_size(7) == 7
    with pytest.raises(M2DError, match="not understood"):
        parse_size("lots")


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_nan_in_a_teacher_weight_names_tensor_layer_and_expert(layout, tmp_path):
    spec = FAMILIES[0]  # qwen3_moe: layer 0 dense, 1 and 2 MoE
    model = tiny_model(spec, seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.gate_up_proj[5, 3, 7] = float("nan")
    lazy = open_teacher(str(save(model, tmp_path / layout, layout)))
    lazy.experts(1, [0, 1, 2])  # the damaged expert is not read: nothing to report
    with pytest.raises(M2DError) as err:
        lazy.experts(1, [2, 5])
    msg = str(err.value)
    assert "layer 1" in msg and "expert 5" in msg and "1 NaN" in msg
    assert ("experts.5.gate_proj.weight" if layout == "hub" else "mlp.experts.gate_up_proj") in msg
    with pytest.raises(M2DError, match="inf"):
        check_finite("model.norm.weight", torch.tensor([1.0, float("inf")]))


def test_truncated_or_corrupt_checkpoint_names_the_file(tmp_path):
    out = save(tiny_model(FAMILIES[0], seed=0), tmp_path / "t", "hub")
    weights = out / "model.safetensors"
    raw = weights.read_bytes()
    weights.write_bytes(raw[: len(raw) - 100])
    with pytest.raises(M2DError, match=f"{weights} is not a whole safetensors file.*truncated"):
        open_teacher(str(out))
    with pytest.raises(M2DError, match=f"{weights} is not a whole safetensors file.*truncated"):
        Checkpoint(out)  # the reader's own check says the same
    weights.write_bytes(b"\xff" * 64)
    with pytest.raises(M2DError, match=f"{weights}.*truncated or corrupt"):
        open_teacher(str(out))
    weights.unlink()
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-1.safetensors"}})
    )
    with pytest.raises(M2DError, match="lacks 1 weight file.*model-1.safetensors"):
        open_teacher(str(out))
    with pytest.raises(M2DError, match="lacks the weight file model-1.safetensors"):
        Checkpoint(out)


def test_a_header_that_does_not_match_its_tensors_names_the_file(tmp_path):
    """A header whose byte range disagrees with a tensor's dtype x shape is refused by the reader (one line)."""
    out = save(tiny_model(FAMILIES[0], seed=0), tmp_path / "t", "hub")
    weights = out / "model.safetensors"
    raw = weights.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in sorted(header) if k != "__metadata__")
    header[name]["shape"] = [*header[name]["shape"][:-1], header[name]["shape"][-1] * 2]  # claims twice its bytes
    text = json.dumps(header).encode()  # data offsets are relative to the data: only the length prefix changes
    weights.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    with pytest.raises(M2DError, match=f"{weights} is not a whole safetensors file.*{re.escape(name)}"):
        Checkpoint(out)


def test_initial_student_of_a_distillation_reads_the_teacher_lazily(
    tiny_teacher_dir, tiny_teacher, tmp_path, monkeypatch
):
    """The stage-2 initial student (built by rank 0 from `InitialStudent`) never loads the teacher whole and
    is bitwise the student `materialize` makes from the loaded teacher (plan and baseline)."""
    import m2d_ray.models as models
    from m2d_ray.calibrate.collect import collect_stats as collect
    from m2d_ray.convert.initial import InitialStudent, materialize
    from m2d_ray.data.text import calibration_set, load_text

    tokens = calibration_set(tiny_teacher.tokenizer, load_text("synthetic:valid")[:3000], seq_len=64, max_tokens=None)
    stats = collect(tiny_teacher.model, tiny_teacher.adapter, tokens.ids, tokens.mask, progress=False)
    plan = make_plan(tiny_teacher, stats, "do-acp", "rr", "uniform", 4)
    materialize(tiny_teacher, tmp_path / "eager", plan=plan)
    materialize(tiny_teacher, tmp_path / "eager-base", baseline="random-ffn", seed=3)

    for name in ("load_teacher", "load_model"):
        forbid(monkeypatch, models, name, "the initial student loaded the whole teacher")
    InitialStudent(str(tiny_teacher_dir), plan=plan)(tmp_path / "lazy")
    InitialStudent(str(tiny_teacher_dir), baseline="random-ffn", seed=3)(tmp_path / "lazy-base")
    from safetensors.torch import load_file

    for a, b in (("eager", "lazy"), ("eager-base", "lazy-base")):
        x, y = load_file(str(tmp_path / a / "model.safetensors")), load_file(str(tmp_path / b / "model.safetensors"))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), (a, b)
    assert json.loads((tmp_path / "lazy" / "m2d_plan.json").read_text())["verification"]["max_rel_error"] < 1e-10


# ---- cached final hidden states (stage2.targets: hidden) -----------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logits_recomputed_from_stored_states_are_the_teachers_own(family, stream):
    """The targets pass's final hidden states (after the final norm: the streamed pass applies it itself) times
    the head a student's rank reads alone give the teacher's own forward logits, in every family."""
    from m2d_ray.runtime.shards import _teacher_forward
    from m2d_ray.weights import read_output_head

    _, eager, _, ids, _, hub = family
    hidden, w = _teacher_forward(str(hub), None, "cpu", 2, stream, None, head=False)
    assert w is None  # hidden states need no head (streamed: it is not even read)
    h = torch.cat(list(hidden(ids)))
    head = read_output_head(str(hub), torch.float32)
    with torch.no_grad():
        ref = eager.model(input_ids=ids).logits
    assert torch.equal(head, eager.model.get_output_embeddings().weight)
    assert (h @ head.T - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_the_head_of_tied_embeddings_is_read_from_the_embedding(tmp_path):
    """A tied checkpoint stores the embedding alone (save_pretrained drops lm_head.weight): that is the head."""
    from transformers import AutoModelForCausalLM

    from m2d_ray.checkpoint import read_stored_tensor
    from m2d_ray.weights import read_output_head

    cfg = FAMILIES[0].make_config()
    cfg.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, experts_implementation="eager")
    hub = save(model, tmp_path / "tied", "hub")
    assert "lm_head.weight" not in Checkpoint(hub).names()
    head = read_output_head(str(hub), torch.bfloat16)
    assert head.dtype == torch.bfloat16 and torch.equal(
        head, model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    )
    # the ranged reads a rank makes of a teacher in object storage (any pyarrow filesystem; here a local one)
    name, t = read_stored_tensor(str(hub), ["lm_head.weight", "model.embed_tokens.weight"])
    assert name == "model.embed_tokens.weight" and torch.equal(t, model.get_input_embeddings().weight.detach())
    assert read_stored_tensor(str(hub), ["nothing.here"]) is None


def test_a_soft_capped_head_is_refused_by_name():
    from m2d_ray.arch.head import check_plain_head

    cfg = FAMILIES[0].make_config()
    check_plain_head(cfg)
    cfg.final_logit_softcapping = 30.0
    with pytest.raises(M2DError, match=r"final_logit_softcapping=30.0\); use stage2.targets=online or sampled:N$"):
        check_plain_head(cfg)


def test_a_hub_teachers_head_downloads_only_the_shard_that_holds_it(tmp_path, monkeypatch):
    """A hub teacher (no local directory): its JSON files and the one weight shard with lm_head, not the checkpoint."""
    import m2d_ray.weights as w

    model = tiny_model(FAMILIES[0])
    hub = tmp_path / "hub"
    model.save_pretrained(hub, max_shard_size="20KB")
    index = json.loads((hub / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    fetched = []

    def snapshot(name, allow_patterns):
        assert name == "org/moe" and allow_patterns == ["*.json"]
        return str(hub)

    def one_file(name, filename):
        fetched.append(filename)
        return str(hub / filename)

    monkeypatch.setattr(w, "snapshot_download", snapshot)  # (the hub client as weights.py calls it)
    monkeypatch.setattr(w, "hf_hub_download", one_file)
    monkeypatch.setattr(w, "model_config", lambda name: model.config)  # (the config from the hub: no network here)
    head = w.read_output_head("org/moe", torch.float32)
    assert torch.equal(head, model.lm_head.weight.detach()) and fetched == [index["lm_head.weight"]]
