"""The figures the pages quote (dollars, hours, GiB, step counts), computed from the code when the site is built, so
that none goes stale when the code's output changes.

A page marks each one where it stands, `<!--fig NAME-->VALUE<!--/fig-->` (a whole generated block the same way, the
markers on lines of their own): `on_page_markdown` (mkdocs.yml: `hooks:`) replaces VALUE with `FIGURES[NAME]()` in
the built page; `python docs/hooks/figures.py` writes the same values into the sources, so that the pages read right
on GitHub too; tests/unit/test_docs.py fails while a source holds another value than the code's, and while a page
quotes such a figure outside a marker. Each figure is read from the plan of a named run (`PLANS`: `m2d plan`'s own
JSON line and lines, computed in this process), from a config, or from a table of the code.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--fig ([\w.:-]+)-->(.*?)<!--/fig-->", flags=re.S)
PAGES = ROOT / "docs"
QWEN30B = "m2d_ray/experiments/configs/Qwen--Qwen3-30B-A3B"  # its published config.json, shipped

#: name -> (config, overrides, --cluster, --gpu-memory): the runs whose plans the pages quote
PLANS = {
    # the laptop demo, its CPU thread's rate fixed (a plan measures it: 5e10-7e10 FLOP/s on this project's cores) so
    # that the page's table does not change with the machine that builds the site
    "demo": ("tiny", ["plan.cpu_flops=5e10"], None, None),
    "paper": ("qwen3_30b_a3b", [], "cluster.yaml", None),
    "paper-spot": ("qwen3_30b_a3b", ["ray.spot_trials=true"], "cluster.yaml", None),
    "paper-k8s": (
        "qwen3_30b_a3b",
        ["ray.trial_accelerator=H100"],
        "k8s/raycluster.yaml",
        None,
    ),
    "paper-online": ("qwen3_30b_a3b", ["stage2.targets=online", "distill.zero_stage=2"], None, "80GB"),
    "paper-hidden-2": (
        "qwen3_30b_a3b",
        ["stage2.targets=hidden", "distill.workers=2"],
        None,
        "80GB",
    ),
    "paper-sharded": (
        "qwen3_30b_a3b",
        ["stage2.targets=online", "stage2.shard_teacher=true"],
        "cluster.yaml",
        None,
    ),
    "paper-4b": ("qwen3_30b_a3b", ["distill.steps=2600"], "cluster.yaml", None),
    "paper-4b-sharded": (
        "qwen3_30b_a3b",
        ["distill.steps=2600", "stage2.targets=online", "stage2.shard_teacher=true"],
        "cluster.yaml",
        None,
    ),
    # the extended experiment's ranks pinned to the H100 nodes the page's table is about (unpinned, the plan places them
    # on the 8 x H200 node: cheaper without recompute, slower with one such node)
    "extended": (
        "qwen3_30b_a3b_extended",
        ["stage2.d2d_teacher=Qwen/Qwen3-32B", "distill.accelerator=H100"],
        "cluster.yaml",
        None,
    ),
    "extended-10tb": (
        "qwen3_30b_a3b_extended",
        ["stage2.d2d_teacher=Qwen/Qwen3-32B", "plan.max_storage=10TB", "distill.accelerator=H100"],
        "cluster.yaml",
        None,
    ),
    "extended-hidden": (
        "qwen3_30b_a3b_extended",
        ["stage2.d2d_teacher=Qwen/Qwen3-32B", "stage2.targets=hidden", "distill.accelerator=H100"],
        "cluster.yaml",
        None,
    ),
    "paper-budget": ("qwen3_30b_a3b", ["plan.max_dollars=2000"], "cluster.yaml", None),
    "paper-1rank-ds": ("qwen3_30b_a3b", ["distill.workers=1"], None, None),
    "paper-1rank": (
        "qwen3_30b_a3b",
        ["distill.workers=1", "distill.deepspeed=false"],
        None,
        None,
    ),
}


@functools.cache
def plan(name: str):
    """The RunPlan of run `name`, as `m2d plan CONFIG [overrides] --model QWEN30B [--cluster] [--gpu-memory]` makes it
    (the paper teachers' published configs: offline)."""
    from m2d_ray.config import load_config
    from m2d_ray.pipeline import plan_run
    from m2d_ray.plan.devices import cluster_settings, from_cluster_yaml
    from m2d_ray.plan.run_plan import Devices
    from m2d_ray.sizes import parse_size

    config, overrides, cluster, gpu_memory = PLANS[name]
    cfg = load_config(config, overrides)  # a shipped config by name
    nodes = tuple(from_cluster_yaml(ROOT / cluster)) if cluster else None
    head, idle = cluster_settings(ROOT / cluster) if cluster else (None, 0.0)
    memory = parse_size(gpu_memory) if gpu_memory else None
    host = DEMO_HOST if not (cfg.uses_gpus() or nodes) else None  # a laptop of the demo's size, no one else's load
    model = str(ROOT / QWEN30B) if cfg.model else None
    return plan_run(cfg, Devices(memory, None, nodes, host, head, idle, 0.0), model)


DEMO_HOST = 2 << 30  # the demo tutorial's laptop: 2 GiB of memory free


def demo_plan() -> str:
    """`m2d plan tiny` as the demo prints it before any work (its table)."""
    lines = ["memory plan (this machine):", *("  " + t for t in plan("demo").table().splitlines())]
    return "\n".join(["```text", *(t.rstrip() for t in lines), "```"])


@functools.cache
def line(name: str) -> dict:
    """`m2d plan`'s JSON line of run `name`."""
    from m2d_ray.plan.run_plan import plan_line

    return json.loads(plan_line(plan(name)))


def measured_gpu():
    from m2d_ray.measured import gpu

    return gpu()


def config(path: str, *overrides: str):
    from m2d_ray.config import load_config

    return load_config(path, list(overrides))  # a shipped config by name


# ---- formats: the plan's own ------------------------------------------------------------------------
def usd(v: float) -> str:
    from m2d_ray.plan import bill

    return bill.usd(v)


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def gib(n: float) -> str:
    from m2d_ray.sizes import gib as as_gib

    return as_gib(n)


def tib(n: float) -> str:
    return f"{n / (1 << 40):.1f} TiB"


def whole_gib(n: float) -> str:
    return f"{round(n / (1 << 30), -2):,.0f} GiB"


def gpu_hours(v: float) -> str:
    return f"{v:,.0f} GPU-hours"


def stage(name: str, key: str, field: str):
    return line(name)["stages"][key][field]


def target_line(name: str, teacher: str = "teacher") -> str:
    """The plan's one line on what `auto` chose for `teacher`, and why."""
    return next(t for t in plan(name).targets_lines() if t.startswith(f"{teacher}:"))


def stored(name: str) -> float:
    """Bytes of cached targets the run stores (its storage's `targets` part)."""
    return float(plan(name).storage.get("targets", 0))


def teacher_bytes() -> float:
    from m2d_ray.models import model_config
    from m2d_ray.plan.shapes import models_of

    return models_of(model_config(str(ROOT / QWEN30B))).teacher.weights


def teacher_head_bytes() -> int:
    """The 30B teacher's output head in bf16 (vocabulary x hidden size x 2 B): what a rank reads under `hidden`."""
    from m2d_ray.models import model_config

    c = model_config(str(ROOT / QWEN30B))
    return c.vocab_size * c.hidden_size * 2


def student_params() -> str:
    from m2d_ray.models import model_config
    from m2d_ray.plan.shapes import models_of

    return f"{models_of(model_config(str(ROOT / QWEN30B))).student.params / 1e9:.2f}B"


def tokens_b(name: str) -> str:
    """A config's stage-2 tokens per student, in billions (steps x batch x accumulation x workers x seq_len)."""
    x = config(name).distill
    return f"{x.steps * x.batch_size * x.grad_accum * x.workers * x.seq_len / 1e9:.2f}B"


def tb_month(kind: str) -> str:
    from m2d_ray.plan.targets import TB_MONTH

    return usd(TB_MONTH[kind]).removesuffix(".00")


def bandwidth(kind: str) -> str:
    from m2d_ray.plan.targets import READ_BANDWIDTH

    return f"{READ_BANDWIDTH[kind] / 1e9:g} GB/s"


def price(instance: str, spot: bool = False) -> str:
    from m2d_ray.plan.prices import PRICES

    return usd(PRICES[instance][spot])


def tiny_info(kind: str) -> dict:
    """The embedded teacher's (or its dense twin's) training record, as experiments/train_tiny_teacher.py wrote it."""
    return json.loads((ROOT / "m2d_ray" / "assets" / f"tiny_qwen3_{kind}" / "train_info.json").read_text())


def _calib_reserve() -> int:
    from m2d_ray.calibrate.stream import RESERVE_BYTES

    return RESERVE_BYTES


def refusal(name: str) -> str:
    """The one line `m2d plan` refuses run `name` with."""
    return plan(name).problems()[0]


def s3_month(name: str) -> str:
    """What the run's storage left in S3 costs a month, at plan.tb_month.object (TB of 10^12 bytes)."""
    from m2d_ray.plan.targets import TB_MONTH

    return usd(line(name)["storage_bytes"] / 1e12 * TB_MONTH["object"])


def published(name: str):
    """The Shape of a shipped published config (`m2d_ray/experiments/configs/NAME`): its checkpoint as published."""
    from m2d_ray.models import model_config
    from m2d_ray.plan.shapes import shape_of

    return shape_of(model_config(str(ROOT / "m2d_ray/experiments/configs" / name)))


def published_line(name: str) -> str:
    """The plan's line on a teacher published quantised (pipeline._published), as `m2d plan` prints it."""
    from m2d_ray.pipeline import _published

    return "\n".join(["```text", *("  " + t for t in _published(published(name))), "```"])


GPT_OSS, R1 = "openai--gpt-oss-20b", "deepseek-ai--DeepSeek-R1"

FIGURES = {
    # the paper's run on cluster.yaml: the bill, expected under ASHA and its bound
    "paper.dollars": lambda: usd(line("paper")["dollars"]),
    "paper.hours": lambda: hours(line("paper")["seconds"]),
    "paper.gpu_hours": lambda: gpu_hours(line("paper")["gpu_hours"]),
    "paper.flops": lambda: f"{sum(s['flops'] for s in line('paper')['stages'].values()):.1e}".replace("e+", "e"),
    "paper.bound.dollars": lambda: usd(line("paper")["bound"]["dollars"]),
    "paper.bound.hours": lambda: hours(line("paper")["bound"]["seconds"]),
    "paper.bound.gpu_hours": lambda: gpu_hours(line("paper")["bound"]["gpu_hours"]),
    "paper.stage2.share": lambda: f"{stage('paper', 'stage2', 'dollars') / line('paper')['dollars']:.0%}",
    "paper.storage": lambda: tib(line("paper")["storage_bytes"]),
    "paper.storage.gib": lambda: gib(line("paper")["storage_bytes"]),
    "paper.storage.peak": lambda: tib(line("paper")["storage_peak_bytes"]),
    "paper.targets.stored": lambda: tib(stored("paper")),
    "paper.s3_month": lambda: s3_month("paper"),
    "paper.stage2.rank": lambda: gib(stage("paper", "stage2", "per_gpu_bytes")),
    "paper.targets.line": lambda: target_line("paper"),
    "paper.budget.refusal.block": lambda: f"```text\nm2d: error: {refusal('paper-budget')}\n```",
    "paper.steps": lambda: f"{config('qwen3_30b_a3b').distill.steps:,}",
    "paper.tokens": lambda: tokens_b("qwen3_30b_a3b"),
    "paper.spot.stage1": lambda: usd(stage("paper-spot", "stage1", "dollars")),
    "paper.stage1": lambda: usd(stage("paper", "stage1", "dollars")),
    "k8s.dollars": lambda: usd(line("paper-k8s")["dollars"]),
    "k8s.hours": lambda: hours(line("paper-k8s")["seconds"]),
    "k8s.bound.dollars": lambda: usd(line("paper-k8s")["bound"]["dollars"]),
    "k8s.storage.gib": lambda: gib(line("paper-k8s")["storage_bytes"]),
    "k8s.s3_month": lambda: s3_month("paper-k8s"),
    "online.rank": lambda: gib(stage("paper-online", "stage2", "per_gpu_bytes")),
    "hidden2.rank": lambda: gib(stage("paper-hidden-2", "stage2", "per_gpu_bytes")),
    "one_rank.deepspeed": lambda: gib(stage("paper-1rank-ds", "stage2", "per_gpu_bytes")),
    "one_rank.plain": lambda: gib(stage("paper-1rank", "stage2", "per_gpu_bytes")),
    "teacher.weights": lambda: gib(teacher_bytes()),
    "student.params": student_params,
    "sharded.dollars": lambda: usd(line("paper-sharded")["dollars"]),
    "sharded.hours": lambda: hours(line("paper-sharded")["seconds"]),
    "4b.stored": lambda: whole_gib(stored("paper-4b")),
    "4b.dollars": lambda: usd(line("paper-4b")["dollars"]),
    "4b.hours": lambda: hours(line("paper-4b")["seconds"]),
    "4b.sharded.dollars": lambda: usd(line("paper-4b-sharded")["dollars"]),
    "4b.sharded.hours": lambda: hours(line("paper-4b-sharded")["seconds"]),
    "paper.stored": lambda: whole_gib(stored("paper")),
    "extended.dollars": lambda: usd(line("extended")["dollars"]),
    "extended.hours": lambda: hours(line("extended")["seconds"]),
    "extended.stored": lambda: whole_gib(stored("extended")),
    "extended.steps": lambda: f"{config('qwen3_30b_a3b_extended').distill.steps:,}",
    "extended.tokens": lambda: tokens_b("qwen3_30b_a3b_extended"),
    "extended.10tb.dollars": lambda: usd(line("extended-10tb")["dollars"]),
    "extended.10tb.hours": lambda: hours(line("extended-10tb")["seconds"]),
    "extended.hidden.dollars": lambda: usd(line("extended-hidden")["dollars"]),
    "extended.hidden.hours": lambda: hours(line("extended-hidden")["seconds"]),
    "extended.hidden.stored": lambda: whole_gib(stored("extended-hidden")),
    "extended.targets": lambda: "\n".join(
        ["```text", *(f"  stage-2 targets of {t}" for t in plan("extended").targets_lines()), "```"]
    ),
    "tb_month.local": lambda: tb_month("local"),
    "tb_month.shared": lambda: tb_month("shared"),
    "tb_month.object": lambda: tb_month("object"),
    "read.local": lambda: bandwidth("local"),
    "read.shared": lambda: bandwidth("shared"),
    "read.object": lambda: bandwidth("object"),
    "price.g5": lambda: price("g5.2xlarge"),
    "price.p5": lambda: price("p5.48xlarge"),
    "price.m5": lambda: price("m5.2xlarge"),
    "plan.efficiency": lambda: ", ".join(f"{k} {v:g}" for k, v in config("tiny").plan.efficiency.items()),
    "plan.gpu_start_s": lambda: ", ".join(f"{k} {v:g} s" for k, v in config("tiny").plan.gpu_start_s.items()),
    "measured.device": lambda: measured_gpu().device,
    "plan.cpu_efficiency": lambda: f"{config('tiny').plan.cpu_efficiency:g}",
    "paper.asha": lambda: next(
        t.strip() for t in plan("paper").cost.table().splitlines() if t.strip().startswith("stage 2 under ASHA")
    ).split("): ", 1)[1],
    "calib.reserve": lambda: gib(_calib_reserve()),
    "tiny.moe.steps": lambda: f"{tiny_info('moe')['steps']:,}",
    "tiny.moe.guide": lambda: f"{tiny_info('moe')['domain_warmup']['steps']:,}",
    "tiny.moe.fade": lambda: f"{tiny_info('moe')['domain_warmup']['decay_steps']:,}",
    "tiny.moe.free": lambda: f"{tiny_info('moe')['domain_warmup']['free_steps_after']:,}",
    "tiny.dense.steps": lambda: f"{tiny_info('dense')['steps']:,}",
    "demo.plan": demo_plan,
    "demo.cpu_flops": lambda: f"{config('tiny', *PLANS['demo'][1]).plan.cpu_flops / 1e9:g} GFLOP/s",
    "plan.nvlink": lambda: f"{config('tiny').plan.nvlink_bandwidth / 1e9:g} GB/s",
    "plan.network": lambda: f"{config('tiny').plan.network_bandwidth / 1e9:g} GB/s",
    "teacher.head": lambda: gib(teacher_head_bytes()),
    "wiki4.steps": lambda: f"{config('wiki4').distill.steps:,}",
    # teachers as published (how-to/published-checkpoints.md)
    "gpt_oss.published": lambda: gib(published(GPT_OSS).checkpoint_bytes),
    "gpt_oss.published.gb": lambda: f"{published(GPT_OSS).checkpoint_bytes / 1e9:.1f} GB",
    "gpt_oss.line": lambda: published_line(GPT_OSS),
    "r1.published": lambda: gib(published(R1).checkpoint_bytes),
    "r1.published.gb": lambda: f"{published(R1).checkpoint_bytes / 1e9:.0f} GB",
    "r1.bf16.tb": lambda: f"{published(R1).weights / 1e12:.2f} TB",
    "r1.held": lambda: tib(published(R1).weights),
}


def value(name: str) -> str:
    if name not in FIGURES:
        raise KeyError(f"<!--fig {name}-->: no such figure in docs/hooks/figures.py (FIGURES)")
    return FIGURES[name]()


def rewrite(text: str) -> str:
    """`text` with every marked figure's value the code's, the markers kept."""
    return MARKER.sub(lambda m: f"<!--fig {m[1]}-->{_block(m[2], value(m[1]))}<!--/fig-->", text)


def _block(old: str, new: str) -> str:
    """A block (its markers on lines of their own) stays one."""
    return f"\n{new}\n" if old.startswith("\n") else new


def on_page_markdown(markdown: str, page, config, files) -> str:
    """The built page: every marked figure the code's, the markers gone."""
    return MARKER.sub(lambda m: _block(m[2], value(m[1])), markdown)


def on_post_build(config) -> None:
    """Every figure as the build computed it, in the site (figures.json): what tests/unit/test_docs.py holds the
    sources to, without computing the plans a second time."""
    values = {name: value(name) for name in FIGURES}
    (Path(config["site_dir"]) / "figures.json").write_text(json.dumps(values, indent=1) + "\n")


def stale(values: dict[str, str] | None = None) -> dict[str, list[tuple[str, str, str]]]:
    """Page -> [(figure, what the source says, what the code says)] for every source figure that is not the code's
    (`values`: the figures as a build computed them; else computed here)."""
    get = values.__getitem__ if values is not None else value
    out = {}
    for path in sorted(PAGES.rglob("*.md")):
        rows = [(m[1], m[2].strip(), get(m[1]).strip()) for m in MARKER.finditer(path.read_text())]
        rows = [r for r in rows if r[1] != r[2]]
        if rows:
            out[str(path.relative_to(ROOT))] = rows
    return out


def main() -> int:
    """Write the code's figures into the pages' sources; say which changed."""
    sys.path.insert(0, str(ROOT))
    for path in sorted(PAGES.rglob("*.md")):
        text = path.read_text()
        new = rewrite(text)
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
