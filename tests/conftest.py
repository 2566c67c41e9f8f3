"""Shared fixtures: a tiny saved Qwen3-MoE teacher with the synthetic corpus' tokenizer."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from m2d_ray.config import DistillConfig

ROOT = Path(__file__).resolve().parents[1]  # the repository
SHARED = ROOT.parent / "shared"
#: stage 2 on the synthetic corpus at a learning rate that moves a tiny student in a few steps; each test sets its sizes
SYNTHETIC_DISTILL = DistillConfig(train_data="synthetic:train", lr=3e-3, min_lr=3e-4, deepspeed=False)
#: calibration at test size on the synthetic corpus' validation split (`m2d calibrate`, `convert`, `prune-dense` flags)
SMALL_CALIB = ["--calib-data", "synthetic:valid", "--max-tokens", "1024", "--seq-len", "64"]

torch.set_num_threads(min(2, torch.get_num_threads()))


@functools.lru_cache(maxsize=1)
def multinode_unavailable() -> str | None:
    """Why the two-node cluster of tests/ray/multinode.py cannot be built here (None: it can)."""
    if shutil.which("unshare") is None or shutil.which("ray") is None:
        return "needs unshare and the ray CLI"
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return "needs moto[server] (pip install -e '.[test]')"
    from importlib.metadata import version

    if tuple(int(x) for x in version("moto").split(".")[:3]) < (5, 2, 5):
        return "needs moto >= 5.2.5 (5.2.1's CompleteMultipartUpload reply breaks pyarrow): pip install -e '.[test]'"
    probe = subprocess.run(
        ["unshare", "-pf", "--mount-proc", "unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
        capture_output=True,
    )
    return (
        None
        if probe.returncode == 0
        else f"cannot make PID/mount namespaces here (root needed): {probe.stderr.decode()[:200]}"
    )


def script_env() -> dict[str, str]:
    """The environment of a test script run as `python tests/ray/SCRIPT.py` (its own directory first on sys.path):
    the repository's root on PYTHONPATH too, so that it imports the workshop package as the tests do."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or skip the test when it is absent (CI without shared data)."""
    p = SHARED.joinpath(*parts)
    if not p.exists():
        pytest.skip(f"{p} not present")
    return p


def pytest_collection_modifyitems(config, items):
    if os.environ.get("M2D_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: set M2D_SLOW=1 or run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_teacher_dir(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Qwen3-MoE (E=8, k=2) saved natively with a tokenizer."""
    from transformers import AutoModelForCausalLM

    from m2d_ray.arch.qwen3_moe import moe_config
    from m2d_ray.data.synthetic import build_tokenizer
    from workshop.random_models import tokenizer_fields

    tok = build_tokenizer()
    shape = dict(hidden=32, ffn=64, expert_width=16, layers=2, heads=2, kv_heads=1, head_dim=16, experts=8, top_k=2)
    cfg = moe_config(**shape, **tokenizer_fields(tok))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts" in name or "mlp.gate" in name:
                p.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("teacher") / "tiny_qwen3_moe"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def byte_teacher_dir(tiny_teacher_dir, tmp_path_factory) -> Path:
    """The tiny teacher's weights with a byte-level tokenizer (ids 0-255 one per byte, EOS 256): unlike the
    word-level one, it sees every byte of the text, line endings included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<|endoftext|>"])
    out = tmp_path_factory.mktemp("teacher") / "byte_qwen3_moe"
    out.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_teacher_dir / f, out / f)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(
        out
    )
    return out


@pytest.fixture(scope="session")
def tiny_teacher(tiny_teacher_dir):
    from m2d_ray.models import load_teacher

    return load_teacher(str(tiny_teacher_dir))


@pytest.fixture(scope="session")
def ds_env(tmp_path_factory):
    """DeepSpeed's compiled ops in a directory of this session, built once for every test that needs them
    (a stale lock in the default directory would hang the run)."""
    ext = str(tmp_path_factory.mktemp("torch_extensions"))
    old = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = ext
    yield ext
    if old is None:
        os.environ.pop("TORCH_EXTENSIONS_DIR")
    else:
        os.environ["TORCH_EXTENSIONS_DIR"] = old


@pytest.fixture(scope="session")
def ray_address():
    """One local Ray for the whole session (num_cpus=4, token auth off); yields its GCS address."""
    import ray

    from m2d_ray.config import RayConfig
    from m2d_ray.runtime.ray_env import ensure_ray

    ensure_ray(RayConfig())
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def forbid(monkeypatch, module, name: str, why: str) -> None:
    """`module.name` raises AssertionError(why) wherever the package calls it: at its definition and in every m2d_ray
    module that imported it by name (a patch of the defining module alone would miss those)."""
    import sys

    original = getattr(module, name)

    def refused(*args, **kwargs):
        raise AssertionError(why)

    for mod in [m for n, m in sys.modules.items() if n == "m2d_ray" or n.startswith("m2d_ray.")]:
        if getattr(mod, name, None) is original:
            monkeypatch.setattr(mod, name, refused)


@pytest.fixture
def compiled_graphs(monkeypatch) -> list:
    """distill.compile's backend swapped for AOT autograd's capture without inductor's code generation (minutes on two
    cores), recording each graph it is handed: the list a test reads to see what was compiled."""
    import torch
    from torch._dynamo.backends.registry import lookup_backend

    from m2d_ray.distill import kernels

    graphs: list = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.reset()
    monkeypatch.setattr(kernels, "COMPILE_BACKEND", recording)
    return graphs
