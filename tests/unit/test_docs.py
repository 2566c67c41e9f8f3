"""The documentation site (mkdocs.yml, docs/): the reference generated from the code covers every flag, config key,
registry name and run-directory file with a description, and the site builds with warnings as errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
import sys
import typing

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
            assert docs.get(f.name), f"config key {key}: describe it in a comment beside or above the field"
            assert f"| `{key}` |" in page


def test_every_registry_name_and_run_directory_file_is_described(ref):
    for title, (_, names) in ref.registries().items():
        assert names and all(names.values()), (title, [n for n, d in names.items() if not d])
    entries = ref.run_dir_entries()
    assert {"config.yaml", "promotions.json", "stage3/results"} <= {p for p, _ in entries}
    assert all(d for _, d in entries), [p for p, d in entries if not d]
    assert len(ref.bad_input_cases()) >= 90


def test_the_site_builds_offline_with_warnings_as_errors(tmp_path):
    if shutil.which("mkdocs") is None:
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    for page in ("index.html", "reference/config/index.html", "reference/cli/index.html", "tutorials/demo/index.html"):
        assert (tmp_path / "site" / page).stat().st_size > 2000, page
