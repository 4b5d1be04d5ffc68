"""The README says what the code does: hook signatures, the example plugin, the two commands."""

from __future__ import annotations

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
        examples.append((command[len("$ kvspec "):], output))
    return examples


#: Output that depends on the machine's speed.
_TIMING = re.compile(r"in \d+(\.\d+)? s\b")


@pytest.mark.parametrize(("arguments", "expected"), _console_examples(),
                         ids=[a for a, _ in _console_examples()])
def test_cli_examples_show_real_output(arguments: str, expected: str,
                                       capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kvspec_core.cli.main import main

    for name in ("KVSPEC_PLUGINS", "KVSPEC_STRICT_PLUGINS"):
        monkeypatch.delenv(name, raising=False)
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
