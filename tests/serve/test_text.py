"""The text path on its own: incremental detokenization never sends a character that decoding
the whole output would not have at that place (a split UTF-8 sequence waits for its last
byte), and ends with exactly the whole decode; stop strings are found across pieces and cut;
EOS ids come from generation_config.json, else config.json."""
import json

import numpy as np
import pytest

from vt.serve.detok import IncrementalDetokenizer, StopStrings, TextStream
from vt.serve.text import TextCodec, eos_token_ids


@pytest.fixture(scope="module")
def codec(checkpoint):
    return TextCodec.from_dir(checkpoint)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_is_always_a_prefix_of_the_whole_decode(codec, seed):
    """Random ids (bytes of multi-byte characters among them), fed one or a few at a time."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, len(codec.tokenizer), 60).tolist()
    whole = codec.decode(ids)
    detok, sent, i = IncrementalDetokenizer(codec.decode), "", 0
    while i < len(ids):
        k = int(rng.integers(1, 4))
        sent += detok.push(ids[i:i + k])
        i += k
        assert whole.startswith(sent)
    assert sent + detok.flush() == whole


@pytest.mark.parametrize("seed", range(3))
def test_ids_without_text_keep_the_window_short_and_the_text_whole(codec, seed):
    """Ids past the tokenizer's vocabulary (a padded embedding's rows) and special tokens
    decode to nothing: mixed among real ids, the text is still the whole decode's, and the
    decode window stays short instead of growing with every such id (it grows only while a
    character waits for its bytes, until the next id with text: here, 300 ids, under 40)."""
    rng = np.random.default_rng(seed)
    vocab = len(codec.tokenizer)
    ids = [int(i) if rng.random() < 0.2 else int(vocab + i)
           for i in rng.integers(0, vocab, 300)]
    windows = []

    def decode(window):
        windows.append(len(window))
        return codec.decode(window)

    detok, sent = IncrementalDetokenizer(decode), ""
    for i in ids:
        sent += detok.push([i])
        assert codec.decode(ids).startswith(sent)
    assert sent + detok.flush() == codec.decode(ids)
    assert max(windows) < 40, max(windows)


def test_a_character_split_over_tokens_waits_for_its_last_byte(codec):
    """An emoji whose four UTF-8 bytes are four tokens: nothing until the fourth."""
    tok = codec.tokenizer
    ids = tok("\U0001f680", add_special_tokens=False).input_ids
    pieces = [tok.convert_ids_to_tokens(i) for i in ids]
    assert len(ids) > 1, pieces         # the corpus' BPE leaves it split
    detok = IncrementalDetokenizer(codec.decode)
    out = [detok.push([i]) for i in ids]
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "\U0001f680"


@pytest.mark.parametrize("pieces,stops,expect", [
    (["Hel", "lo wo", "rld"], ("o w",), "Hell"),           # across pieces
    (["abc", "d"], ("cd", "b"), "a"),                      # the earliest match wins
    (["ab", "c"], ("abx",), "abc"),                        # a held tail that did not match
    (["x", "STO", "P", "more"], ("STOP",), "x"),
])
def test_stop_strings_cut_before_the_first_match(pieces, stops, expect):
    s = StopStrings(stops)
    out = "".join(s.push(p) for p in pieces) + s.flush()
    assert out == expect and s.stopped == (expect != "".join(pieces))


def test_text_stream_counts_tokens_up_to_the_stop(codec):
    ids = codec.encode("The quick brown fox jumps over the lazy dog.")[1:]
    stream = TextStream(codec.decode, ("brown",))
    out = stream.push(ids) + stream.finish()
    assert out == "The quick " and stream.stopped
    assert "brown" in codec.decode(ids[:stream.tokens])
    assert "brown" not in codec.decode(ids[:stream.tokens - 1])


def test_eos_ids_come_from_generation_config_then_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert eos_token_ids(tmp_path) == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3, 7]}))
    assert eos_token_ids(tmp_path) == (3, 7)


def _utf8(ids):
    """A byte-level decode: id = byte, an incomplete or invalid sequence a U+FFFD."""
    return bytes(ids).decode("utf-8", "replace")


def test_a_stop_string_in_the_text_flushed_at_the_end_stops_at_the_token_completing_it():
    """Bytes that never complete a character are held back until the request ends; a stop
    string in their text stops the stream at the held token that completes it (the tokens
    after it are not counted), and the text is cut before it."""
    ids = [ord("a"), ord("b"), 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
    stream = TextStream(_utf8, ("\ufffd" * 3,))
    sent = stream.push(ids)
    assert (sent, stream.stopped, stream.settled) == ("ab", False, 2)
    assert sent + stream.finish() == "ab"
    assert stream.stopped and stream.tokens == 5 == stream.settled


def test_held_bytes_without_a_stop_string_in_their_text_are_flushed_whole():
    ids = [ord("a"), 0xE2, 0x82]            # the first two bytes of U+20AC, never the third
    stream = TextStream(_utf8, ("zz",))
    assert stream.push(ids) + stream.finish() == _utf8(ids) == "a\ufffd"
    assert not stream.stopped and stream.tokens == 3 == stream.settled


@pytest.mark.parametrize("stops, min_tokens, text, want, tokens", [
    (("b",), 3, "abab", "aba", 4),           # the "b" of token 2 is ignored, token 4's stops it
    (("b",), 0, "abab", "a", 2),
    (("xy",), 2, "axy", "a", 3),             # begins in the first min_tokens, ends after: counts
    (("abc", "b"), 2, "abx", "abx", None),   # "b" ends in token 2, even held back with "a"
    (("abc", "b"), 2, "abc", "", 3),
], ids=["ignored-then-found", "without", "spanning", "short-stop-held", "long-stop-held"])
def test_a_stop_string_counts_only_if_it_ends_after_the_first_min_tokens(stops, min_tokens, text,
                                                                         want, tokens):
    """vLLM's rule: the text of the first min_tokens tokens is never searched on its own; a
    stop string that ends after it counts, wherever it begins."""
    stream = TextStream(_utf8, stops, min_tokens=min_tokens)
    got = stream.push([ord(c) for c in text])
    got += stream.finish()
    assert got == want and stream.stopped == (tokens is not None)
    assert stream.tokens == (len(text) if tokens is None else tokens)


def test_held_bytes_in_the_first_min_tokens_are_no_stop_string_at_the_end():
    """The held-back bytes' text at the end: a stop string that ends in the text of a held
    token among the first min_tokens does not count; one that ends in a later one does."""
    ids = [ord("a"), ord("b"), 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]
    stream = TextStream(_utf8, ("\ufffd" * 3,), min_tokens=5)   # the first three end at token 5
    assert stream.push(ids) + stream.finish() == "ab\ufffd"     # the next three at token 6
    assert stream.stopped and stream.tokens == 6
    stream = TextStream(_utf8, ("\ufffd" * 3,), min_tokens=7)
    assert stream.push(ids) + stream.finish() == "ab" + "\ufffd" * 5
    assert not stream.stopped and stream.tokens == 7
