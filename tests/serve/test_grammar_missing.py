"""Without xgrammar on the server, a constrained request is refused naming its field (the
structured-output tests themselves: test_structured_output.py, which needs xgrammar)."""
import sys

import pytest

from vt.serve.grammar import GrammarEngine
from vt.serve.protocol import Constraint, RequestError


def test_a_constraint_without_xgrammar_is_refused_naming_its_field(monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)     # import xgrammar: ImportError
    engine = GrammarEngine(tokenizer=None, vocab=32, stop_ids=(1,))
    with pytest.raises(RequestError) as e:
        engine.compile(Constraint("regex", "a+", "guided_regex"))
    assert e.value.param == "guided_regex" and e.value.status == 400
    assert "vt-graphs[grammar]" in e.value.message and "\n" not in e.value.message
