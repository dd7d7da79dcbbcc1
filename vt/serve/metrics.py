"""`GET /metrics`: the server's counters and histograms in Prometheus' text format (0.0.4),
with the engine's own gauges read at scrape time. Written by hand: a few dozen lines of a
stable format, not worth a dependency."""
from __future__ import annotations

import bisect
from collections import Counter

# Seconds: time to first token (prefill under load) and time per output token (decode).
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25,
                0.5, 1.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)    # the last one: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for bound, n in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{bound}"}} {total}')
        return out + [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]


class ServeMetrics:
    """What the server counts per request; render() adds the engine's state."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.requests = Counter({r: 0 for r in FINISH_REASONS})
        self.rejections = Counter({"overloaded": 0, "invalid": 0})
        self.prompt_tokens = self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int, times) -> None:
        """times: (time to first token, first to last token, tokens) in seconds, or None."""
        self.requests[reason] += 1
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += completion_tokens
        if times is not None:
            ttft, span, n = times
            self.ttft.observe(ttft)
            if n > 1:
                self.tpot.observe(span / (n - 1))

    def rejected(self, why: str) -> None:
        self.rejections[why] += 1

    def render(self, engine: dict, in_flight: int) -> str:
        """The exposition text; `engine` is Engine.stats(), `in_flight` the server's requests."""
        running, mode = engine["requests_running"], engine["mode"]
        blocks_in_use = engine["kv_blocks_total"] - engine["kv_blocks_free"]
        out = []

        def family(name, kind, help_text, samples):
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

        def scalar(name, kind, help_text, value):
            """A family of one unlabelled sample (a counter's is named NAME_total)."""
            family(name, kind, help_text, [f"{name}_total {value}" if kind == "counter"
                                           else f"{name} {value}"])

        family("vt_requests", "counter", "Requests finished, by finish reason.",
               [f'vt_requests_total{{finish_reason="{r}"}} {n}' for r, n in self.requests.items()])
        family("vt_requests_rejected", "counter", "Requests refused before running, by reason.",
               [f'vt_requests_rejected_total{{reason="{r}"}} {n}' for r, n in self.rejections.items()])
        scalar("vt_prompt_tokens", "counter", "Prompt tokens of finished requests.",
               self.prompt_tokens)
        scalar("vt_generation_tokens", "counter", "Tokens generated and returned.",
               self.generation_tokens)
        family("vt_time_to_first_token_seconds", "histogram",
               "From the request's arrival to its first token.",
               self.ttft.lines("vt_time_to_first_token_seconds"))
        family("vt_time_per_output_token_seconds", "histogram",
               "Per request, from the first to the last token over the tokens after the first.",
               self.tpot.lines("vt_time_per_output_token_seconds"))
        scalar("vt_requests_running", "gauge", "Requests holding a row of the batch.", running)
        scalar("vt_requests_waiting", "gauge", "Requests in the server waiting for a row.",
               max(0, in_flight - running))
        scalar("vt_kv_blocks_in_use", "gauge", "KV cache blocks held by requests.", blocks_in_use)
        scalar("vt_kv_blocks", "gauge", "KV cache blocks in all.", engine['kv_blocks_total'])
        cache = engine["prefix_cache"]
        family("vt_prefix_cache_info", "gauge",
               "Whether prompt prefixes' KV blocks are shared (the label; always 1).",
               [f'vt_prefix_cache_info{{enabled="{str(cache["enabled"]).lower()}"}} 1'])
        scalar("vt_prefix_cache_hit_rate", "gauge",
               "Prompt tokens served from cached KV blocks over prompt tokens admitted.",
               format(cache['hit_rate'], ".6g"))
        scalar("vt_prefix_cache_cached_tokens", "counter",
               "Prompt tokens served from cached KV blocks (not computed).", cache['cached_tokens'])
        scalar("vt_prefix_cache_blocks", "gauge", "KV blocks naming a cached prompt prefix.",
               cache['cached_blocks'])
        scalar("vt_prefix_cache_evictable_blocks", "gauge",
               "Cached KV blocks no request holds (evicted, least recently used first, when "
               "an allocation needs them).", cache['evictable_blocks'])
        scalar("vt_prefix_cache_evictions", "counter",
               "Cached KV blocks whose memory an allocation took.", cache['evictions'])
        scalar("vt_engine_steps", "counter", "Engine steps run.", engine['steps'])
        scalar("vt_drained_steps", "counter",
               "Steps whose host waited for the previous step before preparing the next.",
               engine['drains'])
        family("vt_engine_info", "gauge", "The engine's executor mode (the label; always 1).",
               [f'vt_engine_info{{mode="{mode}"}} 1'])
        scalar("vt_failed_steps", "counter", "Steps that failed (their requests got an error).",
               engine['failed_steps'])
        spec = engine.get("speculative")
        if spec is not None:   # vt serve --speculative
            scalar("vt_spec_decode_draft_tokens", "counter", "Draft tokens verified.",
                   spec['drafts'])
            scalar("vt_spec_decode_accepted_tokens", "counter", "Draft tokens accepted.",
                   spec['accepted'])
            scalar("vt_spec_decode_acceptance_rate", "gauge",
                   "Accepted draft tokens / draft tokens verified.",
                   format(spec['acceptance_rate'], ".6g"))
            scalar("vt_spec_decode_mean_accepted_length", "gauge",
                   "Tokens a verify step emits per row (1 .. k + 1).",
                   format(spec['mean_accepted_length'], ".6g"))
        return "\n".join(out) + "\n"
