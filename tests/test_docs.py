"""The documentation cannot rot: its Python snippets run (or at least compile), its CLI page is the parser's help."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: A snippet that needs a running loop or a model of the reader's is marked, on the line before it, with this.
NOT_RUN = "<!-- not run:"


def _snippets() -> list[tuple[str, str, bool]]:
    """Every ```python block of the docs: (where, code, whether it runs)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        blocks = list(re.finditer(r"^[ \t]*```python\n(.*?)```", text, re.S | re.M))
        # Every fence that opens Python is one of them: a block written otherwise would go unchecked.
        assert len(blocks) == len(re.findall(r"^[ \t]*(?:```|~~~)\s*(?:python|py)\b", text, re.M)), page
        for match in blocks:
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip().splitlines()[-1:] or [""]
            runs = not before[0].strip().startswith(NOT_RUN)
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1), runs))
    return found


@pytest.mark.quick
@pytest.mark.parametrize(("where", "code", "runs"), _snippets(), ids=[where for where, _, _ in _snippets()])
def test_every_python_snippet_runs_or_compiles(where, code, runs):
    compiled = compile(textwrap.dedent(code), where, "exec")
    if runs:
        exec(compiled, {"__name__": "docs_snippet"})


@pytest.mark.quick
@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="argparse's help layout differs between Python releases")
def test_the_command_line_page_is_the_parsers_help(monkeypatch):
    from lightning_ddpopt import cli

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    monkeypatch.setenv("COLUMNS", "100")  # the width the page was written at
    for command in ([], ["plan"], ["names"], ["report"], ["lighthouse"]):
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown), pytest.raises(SystemExit):
            cli.main([*command, "--help"])
        assert f"```text\n{shown.getvalue()}```" in page, f"docs/reference/cli.md is stale: ddpopt {command}"


@pytest.mark.quick
def test_the_reference_lists_every_registry_hook():
    from lightning_ddpopt.hooks import COMM_HOOKS

    page = (ROOT / "docs" / "reference" / "configs.md").read_text()
    listed = re.findall(r"^- (.*?):", page, re.M)
    names = [name.strip("`") for item in listed for name in item.split(", ")]
    assert sorted(names) == sorted(COMM_HOOKS)


QUICKSTART = ROOT / "examples" / "quickstart.py"


@pytest.mark.quick
def test_the_readmes_quickstart_is_the_example_file():
    # The README and getting-started show examples/quickstart.py from its first import on, unchanged.
    code = QUICKSTART.read_text()
    shown = code[code.index("import torch") :]
    for page in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        assert f"```python\n{shown}```" in page.read_text(), f"{page.name} does not show examples/quickstart.py"


def test_the_quickstart_trains_two_ranks_and_prints_the_findings(tmp_path):
    # As a user runs it: a script whose second rank Lightning starts, from a directory of the user's own.
    import os
    import signal
    import subprocess

    from tests.helpers import user_environment

    # A session of its own: rank 1 is rank 0's child, and nothing may outlive the test.
    process = subprocess.Popen(
        [sys.executable, str(QUICKSTART)],
        cwd=tmp_path,
        env=user_environment(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, _ = process.communicate()
        pytest.fail(f"the quickstart ran past 240 s:\n{stdout[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    output = stdout.replace("\r", "\n")
    assert process.returncode == 0, output[-3000:]
    assert "ddpopt findings (network -> compression -> AMP -> accumulation -> stragglers)" in output
    # On a line of their own, not at the end of the progress bar's (which ends in a carriage return, no newline).
    assert "\nddpopt findings (network" in stdout
    assert "hook int8: relative compression error" in output
    assert "accumulation OK       1.00 gradient syncs per optimizer step over 1.00 micro-batches" in output
    assert "amp          OK       no GradScaler; 64 steps with finite gradients" in output
    report = tmp_path / "lightning_logs" / "version_0" / "ddpopt_report.json"
    assert f"ddpopt: report written to {report}" in output
    assert report.is_file()


def _public_names() -> dict[str, object]:
    import lightning_ddpopt
    import lightning_ddpopt.fabric
    import lightning_ddpopt.hooks

    return {
        f"{module.__name__}.{name}": getattr(module, name)
        for module in (lightning_ddpopt, lightning_ddpopt.fabric, lightning_ddpopt.hooks)
        for name in module.__all__
        if name not in ("__version__", "fabric")  # the version string, and the module documented by its own names
    }


def _directives() -> list[tuple[str, list[str] | None, list[str]]]:
    """Every ``::: path`` directive of the reference pages, with the members it lists (``None``: all of them) and
    the inherited members it renders."""

    def listed(options: str, option: str) -> list[str] | None:
        found = re.search(rf"(?<!\w){option}:[ \t]*(\[[^\]]*\]|(?:\n[ \t]+- .*)+)", options)
        return re.findall(r"[\w.]+", found.group(1)) if found else None

    directives = []
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        for directive in re.finditer(r"^::: (\S+)\n((?:[ \t]+.*\n?)*)", page.read_text(), re.M):
            path, options = directive.groups()
            directives.append((path, listed(options, "members"), listed(options, "inherited_members") or []))
    return directives


def _referenced() -> set[str]:
    """Every object the reference pages render by name: the directives' paths and the members they list."""
    return {
        rendered for path, members, _ in _directives() for rendered in [path, *(f"{path}.{m}" for m in members or [])]
    }


@pytest.mark.quick
def test_the_reference_renders_every_public_name():
    referenced = _referenced()
    for path, obj in _public_names().items():
        # A name re-exported by the package counts where it is rendered under any of its public paths.
        home = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        short = path.rsplit(".", 1)[1]
        aliases = {path, home}
        for module in ("lightning_ddpopt", "lightning_ddpopt.hooks"):  # the same object under another public path
            if getattr(importlib.import_module(module), short, None) is obj:
                aliases.add(f"{module}.{short}")
        assert aliases & referenced, f"{path} is in no page of docs/reference"


def _rendered(path: str) -> object:
    """The object a reference directive renders: a module's attribute, or a class's own (static) member."""
    missing = object()
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            owner = obj
            obj = (
                inspect.getattr_static(owner, name, missing)
                if isinstance(owner, type)
                else getattr(owner, name, missing)
            )
            if obj is missing and isinstance(owner, type):
                # An instance attribute: assigned in the class's own code.
                assert re.search(rf"self\.{name}\b\s*(?::[^=\n]*)?=", inspect.getsource(owner)), (
                    f"{path} does not exist"
                )
                obj = None
            assert obj is not missing, f"{path} does not exist"  # mkdocstrings renders a misspelt member as nothing
        return obj
    raise AssertionError(path)


@pytest.mark.quick
def test_every_member_a_class_inherits_is_rendered_where_listed():
    # mkdocstrings renders an inherited member only where inherited_members names it (else nothing, silently).
    for path, members, inherited in _directives():
        cls = _rendered(path)
        if not isinstance(cls, type):
            continue
        for name in members or []:
            if name not in vars(cls) and hasattr(cls, name):  # an instance attribute is the class's own
                assert name in inherited, f"{path}.{name} is inherited: list it under inherited_members too"


def _whole_classes() -> dict[str, type]:
    """The classes the reference renders with all their public members: a directive without a members list, or a
    class listed as a module's member."""
    whole = {}
    for path, members, _ in _directives():
        for candidate in [path] if members is None else [f"{path}.{m}" for m in members]:
            obj = _rendered(candidate)
            if isinstance(obj, type):
                whole[candidate] = obj
    return whole


@pytest.mark.quick
def test_every_public_argument_is_in_its_docstring():
    # The package's public names, every function and method the reference renders by name, and every public method
    # with a docstring of a class it renders whole.
    rendered = {path: _rendered(path) for path in _referenced()}
    everything = {**_public_names(), **{path: obj for path, obj in rendered.items() if not isinstance(obj, type)}}
    for path, cls in _whole_classes().items():
        for name, member in vars(cls).items():
            function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            if not name.startswith("_") and inspect.isfunction(function) and function.__doc__:
                everything[f"{path}.{name}"] = function
    for path, obj in everything.items():
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if isinstance(obj, property) or not callable(obj):
            continue
        doc = inspect.getdoc(obj) or ""
        sections = re.findall(r"^(?:Args|Attributes):\n((?:(?: {4}.*)?\n?)*)", doc, re.M)
        documented = set(re.findall(r"^ {4}\**(\w+)(?: \(.*?\))?:", "".join(sections), re.M))
        arguments = [name for name in inspect.signature(obj).parameters if not name.startswith("_")]
        arguments = [name for name in arguments if name not in ("self", "cls")]
        assert not set(arguments) - documented, f"{path}: undocumented {sorted(set(arguments) - documented)}"
