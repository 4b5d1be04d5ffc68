"""The README says what the code does: hook signatures, the example plugin, the two commands."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from kvspec_core.plugins import hookspecs

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("hook_name", hookspecs.HOOK_NAMES)
def test_every_hook_is_documented_with_its_exact_signature(hook_name: str) -> None:
    signature = str(inspect.signature(getattr(hookspecs, hook_name))).replace("'", "")
    assert f"def {hook_name}{signature}\n" in README


@pytest.mark.parametrize("hook_name", hookspecs.HOOK_NAMES)
def test_every_hook_has_a_test(hook_name: str) -> None:
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    assert re.search(rf"def test_hook_{hook_name}\b", tests), f"no test_hook_{hook_name}"


def test_every_hookspec_is_listed_in_hook_names() -> None:
    declared = {name for name in vars(hookspecs) if name.startswith("kvspec_")}
    assert declared == set(hookspecs.HOOK_NAMES)


@pytest.mark.parametrize("path", re.findall(r"<!-- file: (\S+) -->", README))
def test_readme_shows_files_exactly_as_they_are(path: str) -> None:
    block = re.search(rf"<!-- file: {re.escape(path)} -->\n```\w*\n(.*?)```", README, re.S)
    assert block is not None
    assert block.group(1) == (ROOT / path).read_text()


def test_ci_runs_the_readme_test_command() -> None:
    command = "./scripts/dev-setup && .venv/bin/python -m pytest"
    assert command in README
    assert command in (ROOT / ".ci" / "run").read_text()


def _console_examples() -> list[tuple[str, str]]:
    examples = []
    for block in re.findall(r"```console\n(.*?)```", README, re.S):
        command, _, output = block.partition("\n")
        assert command.startswith("$ kvspec "), command
        examples.append((command[len("$ kvspec ") :], output))
    return examples


#: Output that depends on the machine's speed.
_TIMING = re.compile(r"in \d+(\.\d+)? s\b")


@pytest.mark.parametrize(
    ("arguments", "expected"), _console_examples(), ids=[a for a, _ in _console_examples()]
)
def test_cli_examples_show_real_output(
    arguments: str,
    expected: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvspec_core.cli.main import main

    for name in ("KVSPEC_PLUGINS", "KVSPEC_STRICT_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
    # Paths in the examples (a trace file) are the repository's, as in a fresh clone.
    monkeypatch.chdir(ROOT)
    main(arguments.split())
    captured = capsys.readouterr()
    assert _TIMING.sub("in T s", captured.out + captured.err) == _TIMING.sub("in T s", expected)


def test_python_example_runs() -> None:
    block = re.search(r"<!-- python-example -->\n```python\n(.*?)```", README, re.S)
    assert block is not None
    exec(compile(block.group(1), "README.md", "exec"), {})


def test_readme_has_no_unfilled_placeholders() -> None:
    assert "BENCH_" not in README and "<!-- cli-examples -->" not in README


def test_family_table_lists_what_each_plugin_registers() -> None:
    from kvspec_core import load_plugins

    rows = re.findall(r"^\| `(kvspec-[\w-]+)` \| `(\w+)` \| (.+) \|$", README, re.M)
    assert len(rows) == 5
    manager = load_plugins({})
    by_name = {info.name: info for info in manager.plugins}
    for distribution, entry_point, kinds_cell in rows:
        info = by_name[entry_point]
        assert info.distribution == distribution
        assert sorted(re.findall(r"`(\w+)`", kinds_cell)) == sorted(info.spec_kinds)


# ----------------------------------------------------------------- the plugin author guide
def _plugin_guide() -> str:
    """The "## Writing a plugin" section, its subsections included."""
    start = README.index("\n## Writing a plugin\n")
    end = README.index("\n## ", start + 1)
    return README[start:end]


_GUIDE_EXAMPLE = re.compile(r"<!-- example: ([\w-]+) -->\n```python\n(.*?)```", re.S)
_GUIDE_EXAMPLES = _GUIDE_EXAMPLE.findall(_plugin_guide())


def test_the_plugin_guide_has_its_examples() -> None:
    names = [name for name, _ in _GUIDE_EXAMPLES]
    assert len(names) == len(set(names)) >= 4, names


@pytest.mark.parametrize(("name", "code"), _GUIDE_EXAMPLES, ids=[n for n, _ in _GUIDE_EXAMPLES])
def test_plugin_guide_examples_run(name: str, code: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each marked example runs on its own (it makes its own fresh managers)."""
    for variable in ("KVSPEC_PLUGINS", "KVSPEC_STRICT_PLUGINS"):
        monkeypatch.delenv(variable, raising=False)
    exec(compile(code, f"README.md example {name}", "exec"), {"__name__": f"readme_{name}"})


def _guide_imports() -> list[tuple[str, str]]:
    """``(module, name)`` of every ``from kvspec_core... import name`` in the guide's Python
    blocks (the one-line hook signatures are not code) and in its inline code."""
    found = []
    sources = [
        block
        for block in re.findall(r"```python\n(.*?)```", _plugin_guide(), re.S)
        if not block.startswith("def kvspec_")
    ]
    sources += re.findall(r"`(from kvspec_core[\w.]* import [\w, ]+)`", _plugin_guide())
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvspec_core"):
                found += [(node.module, alias.name) for alias in node.names]
    return sorted(set(found))


def test_the_plugin_guide_imports_what_the_core_exports() -> None:
    imports = _guide_imports()
    assert ("kvspec_core", "cdiv") in imports and ("kvspec_core.testing", "manager_with") in imports
    for module_name, name in imports:
        assert not any(part.startswith("_") for part in module_name.split(".")), module_name
        module = importlib.import_module(module_name)
        exported = getattr(module, "__all__", None)
        if exported is not None:
            assert name in exported, f"{name} is not in {module_name}.__all__"
        assert hasattr(module, name), f"{module_name} has no {name}"
