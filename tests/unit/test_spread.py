"""A student spread over several devices as a pipeline of its layers (evaluate/split.py, evaluate/spread.py): the split
against every split in order, the plan's bytes of a spread trial, and a spread forward against the unplaced one."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch

from m2d_ray.errors import M2DError
from m2d_ray.evaluate.split import decoder_sizes, in_order, largest, loads, spread_over
from m2d_ray.evaluate.spread import module_bytes, modules_in_order, spread


def _best_in_order(sizes: list[int], n: int) -> int:
    """The least largest load of any split of `sizes` in order into at most `n` devices (every cut tried)."""
    best = sum(sizes)
    for k in range(n):
        for cuts in itertools.combinations(range(1, len(sizes)), k):
            bounds = [0, *cuts, len(sizes)]
            best = min(best, max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_the_split_keeps_the_order_and_is_the_least_largest_load_of_any_split_in_order():
    rng = random.Random(0)
    for _ in range(60):
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 9))]
        n = rng.randint(1, 4)
        where = in_order(sizes, n)
        assert len(where) == len(sizes) and where[0] == 0 and where == sorted(where) and max(where) < n
        assert max(loads(sizes, where)) == largest(sizes, n) == _best_in_order(sizes, n), (sizes, n)
    big_head = [10, 10, 10, 10, 60]  # the head alone outweighs the rest: it gets a device of its own, the last used
    assert in_order(big_head, 2) == [0, 0, 0, 0, 1] and largest(big_head, 4) == 60
    with pytest.raises(M2DError):
        in_order([1], 0)
    assert [spread_over(g) for g in (0.25, 1.0, 2.0, 8.0)] == [1, 1, 2, 8]


def test_a_decoder_s_sizes_are_its_parameters_with_the_embeddings_first_and_the_head_last():
    params, layers, layer, vocab, hidden = 10_000, 4, 1_500, 100, 20
    sizes = decoder_sizes(params, layers, layer, vocab, hidden, tied=False, b=2)
    assert sum(sizes) == 2 * params and sizes[0] == 2 * vocab * hidden and sizes[1:-1] == [2 * layer] * layers
    assert largest(sizes, 2) < 2 * params * 0.6  # two devices hold about half each


@pytest.fixture(scope="module")
def student(tiny_teacher):
    """A dense student of the tiny teacher's shape (untied head), random, in float64."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_teacher.adapter.student_config(tiny_teacher.model.config, 64)
    cfg.tie_word_embeddings = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).double().eval()


def test_a_student_spread_over_three_devices_gives_the_logits_of_the_whole_one(student):
    """All three devices are `cpu` here (the CUDA branch's code, reached on the CPU): the split puts the embeddings on
    the first, the layers in order, the head on the last, and the forward through the hooks is the unplaced one."""
    whole = copy.deepcopy(student)
    names = [n for n, _ in modules_in_order(student)]
    assert names[0] == "embed" and names[-1] == "head" and sum(n.startswith("layers.") for n in names) == 2
    sizes = [module_bytes(m) for _, m in modules_in_order(student)]
    assert sum(sizes) == sum(p.numel() * 8 for p in student.parameters())
    where = in_order(sizes, 3)
    assert set(where) == {0, 1, 2}, where  # every device holds a part: the split is not vacuous
    placed = spread(student, ["cpu", "cpu", "cpu"])
    assert list(placed) == names and set(placed.values()) == {"cpu"}
    ids = torch.randint(1, 100, (2, 12))
    with torch.no_grad():
        want, got = whole(input_ids=ids).logits, student(input_ids=ids).logits
    assert got.dtype == torch.float64 and torch.equal(got, want)
