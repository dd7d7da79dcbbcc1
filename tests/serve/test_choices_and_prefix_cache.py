"""n > 1 and prefix caching through `vt serve` on the sim (a tiny Llama: its KV is
position-addressed, so caching is on by default), driven by the official openai client:
n=4 returns four choices, each equal to the same request run alone with that choice's seed
(the request's seed + its index); usage counts the prompt once; /metrics reports the cache;
--no-prefix-cache switches it off."""
import openai
import pytest

from ._live import metrics
from .conftest import BLOCK, SERVER_FLAGS

PROMPT = "The quick brown fox jumps over the lazy dog, and then"


@pytest.fixture(scope="module")
def client(served_url):
    with openai.OpenAI(base_url=served_url + "/v1", api_key="none", timeout=120, max_retries=0) as c:
        yield c


def test_n4_completion_choices_equal_each_seed_alone(client):
    many = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0,
                                     seed=1234, n=4)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                       temperature=1.0, seed=1234 + i)
             for i in range(4)]
    assert [c.text for c in many.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in many.choices}) > 1       # the seeds differ: so do the choices
    assert many.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_n4_chat_streamed_choices_equal_each_seed_alone(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    texts = {}
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                                temperature=1.0, seed=77, n=4, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    alone = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                            temperature=1.0, seed=77 + i).choices[0].message.content
             for i in range(4)]
    assert [texts[i] for i in range(4)] == alone


def test_n_out_of_range_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match=r"n must be in \[1, 16\], got 17"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=17)


def test_metrics_report_the_prefix_cache(client, served_url):
    for _ in range(2):
        client.completions.create(model="tiny", prompt=PROMPT * 2, max_tokens=2, temperature=0)
    m = metrics(served_url)
    assert m['vt_prefix_cache_info{enabled=true}'] == 1
    assert m["vt_prefix_cache_cached_tokens_total"] > 0 and 0 < m["vt_prefix_cache_hit_rate"] < 1
    assert m["vt_prefix_cache_blocks"] > 0 and "vt_prefix_cache_evictions_total" in m
    assert "vt_prefix_cache_evictable_blocks" in m


def test_no_prefix_cache_switches_it_off(checkpoint):
    """`vt serve --no-prefix-cache` through the CLI's own parser and start-up (open_served,
    without serving HTTP): the engine shares no block, the start-up log says why, and
    /metrics' text says it is off."""
    import io

    from vt.cli.main import build_parser
    from vt.cli.serve import open_served
    from vt.serve.metrics import ServeMetrics
    args = build_parser().parse_args(["serve", "--model", str(checkpoint), "--served-model-name",
                                      "tiny", "--no-prefix-cache", *SERVER_FLAGS])
    log = io.StringIO()
    be, served, engine, _ = open_served(args, "vt serve", log)
    try:
        prompt = list(range(1, 3 * BLOCK + 2))        # three full blocks, then the last token
        for _ in range(2):
            engine.generate([prompt], max_new_tokens=2)
        stats = engine.stats()
    finally:
        engine.close()
        served.close()
        be.close()
    assert not stats["prefix_cache"]["enabled"] and stats["prefix_cache"]["cached_tokens"] == 0
    assert "prefix caching off (prefix_caching=False)" in log.getvalue()
    text = ServeMetrics("tiny").render(stats, 0)
    assert 'vt_prefix_cache_info{enabled="false"} 1' in text
    assert "vt_prefix_cache_cached_tokens_total 0" in text
