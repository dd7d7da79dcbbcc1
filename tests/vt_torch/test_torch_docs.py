"""docs/torch.md's example (the README's "Your PyTorch model") runs and prints what it says,
on whichever backend `get_backend()` picks here."""
import contextlib
import io
import pathlib
import re

import pytest

pytest.importorskip("torch", reason="vt.torch needs PyTorch (pip install \".[torch]\")")

ROOT = pathlib.Path(__file__).parents[2]


@pytest.mark.torch_allocator
def test_torch_example_prints_its_stated_output():
    code = re.search(r"```python\n(.*?)```", (ROOT / "docs/torch.md").read_text(), re.S).group(1)
    expected = re.search(r"^# (\[\[.*\]\])$", code, re.M).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/torch.md", "exec"), {})
    assert out.getvalue().strip() == expected
