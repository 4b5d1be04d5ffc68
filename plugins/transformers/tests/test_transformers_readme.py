"""The root README's transformers example runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).parents[3] / "README.md").read_text()


def test_the_readme_transformers_example_runs() -> None:
    block = re.search(r"<!-- transformers-example -->\n```python\n(.*?)```", README, re.S)
    assert block is not None
    exec(compile(block.group(1), "README.md", "exec"), {})
