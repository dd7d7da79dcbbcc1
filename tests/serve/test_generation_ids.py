"""A served request's token ids agree with its text, whole and streamed: a stop string cuts
both, wherever it is found (in the text of tokens as they arrive, or in the text flushed when
the request ends), and the ids the deltas carry add up to the completion's. Driven through
GenerationService on an engine stand-in that replays fixed ids, with a byte-level text side."""
import asyncio

from vt.engine.requests import RequestResult
from vt.serve.generation import GenerationService
from vt.serve.metrics import ServeMetrics
from vt.serve.model_source import ServedModel, geometry_for
from vt.serve.protocol import GenerationSpec
from vt.serve.text import TextCodec
from vt.step.contract import GREEDY


def _utf8(ids):
    """A byte-level decode: id = byte, an incomplete or invalid sequence a U+FFFD."""
    return bytes(ids).decode("utf-8", "replace")


class _ByteTokenizer:
    """A byte-level tokenizer: id = byte (what TextCodec needs of transformers' tokenizers)."""

    def decode(self, ids, skip_special_tokens=True):
        return _utf8(ids)

    def get_vocab(self):
        return {bytes([i]).decode("latin-1"): i for i in range(256)}


class _Replay:
    """A request handle that yields `ids` and then ends by length."""

    def __init__(self, ids):
        self.ids = ids

    async def _tokens(self):
        for tok in self.ids:
            await asyncio.sleep(0)
            yield tok

    def stream_async(self):
        return self._tokens()

    def result(self, timeout=None):
        return RequestResult(0, 1, list(self.ids), "length")

    def cancel(self):
        pass


class _Engine:
    """submit() replays fixed ids; its runner is always usable."""

    def __init__(self, ids):
        self.ids = ids
        self.runner = self

    def check_usable(self):
        pass

    def submit(self, prompt_ids, **kw):
        assert kw["max_new_tokens"] == len(self.ids)
        return _Replay(self.ids)


def _serve(ids, stop):
    """(the deltas' (text, ids), the outcome) of one request that generates `ids`."""
    model = ServedModel("bytes", None, geometry_for(1, 64, 4), 256, TextCodec(_ByteTokenizer()), ())
    service = GenerationService(_Engine(ids), model, ServeMetrics("bytes"), serving_conc=1,
                                max_queued=0)
    spec = GenerationSpec(len(ids), GREEDY, tuple(stop), (), True, True, False)
    gen = service.start([1], spec, "prompt")

    async def collect():
        return [(d.text, d.token_ids) async for d in gen.deltas()]
    deltas = asyncio.run(collect())
    return deltas, gen.outcome


def test_a_stop_string_found_in_the_flushed_text_ends_with_stop_and_cuts_the_ids():
    """Five bytes that never make a character: held back until the request ends by length;
    the stop string (three U+FFFD) completes at the third, so the completion is "ab", its ids
    end at that byte, and so do the streamed ones."""
    ids = [ord("a"), ord("b"), 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
    deltas, out = _serve(ids, ["\ufffd" * 3])
    assert "".join(t for t, _ in deltas) == "ab"
    assert out.finish_reason == "stop"
    assert out.token_ids == ids[:5] and out.completion_tokens == 5
    assert sum((i for _, i in deltas), []) == ids[:5]


def test_with_stop_strings_a_partial_characters_ids_come_with_its_text():
    euro = list("\u20ac".encode())
    ids = [ord("a"), *euro, ord("b")]
    deltas, out = _serve(ids, ["zz"])
    assert deltas == [("a", [ord("a")]), ("\u20ac", euro), ("b", [ord("b")])]
    assert (out.finish_reason, out.token_ids) == ("length", ids)


def test_without_stop_strings_every_token_is_a_delta_when_it_arrives():
    euro = list("\u20ac".encode())
    ids = [ord("a"), *euro, 0xFF]
    deltas, out = _serve(ids, [])
    assert deltas == [("a", [ord("a")]), ("", [euro[0]]), ("", [euro[1]]), ("\u20ac", [euro[2]]),
                      ("", [0xFF]), ("\ufffd", [])]
    assert (out.finish_reason, out.token_ids) == ("length", ids)


def test_a_stop_string_in_arriving_text_cuts_at_the_token_that_completes_it():
    ids = [ord(c) for c in "hello world"]
    deltas, out = _serve(ids, ["o w"])
    assert "".join(t for t, _ in deltas) == "hell"
    assert out.finish_reason == "stop" and out.token_ids == ids[:7]
    assert sum((i for _, i in deltas), []) == ids[:7]
