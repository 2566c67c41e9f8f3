"""`m2d eval`: lm-eval of one saved model (the stage-3 measurement)."""

from __future__ import annotations

import json

from m2d_ray.console import emit, say


def evaluate_one(model: str, tasks: str = "local", num_fewshot: int | None = None, limit: int | None = None,
                 batch_size: int = 16, device: str | None = None) -> dict:
    from m2d_ray.checkpoint import check_files
    from m2d_ray.evaluate.harness import check_tasks, evaluate
    from m2d_ray.models import device_default, load_config, load_model

    suite, text = check_tasks(tasks, num_fewshot)  # bad task names fail before the model loads
    load_config(model)
    check_files(model)
    device = device or device_default()
    lm, tok = load_model(model, device=device)
    return {"model": model, **evaluate(lm, tok, suite, batch_size=batch_size, device=device, limit=limit, text=text)}


def main(args) -> None:
    result = evaluate_one(args.model, args.tasks, args.num_fewshot, args.limit, args.batch_size, args.device)
    for name, r in result["tasks"].items():
        say(f"{name} ({r['shots']}-shot): {r['score']}")
    emit(json.dumps(result))
