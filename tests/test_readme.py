"""The README's API tour runs as written (docs must match the code)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    pytest.importorskip("torch")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md block {i}", "exec"), namespace)


def test_readme_python_blocks_paste_into_the_interactive_shell():
    # The interactive shell ends a compound statement only at a blank line: a block that
    # runs as a file can fail when pasted (a dedented line right after an indented body).
    # Each block is fed line by line as a paste would; no line may be a syntax error.
    import code

    pytest.importorskip("torch")
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    errors: list[str] = []
    console = code.InteractiveConsole({})
    console.write = errors.append  # type: ignore[method-assign]  # tracebacks land here, not on stderr
    for i, block in enumerate(blocks):
        for line in block.splitlines():
            console.push(line)
        console.push("")  # the blank line that ends the paste
        assert not errors, f"README.md block {i} fails when pasted:\n{''.join(errors)}"
