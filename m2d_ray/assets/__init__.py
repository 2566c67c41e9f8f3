"""Assets shipped with the package: the tiny Qwen3-MoE teacher trained on the synthetic corpus, and its dense twin.

``TINY_TEACHER_DIR`` holds a ``Qwen3MoeForCausalLM`` (4 layers, 16 experts, top-2), its word-level tokenizer and
``train_info.json``; it was produced by ``experiments/train_tiny_teacher.py`` and loads offline with
``AutoModelForCausalLM.from_pretrained(TINY_TEACHER_DIR)`` / ``AutoTokenizer.from_pretrained(TINY_TEACHER_DIR)``.
``TINY_DENSE_TEACHER_DIR`` holds the dense twin for the dense-to-dense pruning baseline: a ``Qwen3ForCausalLM``
with the same attention, embeddings and tokenizer and one FFN of width 16 x 32 = 512 per layer, trained on the same
tokens with the same schedule (``experiments/train_tiny_teacher.py --dense``).
"""

import pathlib

TINY_TEACHER_DIR = pathlib.Path(__file__).parent / "tiny_qwen3_moe"
TINY_DENSE_TEACHER_DIR = pathlib.Path(__file__).parent / "tiny_qwen3_dense"


def default_teacher() -> str:
    """The embedded MoE teacher: a run's model when its config names none."""
    return str(TINY_TEACHER_DIR)


def default_dense_teacher() -> str:
    """The embedded MoE teacher's dense twin (same tokens and schedule): its dense-to-dense baseline's teacher."""
    return str(TINY_DENSE_TEACHER_DIR)


def absolute(name: str) -> str:
    """A local model path made absolute (Ray runs trials and tasks in their own directories); a hub name as is."""
    path = pathlib.Path(name).expanduser()
    return str(path.resolve()) if path.exists() else name


__all__ = ["TINY_TEACHER_DIR", "TINY_DENSE_TEACHER_DIR", "absolute", "default_dense_teacher", "default_teacher"]
