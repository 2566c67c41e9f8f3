"""Assets shipped with the package: the tiny Qwen3-MoE teacher trained on the synthetic corpus.

``TINY_TEACHER_DIR`` holds a ``Qwen3MoeForCausalLM`` (4 layers, 16 experts, top-2), its word-level tokenizer and
``train_info.json``; it was produced by ``experiments/train_tiny_teacher.py`` and loads offline with
``AutoModelForCausalLM.from_pretrained(TINY_TEACHER_DIR)`` / ``AutoTokenizer.from_pretrained(TINY_TEACHER_DIR)``.
"""

import pathlib

TINY_TEACHER_DIR = pathlib.Path(__file__).parent / "tiny_qwen3_moe"

__all__ = ["TINY_TEACHER_DIR"]
