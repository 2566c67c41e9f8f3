"""The documentation site (mkdocs.yml, docs/): the reference generated from the code covers every flag, config key,
registry name and run-directory file with a description, and the site builds with warnings as errors."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def ref():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_flag_of_every_command_is_described(ref):
    page = ref.cli_page()
    for name, parser in ref.commands().items():
        assert f"## `m2d {name}`" in page and ref.command_help()[name], name
        for action in ref.options(parser):
            assert (action.help or "").strip(), (
                f"m2d {name} {action.option_strings or action.dest}: give it a help text"
            )
            assert ref._flag(action) in page, (name, action.dest)


def test_every_config_key_is_described(ref):
    page = ref.config_page()
    for section, cls in ref.sections().items():
        hints, docs = typing.get_type_hints(cls), ref.field_docs(cls)
        assert section == "" or cls.__doc__, f"{cls.__name__}: give the section a docstring"
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            key = f"{section}.{f.name}" if section else f.name
            assert docs.get(f.name), f'config key {key}: give its field a doc: setting(default, "...")'
            assert f"| `{key}` |" in page


def test_every_nested_config_key_is_on_the_config_page(ref):
    """Every leaf key at every depth (stage3.analysis.*, stage3.analysis.thresholds.*), found apart from the page's
    own walk."""
    from m2d_ray.config import AnalysisConfig, SweepConfig

    def leaves(cls, prefix: str) -> list[str]:
        hints = typing.get_type_hints(cls)
        return [
            key
            for f in dataclasses.fields(cls)
            for key in (
                leaves(hints[f.name], f"{prefix}{f.name}.")
                if dataclasses.is_dataclass(hints[f.name])
                else [f"{prefix}{f.name}"]
            )
        ]

    page, keys = ref.config_page(), leaves(SweepConfig, "")
    assert [k for k in keys if f"| `{k}` |" not in page] == []
    analysis = {k.split(".")[2] for k in keys if k.startswith("stage3.analysis.")}
    assert analysis == {f.name for f in dataclasses.fields(AnalysisConfig)}
    assert "## `stage3.analysis:`" in page and "## `stage3.analysis.thresholds:`" in page


def test_every_registry_name_and_run_directory_file_is_described(ref):
    from m2d_ray.stages.baselines.base import Baseline
    from m2d_ray.stages.contract import Stage

    inherited = {ref._first(d) for d in (tuple.__doc__, object.__doc__, Stage.__doc__, Baseline.__doc__)}
    for title, (_, names) in ref.registries().items():
        assert names and all(names.values()), (title, [n for n, d in names.items() if not d])
        assert not set(names.values()) & inherited, (title, names)  # its own words, not a base class's
        assert len(set(names.values())) == len(names), (title, names)  # one text per entry
    entries = ref.run_dir_entries()
    assert {"config.yaml", "promotions.json", "stage3/results"} <= {p for p, _ in entries}
    assert all(d for _, d in entries), [p for p, d in entries if not d]
    assert len(ref.bad_input_cases()) >= 90


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with warnings as errors."""
    if shutil.which("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out_dir = tmp_path_factory.mktemp("site")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    return out_dir


def test_the_site_builds_offline_with_warnings_as_errors(site):
    for page in ("index.html", "reference/config/index.html", "reference/cli/index.html", "tutorials/demo/index.html"):
        assert (site / page).stat().st_size > 2000, page
    for path in site.rglob("*.html"):  # offline: every script and stylesheet is the site's own
        remote = re.findall(r'<(?:script|link)[^>]+(?:src|href)="(https?://[^"]+)"', path.read_text())
        assert not remote, (path.relative_to(site), remote)


def test_every_equation_is_typeset_by_the_vendored_katex(site):
    """method.md's equations reach the page as arithmatex spans, the page loads the vendored KaTeX, and every
    equation parses under it (node runs katex.min.js, where node is installed)."""
    page = (site / "explanation" / "method" / "index.html").read_text()
    for asset in ("assets/katex/katex.min.js", "assets/katex/contrib/auto-render.min.js", "assets/katex-init.js"):
        assert asset in page and (site / asset).is_file(), asset
    assert "assets/katex/katex.min.css" in page
    spans = re.findall(r'<(span|div) class="arithmatex">(.*?)</\1>', page, flags=re.S)
    maths = [html.unescape(body) for _, body in spans]
    assert len(maths) >= 20 and all(m.startswith(("\\(", "\\[")) for m in maths), maths[:3]
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the equations' parse under KaTeX is not checked here")
    script = (
        f"const katex = require({json.dumps(str(site / 'assets' / 'katex' / 'katex.min.js'))});"
        "const maths = JSON.parse(require('fs').readFileSync(0, 'utf8')); const bad = [];"
        "for (const m of maths) { try { katex.renderToString(m.slice(2, -2), {throwOnError: true}); }"
        " catch (e) { bad.push(m + ': ' + e.message); } }"
        "console.log(JSON.stringify(bad));"
    )
    out = subprocess.run(["node", "-e", script], input=json.dumps(maths), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == []


def test_the_api_page_has_the_core_types(site):
    page = (site / "reference" / "api" / "index.html").read_text()
    for name in ("LayerStats", "Selection", "GroupingInputs", "MoEAdapter", "Registry", "RunContext"):
        assert re.search(rf'id="m2d_ray\.[\w.]*\.{name}"', page), name


def test_add_a_method_s_examples_run(tmp_path):
    """how-to/add-a-method.md as a reader follows it: each Python block (a scoring, a grouping, a scaling) run in
    one process, then its `m2d convert` line with all three on the embedded teacher, checked in float64."""
    page = (ROOT / "docs" / "how-to" / "add-a-method.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    names = [re.search(r'\.register\("([^"]+)"\)', b).group(1) for b in blocks]
    assert names == ["my-score", "my-grouping", "my-scaling"]
    bash = "\n".join(re.findall(r"```bash\n(.*?)```", page, flags=re.S))
    line = next(c for c in bash.splitlines() if c.startswith("m2d convert"))
    argv = shlex.split(line.split("  #")[0])[1:]
    argv[argv.index("--out") + 1] = str(tmp_path / "student")
    program = "\n".join(
        [*(f"exec({b!r}, {{}})" for b in blocks), "from m2d_ray.cli import main", f"raise SystemExit(main({argv!r}))"]
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    meta = json.loads(out.stdout.strip().splitlines()[-1])  # the command's result line
    assert (meta["scoring"], meta["grouping"], meta["scaling"]) == tuple(names)
    assert meta["max_rel_error"] < 1e-12 and all(len(g) == 2 for g in meta["groups"].values())


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "docs" / "hooks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pages() -> list[Path]:
    return sorted(p for p in (ROOT / "docs").rglob("*.md") if "assets" not in p.parts)


def test_every_quoted_figure_is_the_code_s(site, figures):
    """Each marked figure of every page holds what the code computes now (the build's figures.json); a change of the
    code's output fails here until `python docs/hooks/figures.py` writes the new values into the pages."""
    values = json.loads((site / "figures.json").read_text())
    used = {m[1] for p in pages() for m in figures.MARKER.finditer(p.read_text())}
    assert used <= set(values), used - set(values)
    assert figures.stale(values) == {}, "figures out of date: run `python docs/hooks/figures.py`"
    built = (site / "how-to" / "production-budget" / "index.html").read_text()
    assert values["paper.dollars"] in built and "<!--fig" not in built


#: a figure with a unit a plan computes (dollars; hours; GiB, TiB; GB, TB with a space; step counts)
FIGURE = re.compile(
    r"\$\d[\d,.]*|\b\d[\d,.]*\s?(?:GiB|TiB)\b|\b\d[\d,.]*\s(?:GB|TB)\b|\b\d[\d,.]*\s?(?:h|hours?)\b|\b\d[\d,]*\s+steps\b"
)
#: the lines where such a figure is not the code's output, each with why
NOT_OUTPUT = {
    "80 GB GPU": "a GPU's size (hardware)",
    "A10G 24 GB": "hardware",
    "H100 80 GB": "hardware",
    "on 80 GB GPUs": "hardware",
    "about 2 GB of memory": "what the demo asks of a laptop",
    "with 2 GiB free": "the demo plan's laptop (figures.DEMO_HOST)",
    "stages cost $0": "the rule: a CPU stage runs on the head or on this machine",
    "compile job": "flash-attn's build memory, its setup.py's figure",
    "a job at": "flash-attn's build memory (scripts/flash-attn-jobs.sh)",
}


def test_no_page_quotes_a_plan_s_figure_outside_a_marker(figures):
    found = []
    for path in pages():
        text = figures.MARKER.sub("", path.read_text())
        if "$$" in text:  # a page with equations: its inline math is not money
            text = re.sub(r"\$\$.*?\$\$|\$(?=\S)[^$\n]*?\S\$", "", text, flags=re.S)
        for n, line in enumerate(text.splitlines(), 1):
            if FIGURE.search(line) and not any(ok in line for ok in NOT_OUTPUT):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert found == [], "mark these <!--fig NAME-->...<!--/fig--> (docs/hooks/figures.py):\n" + "\n".join(found)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_the_readme_s_links_work_on_github():
    """Every relative link and image of README.md (and ARCHITECTURE.md) is a file of the repository: GitHub shows the
    sources, where the generated reference pages do not exist."""
    for doc in ("README.md", "ARCHITECTURE.md"):
        targets = [t.split("#")[0] for t in LINK.findall((ROOT / doc).read_text()) if "://" not in t]
        missing = [t for t in targets if t and not (ROOT / t).exists()]
        assert missing == [], (doc, missing)


def test_every_page_s_images_are_files_of_the_repository():
    """A page shows a screenshot by its path in the repository (the site maps it to images/): GitHub shows it too."""
    for path in pages():
        for target in LINK.findall(path.read_text()):
            if target.endswith(".png") and "://" not in target:
                assert (path.parent / target).resolve().is_file(), (path.relative_to(ROOT), target)


def test_the_demo_s_students_quoted_elsewhere_are_those_the_demo_distils():
    """A page that names a student of runs/demo names one the demo's stage 2 distils (its transcript in demo.md)."""
    demo = (ROOT / "docs" / "tutorials" / "demo.md").read_text()
    distilled = set(re.findall(r"\[stage 2 \d+/\d+\] (\S+?):", demo))
    assert distilled
    for path in pages():
        for key in re.findall(r"runs/demo/stage2/students/([\w.-]+)", path.read_text()):
            assert key in distilled, (path.relative_to(ROOT), key, distilled)
