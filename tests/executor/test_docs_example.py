"""The user-forward examples in README.md and docs/executor.md run and print what they say."""
import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.parametrize("doc", ["README.md", "docs/executor.md"])
def test_user_forward_example_prints_its_stated_output(doc):
    """The first python block of the document runs and prints the output its last comment states."""
    code = re.search(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S).group(1)
    expected = re.search(r"^# (\[\[.*\]\])$", code, re.M).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, doc, "exec"), {})
    assert out.getvalue().strip() == expected


def test_readme_bundled_model_example_runs():
    """The README's second python block (the bundled model on the ring) runs to completion."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(blocks[1], "README.md", "exec"), {})
    tokens, tps = eval(out.getvalue().strip().rsplit(" ", 1)[0]), float(out.getvalue().split()[-1])
    assert [len(t) for t in tokens] == [8, 8] and tps > 0
