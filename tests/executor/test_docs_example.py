"""The user-forward example in docs/executor.md runs and prints what it says."""
import contextlib
import io
import pathlib
import re


def test_docs_user_forward_example_prints_its_stated_output():
    text = (pathlib.Path(__file__).parents[2] / "docs" / "executor.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    expected = re.search(r"^# (\[\[.*\]\])$", code, re.M).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/executor.md", "exec"), {})
    assert out.getvalue().strip() == expected
