"""`m2d eval`: lm-eval of one saved model (the stage-3 measurement), sharded over this machine's GPUs when
it needs them (evaluate/placement.py)."""

from __future__ import annotations

import json

from m2d_ray.checkpoint import check_files
from m2d_ray.console import emit, say
from m2d_ray.evaluate.harness import check_tasks
from m2d_ray.evaluate.paper_tasks import summary_line
from m2d_ray.evaluate.runner import evaluate_model, local_placement
from m2d_ray.models import device_default, model_config


def evaluate_one(
    model: str,
    tasks: str = "local",
    num_fewshot: int | None = None,
    limit: int | None = None,
    batch_size: int | str = 16,
    device: str | None = None,
) -> dict:

    suite, text = check_tasks(tasks, num_fewshot)  # bad task names fail before the model loads
    model_config(model)
    check_files(model)
    device = device or device_default()
    place = local_placement(
        model, device, batch_size
    )  # sharded over this machine's GPUs if it needs them; else one line
    return {
        "model": model,
        "placement": place.describe(),
        **evaluate_model(model, suite, place, device, limit=limit, text=text),
    }


def main(args) -> None:

    result = evaluate_one(args.model, args.tasks, args.num_fewshot, args.limit, args.batch_size, args.device)
    for name, r in result["tasks"].items():
        say(summary_line(name, r))
    emit(json.dumps(result))
