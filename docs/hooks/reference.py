"""The reference pages, generated from the code each time the site is built, so they cannot drift from it:

    reference/cli.md            every `m2d` command and flag, from the argparse parser (m2d_ray/cli.py)
    reference/config.md         every config key with its type, default and meaning, from the config dataclasses
                                (m2d_ray/config/: each field's `setting(default, doc)`)
    reference/registries.md     every registry's names with their docstrings (scorings, groupings, scalings, baselines,
                                losses, targets modes, the stages of a run)
    reference/run-directory.md  the run directory's files (m2d_ray/run_dir.py, the one owner of their names) and the
                                run's storage (m2d_ray/runtime/run_storage.py)
    reference/families.md       every MoE family: converted (its student, its router's scores, exact or float32) or
                                refused with its reason (m2d_ray/arch/)
    reference/bad-input.md      the bad-input cases the CLI refuses and their exit codes (tests/cli/test_bad_inputs.py)

MkDocs calls `on_files` and `on_page_markdown` (mkdocs.yml: `hooks:`; the latter points a page's screenshot, linked by
its path in the repository so that GitHub shows it, at the site's images/); tests/unit/test_docs.py calls the page
functions and holds them to the parser and the dataclasses (a flag or a key without a description fails).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# ---- the command line ------------------------------------------------------------------------------
def commands() -> dict[str, argparse.ArgumentParser]:
    """`m2d`'s subcommands by name, in the parser's order."""
    from m2d_ray.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices.items())


def command_help() -> dict[str, str]:
    from m2d_ray.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.help or "" for a in sub._choices_actions}


def options(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """A command's own arguments (not -h, not the common --verbose)."""
    return [a for a in p._actions if not isinstance(a, argparse._HelpAction)]


def _flag(a: argparse.Action) -> str:
    if not a.option_strings:
        return f"`{a.metavar or a.dest.upper()}`" + (" …" if a.nargs in ("*", "+") else "")
    names = " / ".join(f"`{s}`" for s in a.option_strings)
    if isinstance(a, argparse.BooleanOptionalAction) or a.nargs == 0:
        return names
    return f"{names} `{a.metavar or a.dest.upper()}`"


def _default(a: argparse.Action) -> str:
    if a.default in (None, argparse.SUPPRESS, False) or a.required or not a.option_strings:
        return "required" if a.required else ""
    return f"`{a.default}`"


def cli_page() -> str:
    helps = command_help()
    out = [
        "# Commands",
        "",
        "Every `m2d` command and its flags, read from the parser itself (`m2d_ray/cli.py`). Exit codes: 0 done,",
        "2 bad input (one line on stderr, nothing written; a disk too small for the plan's storage peak too), 1 the",
        "work failed (one line and the log's path), 3 a filesystem the work writes to is full, over its quota or",
        "read-only (one line: where, what the plan expected there, how to resume), 130 interrupted. `m2d COMMAND",
        "--help` prints the same.",
        "",
    ]
    for name, p in commands().items():
        out += [f"## `m2d {name}`", "", helps.get(name, ""), "", "| argument | default | what |", "|---|---|---|"]
        out += [f"| {_flag(a)} | {_default(a)} | {_cell(a.help or '')} |" for a in options(p)]
        out.append("")
    return "\n".join(out)


# ---- the config -------------------------------------------------------------------------------------
def sections() -> dict[str, type]:
    """Config section (`` for the top level, dotted for a nested one: `stage3.analysis`) -> its dataclass, every
    level of nesting, in the order the fields are declared."""
    from m2d_ray.config import SweepConfig

    return dict(_sections("", SweepConfig))


def _sections(prefix: str, cls: type) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(cls)
    out = [(prefix, cls)]
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _sections(f"{prefix}.{f.name}" if prefix else f.name, hints[f.name])
    return out


def field_docs(cls: type) -> dict[str, str]:
    """Each field's description: its one-line doc, written once beside its default (config.setting)."""
    from m2d_ray.config import docs

    return docs(cls)


def _type(hint) -> str:
    text = str(hint).replace("typing.", "")
    return getattr(hint, "__name__", None) if isinstance(hint, type) else text


def config_page() -> str:
    out = [
        "# Configuration",
        "",
        "Every key of a run's YAML (`m2d configs` lists the shipped ones), at every depth, with its type, default",
        "and meaning, read from the config dataclasses (each section names the one it comes from). A YAML file is a",
        "partial nested mapping of them; `include: base.yaml` merges a base first; any key is set on the command",
        "line as `section.key=value` (`stage3.analysis.per_subject=2`; lists as `'grid.scoring=[sf,do-acp]'`,",
        "quoted for zsh). An unknown key, a wrong type or an unknown method name fails with one line that says what",
        "to write instead.",
        "",
    ]
    for section, cls in sections().items():
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        title = f"`{section}:`" if section else "Top level"
        out += [
            f"## {title}",
            "",
            (inspect.cleandoc(cls.__doc__ or "") + " " if section else "") + f"(`{cls.__module__}.{cls.__name__}`)",
            "",
            "| key | type | default | what |",
            "|---|---|---|---|",
        ]
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            key = f"{section}.{f.name}" if section else f.name
            out.append(f"| `{key}` | `{_type(hints[f.name])}` | `{default!r}` | {_cell(docs.get(f.name, ''))} |")
        out.append("")
    return "\n".join(out)


# ---- the registries ---------------------------------------------------------------------------------
def registries() -> dict[str, tuple[str, dict[str, str]]]:
    """Registry title -> (where its names are used, {name: what it is}): each entry's own one-line doc (as its
    registry declares it, a stage's class or module docstring, a baseline's `summary`; a loss from the losses module's
    lines), never one inherited."""
    from m2d_ray.catalog.methods import GROUPINGS, SCALINGS, SCORINGS
    from m2d_ray.catalog.targets import MODES
    from m2d_ray.pipeline import STAGES
    from m2d_ray.stages.baselines import BASELINES

    def docs(reg) -> dict[str, str]:  # the one-line docs the registry declares, its modules not imported
        return {n: reg.doc(n) for n in reg}

    return {
        "Scorings": ("`grid.scoring`, `m2d convert --scoring`", docs(SCORINGS)),
        "Groupings": ("`grid.grouping`, `m2d convert --grouping`", docs(GROUPINGS)),
        "Scalings": ("`grid.scaling`, `m2d convert --scaling`", docs(SCALINGS)),
        "Baselines": ("`stage2.baselines`", {n: _first(BASELINES[n].summary) for n in BASELINES}),
        "Losses": ("`distill.loss`, `m2d distill --loss`", losses()),
        "Targets modes": (
            "`stage2.targets`, `m2d distill --targets`",
            {"online": "the teacher runs beside every student", **{m: _mode(m) for m in MODES}},
        ),
        "Stages of a run": ("`m2d run`, in this order", {s.name: _stage_doc(s) for s in STAGES}),
    }


def losses() -> dict[str, str]:
    """Each loss: its divergence as the losses module's docstring defines it (`fkl: ...`), and the hidden-state MSE's
    docstring where the entry adds it (the registry's entries are (divergence, with MSE) pairs)."""
    from m2d_ray.distill import losses as module

    lines = dict(re.findall(r"^\s+(\w+): (.+)$", inspect.getdoc(module), flags=re.M))
    mse = _first(module.hidden_mse.__doc__).split(", over")[0]  # its first clause: what it measures
    out = {}
    for name in module.LOSSES:
        divergence, with_mse = module.LOSSES[name]
        text = " ".join(lines[divergence].split())
        out[name] = f"{text}; plus the {mse[0].lower()}{mse[1:]} (`distill.mse_weight`)" if with_mse else text
    return out


def _stage_doc(stage) -> str:
    """A stage's class docstring when it has its own, else its module's first paragraph."""
    return _first(type(stage).__dict__.get("__doc__") or inspect.getdoc(inspect.getmodule(type(stage))))


def _mode(mode: str) -> str:
    return {
        "hidden": "the teacher's final hidden states, cached once: exact",
        "topk": "the K largest log-probabilities and the tail",
        "sampled": "N ids drawn from the teacher's distribution: an unbiased estimate",
    }.get(mode, mode)


def registries_page() -> str:
    out = [
        "# Registries",
        "",
        "The names each method family accepts, read from its registry; a misspelt name is refused with the",
        'closest one ("did you mean"). A new method is a function registered beside the others (see the how-to).',
        "",
    ]
    for title, (where, names) in registries().items():
        out += [f"## {title}", "", f"Used by {where}.", "", "| name | what |", "|---|---|"]
        out += [f"| `{n}` | {_cell(d)} |" for n, d in names.items()]
        out.append("")
    return "\n".join(out)


# ---- the run directory ------------------------------------------------------------------------------
def run_dir_entries() -> list[tuple[str, str]]:
    """(path relative to the run directory, what it holds) of every name RunDir gives."""
    from m2d_ray.run_dir import RunDir

    rd = RunDir("/RUN")
    out = []
    for name, member in inspect.getmembers(RunDir):
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            value, doc = getattr(rd, name), inspect.getdoc(member)
        elif name.endswith("ledger") and callable(member):
            value, doc = getattr(rd, name)().dir, inspect.getdoc(member)
        else:
            continue
        out.append((str(value).removeprefix("/RUN/").removeprefix("/RUN"), _first(doc or "")))
    return sorted(out)


def run_dir_page() -> str:
    from m2d_ray import run_dir
    from m2d_ray.runtime import run_storage

    out = [
        "# The run directory and the run's storage",
        "",
        "## The run directory (`--out`)",
        "",
        "Only the driver reads and writes it. Every name below is given by `m2d_ray/run_dir.py`.",
        "",
        "```",
        inspect.getdoc(run_dir).split("\n\n")[1],
        "```",
        "",
        "| path | what |",
        "|---|---|",
    ]
    out += [f"| `{p}` | {_cell(d)} |" for p, d in run_dir_entries()]
    *prose, layout = inspect.getdoc(run_storage).split("\n\n")
    out += [
        "",
        "## The run's storage (`--storage`, `storage:`)",
        "",
        *prose,
        "",
        "```",
        inspect.cleandoc(layout),
        "```",
        "",
    ]
    return "\n".join(out)


# ---- bad input --------------------------------------------------------------------------------------
def bad_input_cases() -> dict[str, str]:
    """Case name -> the words its one line must hold, from tests/cli/test_bad_inputs.py's CASES."""
    tree = ast.parse((ROOT / "tests" / "cli" / "test_bad_inputs.py").read_text())
    cases = next(n.value for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CASES")
    return {ast.literal_eval(k): _expected(v) for k, v in zip(cases.keys, cases.values)}


def _expected(v: ast.expr) -> str:
    if isinstance(v, ast.Tuple) and len(v.elts) > 1:
        try:
            return str(ast.literal_eval(v.elts[1]))
        except ValueError:
            return ast.unparse(v.elts[1])
    return ""


def bad_input_page() -> str:
    out = [
        "# Bad input",
        "",
        "Every command checks all of its inputs before its first expensive step and refuses bad input with",
        "**exit code 2** and one line on stderr that names the problem and what to do; nothing is written (the file",
        "system is as it was). Work that fails after it started exits with **1** (one line and the log's path);",
        "**130** is an interrupt; **0** is done. The cases below are the matrix `tests/cli/test_bad_inputs.py` runs",
        "through the CLI, each checked for its one line and an unchanged file system.",
        "",
        "| case | the line says |",
        "|---|---|",
    ]
    out += [f"| {_cell(name)} | {_cell(words)} |" for name, words in bad_input_cases().items()]
    return "\n".join(out) + "\n"


# ---- the hook ---------------------------------------------------------------------------------------
def families_page() -> str:
    lines = [
        "# MoE families",
        "",
        "Generated from `m2d_ray/arch/`. A family converted *read from its structure* has its experts' layout and",
        "activation, its routing, its shared expert and its dense MLPs read from transformers' modules; a config-only",
        "family (sarvam_mla, sarvam_moe, param2moe) is converted by the class transformers builds for it. *Exact*: the",
        "student's FFN equals the merged and concatenated experts to this round-off, checked on every export.",
        "A vision-language checkpoint of a family here (Qwen3.5-MoE, Qwen3-VL-MoE, Kimi-K2.5 ...) has its language",
        "model converted and its vision tower copied unchanged: the student is the teacher's own class.",
        "",
        "| model type | adapter | student | exact to / why refused |",
        "|---|---|---|---|",
    ]
    from m2d_ray.arch import family_rows

    lines += [f"| `{n}` | {h} | {k} | {_cell(e)} |" for n, h, k, e in family_rows()]
    return "\n".join(lines) + "\n"


PAGES = {
    "reference/families.md": families_page,
    "reference/cli.md": cli_page,
    "reference/config.md": config_page,
    "reference/registries.md": registries_page,
    "reference/run-directory.md": run_dir_page,
    "reference/bad-input.md": bad_input_page,
}


def on_files(files, config):
    """The generated pages, and benchmarks/screenshots/ as images/ (the pictures the pages show live there once)."""
    from mkdocs.structure.files import File

    for uri, page in PAGES.items():
        files.append(File.generated(config, uri, content=page()))
    for png in sorted((ROOT / "benchmarks" / "screenshots").glob("*.png")):
        files.append(File.generated(config, f"images/{png.name}", abs_src_path=str(png)))
    return files


SCREENSHOT = re.compile(r"\]\((?:\.\./)+benchmarks/screenshots/([\w.-]+\.png)\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A page shows a screenshot by its path in the repository (so it shows on GitHub too); the site by images/."""
    up = "../" * page.file.src_uri.count("/")
    return SCREENSHOT.sub(lambda m: f"]({up}images/{m[1]})", markdown)


def _first(doc: str) -> str:
    """A docstring's first paragraph, on one line."""
    return " ".join((doc or "").split("\n\n")[0].split())


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", str(text)).replace("|", "\\|").strip()
