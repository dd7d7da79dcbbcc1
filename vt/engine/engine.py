"""Engine: continuous batching of requests over the runner. The engine captures the runner,
checks each request in the caller's thread, and hands it to its ServingLoop
(vt/engine/serving.py): ONE loop, in a thread the loop owns, serves every request.

Requests arrive from any thread (submit(); generate() is submit() for a list and a wait) and
are picked up between steps: the loop checks two deques' lengths per step (arrivals,
cancellations) and takes no lock unless one moved. Each step decodes every running request
one token and prefills the newly admitted ones (admitted while fewer than `serving_conc` run,
their KV blocks are free and the step's prompt tokens stay within `max_prefill_tokens`, which
bounds the prefill shapes warmed at construction: after it, serving makes no driver malloc;
a step model with `chunked_prefill` gets longer prompts in chunks over several steps).
The running requests' per-step state is a persistent DecodeBatch (vt/engine/batch.py): a row's
position is an offset plus the batch's step counter, so a step moves nothing per row. The
host knows each sequence's length without its tokens, so it plans step N+1 before step N's
tokens arrive. Tokens go to one shared buffer (vt/engine/token_buffer.py) that handles read by
cursor (vt/engine/handle.py): nothing is done per request per step to deliver them.

Schedule = f(requests) at every depth: a stop token takes effect on the schedule two steps
after the step that sampled it (the earliest the async pipeline can know it), also at depth 1,
so the synchronous run and the async modes see the same batches. A request's tokens depend
only on its prompt, its sampling and the model (the sampler keys on seed and position), not
on what else runs or when it arrived.

A failure inside a step (a kernel, the forward's host code, the device) fails the requests
that hold a row at that moment (those of the failed step and of the one in flight) with the
error; the stream is synchronized, every row and KV block is freed, and the loop goes on with
the requests not yet admitted and with new ones.
"""
from __future__ import annotations

from typing import Callable

from vt.forward.adapt import as_step_model
from vt.config import ExecutorConfig
from vt.hooks import NULL_HOOKS, ExecutorHooks, hooks_from_env
from vt.engine.call import GenerateCall
from vt.engine.handle import RequestHandle, TokenStream
from vt.engine.requests import RequestResult
from vt.executor.runner import Runner
from vt.validate import integer
from vt.engine.serving import ServingLoop
from vt.engine.progress import Progress, StartUpProgress, phase_reporter
from vt.engine.submit import check_one_request, make_requests
from vt.engine.model_lease import driving, model_key
from vt.engine.args import check_engine_args, check_generate_args, check_speculative_args
from vt.forward.speculative import SpeculativeConfig, SpeculativeModel

__all__ = ["Engine", "Progress", "RequestHandle", "StartUpProgress"]


def resolve_prefix_caching(model, requested: bool | None) -> tuple[bool, str]:
    """Whether the engine caches prompt prefixes over `model`, and the one line that says so
    and why (Engine's prefix_caching)."""
    name = type(model).__name__
    able = bool(model.prefix_cacheable) and bool(model.chunked_prefill)
    if requested and not able:
        why = ("does not prefill from a position (chunked_prefill)" if model.prefix_cacheable
               else "does not declare its KV position-addressed (prefix_cacheable)")
        raise ValueError(f"Engine: prefix_caching=True, but the step model {name} {why}: its "
                         f"cached prefixes could not be shared")
    if requested is False:
        return False, "prefix caching off (prefix_caching=False)"
    if not able:
        return False, (f"prefix caching off: the step model {name} does not declare its KV "
                       f"position-addressed (per-sequence state such as a recurrent one "
                       f"cannot start from another sequence's cached blocks)")
    return True, "prefix caching on: full blocks of prompts and answers are shared between requests"


class Engine:
    """Engine(backend, model_or_forward, config): captures at construction; close() when done.

    model_or_forward: a vt.bundled.HybridModel, or a vt.ForwardModel wrapping a user forward.
    config: an ExecutorConfig, built with its constructor (`ExecutorConfig(mode="ring")`);
    None reads the configuration from the environment, `ExecutorConfig.from_env()`, the
    VT_* variables of docs/configuration.md. An explicit config reads no environment.
    profile=True: device timing events around each step and the per-phase host split.
    start_up_progress: called with a vt.engine.progress.StartUpProgress as each phase of the
    construction (capturing the decode graphs, warming up the eager steps) starts and after
    each of its pieces, in this thread; None (the default) reports nothing.
    hooks: the test arms (vt.hooks, e.g. Poison()). None: none, except with config=None,
    where `vt.hooks.hooks_from_env()` reads them too (VT_ASYNC_EXECUTOR_POISON=1: Poison).
    prefix_caching: share the KV blocks of cached prompt prefixes between requests
    (vt/engine/kv_blocks.py). None (the default): on when the step model declares its KV
    position-addressed (StepModel.prefix_cacheable, e.g. vt.torch's LlamaDecoder) and
    prefills from a position; off otherwise (the bundled hybrid's recurrent state), which
    `prefix_caching_note` says. True: on, or ValueError when the model cannot; False: off.
    speculative: a vt.forward.speculative.SpeculativeConfig: speculative decoding, k drafts
    verified per row per step (docs/speculative.md); the step model must declare
    verifies_by_decode and hold verify_table_rows(...) token-table entries. Its requests are
    greedy or sampled (temperature, top_k, top_p, min_p, seed: the tokens decoding without it
    samples), without logprobs, grammars or penalties; stats()["speculative"] has its
    acceptance. None (the default): none.
    submit() and generate() may be called from any number of threads at once; the serving
    thread starts with start() or the first of them.
    """

    def __init__(self, backend, model_or_forward, config: ExecutorConfig | None = None, *,
                 record_logits: bool = False, max_prefill_tokens: int | None = None,
                 profile: bool = False, hooks: ExecutorHooks | None = None,
                 tensor_parallel: int = 1,
                 start_up_progress: Callable[[StartUpProgress], None] | None = None,
                 prefix_caching: bool | None = None,
                 speculative: SpeculativeConfig | None = None):
        check_engine_args(backend, config, record_logits, max_prefill_tokens, profile,
                          start_up_progress)
        if prefix_caching is not None and not isinstance(prefix_caching, bool):
            raise TypeError(f"Engine: prefix_caching must be a bool or None, got {prefix_caching!r}")
        check_speculative_args(speculative, record_logits, tensor_parallel)
        self.speculative = speculative
        self.be = backend
        if hooks is None:
            hooks = hooks_from_env() if config is None else NULL_HOOKS
        self.config = config if config is not None else ExecutorConfig.from_env()
        group = None
        if integer("Engine: tensor_parallel", tensor_parallel, 1) > 1:
            # model_or_forward is build(backend, tp): every rank builds its own shard
            from vt.parallel import RankGroup
            group = RankGroup(backend, model_or_forward, tensor_parallel, config=self.config,
                              hooks=hooks)
            model_or_forward = group.model
        try:
            self._construct(backend, model_or_forward, group, hooks, record_logits,
                            max_prefill_tokens, profile, start_up_progress, prefix_caching)
        except BaseException:
            if group is not None:
                group.stop("rank 0's Engine failed while starting")
            raise

    def _construct(self, backend, model_or_forward, group, hooks, record_logits,
                   max_prefill_tokens, profile, start_up_progress, prefix_caching) -> None:
        self.model = as_step_model(backend, model_or_forward)
        if self.speculative is not None:
            self.model = SpeculativeModel(backend, self.model, self.speculative)
        geo = self.model.geometry
        self.prefix_caching, self.prefix_caching_note = resolve_prefix_caching(
            self.model, prefix_caching)
        if self.config.serving_conc > geo.max_seqs:
            raise ValueError(f"serving_conc={self.config.serving_conc} exceeds the model's "
                             f"max_seqs={geo.max_seqs}")
        # A step prefills at most this many prompt tokens. A step model that prefills from a
        # position (chunked_prefill) gets longer prompts in chunks; for any other, one prompt
        # always fits (a prompt of up to max_context tokens is admitted alone). No step can
        # hold more than every row's full context: a larger budget means that one (and the
        # prefill shapes warmed stay within what the step model allocated for).
        chunked = bool(self.model.chunked_prefill)
        self.max_prefill_tokens = min(geo.max_seqs * geo.max_context,
                                      max_prefill_tokens or geo.max_context if chunked else
                                      max(geo.max_context, max_prefill_tokens or 0))
        self.record_logits = record_logits
        runner_args = dict(hooks=hooks, record_logits=record_logits, profile=profile)
        if group is None:
            self.runner = Runner(backend, self.model, self.config, **runner_args)
        else:
            from vt.parallel import RankZeroRunner
            self.runner = RankZeroRunner(group, backend, self.model, self.config, **runner_args)
        self._model_key = model_key(self.model)
        try:
            with driving(self._model_key, "Engine(...)"):
                self.runner.capture(phase_reporter(start_up_progress, "capturing decode graphs"))
                self.runner.warm_up(self.max_prefill_tokens,
                                    phase_reporter(start_up_progress, "warming up eager steps"))
        except BaseException:
            self.runner.close()
            raise
        # From here the loop closes the runner: at close(), or, for an Engine dropped without
        # close(), once the loop is collected (ServingLoop's module docstring).
        self._loop = ServingLoop(backend, self.runner, self.model,
                                 serving_conc=self.config.serving_conc, depth=self.config.depth,
                                 max_prefill_tokens=self.max_prefill_tokens,
                                 record_logits=record_logits, model_key=self._model_key,
                                 prefix_caching=self.prefix_caching,
                                 speculative=self._spec_k)
        self._pool_after_warm_up = backend.pool.stats()

    # -- public -------------------------------------------------------------------------
    def submit(self, prompt, *, max_new_tokens: int = 16, stop_token=None,
               sampling=None) -> RequestHandle:
        """Queue one request; it joins the batch at the next step boundary. Validates as
        generate() does and raises here, in the caller's thread. stop_token: None, a token id
        or a collection of ids (any of them ends the request). sampling: None (greedy) or a
        vt.SamplingParams. Thread-safe."""
        self._loop.check_open()
        self.runner.check_usable()
        check_one_request(max_new_tokens, sampling)
        (req,) = make_requests([prompt], max_new_tokens, stop_token, sampling,
                               self.model.geometry, self.model.vocab, self._loop.kv_capacity,
                               speculative=self._spec_k)
        return self._loop.enqueue([req], number=True)[0]

    def set_profile(self, on: bool) -> None:
        """Switch profile=True's timing (Engine's docstring) on or off for the calls that
        follow, on this engine and its captured graphs: the same loop timed and untimed,
        without a second engine. Only while the engine is idle (RuntimeError otherwise);
        with a trace it stays on."""
        self._loop.set_profile(on)

    @property
    def profile(self) -> bool:
        """Whether the engine times its loop now (profile=True, set_profile, or a trace)."""
        return self.runner.profile

    def stream_async(self, prompt, **kwargs) -> TokenStream:
        """`async for tok in engine.stream_async(prompt, max_new_tokens=...)`: submit() now
        (its errors raise here) and the tokens as they arrive, without blocking the event
        loop. Leaving the loop early (break, the task cancelled) cancels the request, also
        when the stream is held in a variable; `await stream.aclose()` cancels it outright
        (vt/engine/handle.py: TokenStream)."""
        return TokenStream(self.submit(prompt, **kwargs))

    def generate(self, prompts, *, max_new_tokens=16, stop_token=None,
                 sampling=None, progress: Callable[[Progress], None] | None = None
                 ) -> list[RequestResult]:
        """Run every prompt to completion; results in prompt order (submit() for each, then
        wait for all).

        max_new_tokens: one int for all prompts, or one per prompt. sampling: None (greedy),
        one vt.SamplingParams for all, or one per prompt. stop_token: as in submit(). A
        request that cannot be served whole raises RequestTooLargeError before any step runs.
        progress: called in this thread once per step of the engine while the call runs.
        If a step of its requests fails, the others are cancelled and the step's error is
        raised; on any exception here (the progress callback, KeyboardInterrupt) its requests
        are cancelled (rows and KV blocks freed) before it propagates. ClosedError if the
        engine is closed meanwhile.
        """
        self._loop.check_open()
        self.runner.check_usable()
        check_generate_args(prompts, progress)
        reqs = make_requests(prompts, max_new_tokens, stop_token, sampling, self.model.geometry,
                             self.model.vocab, self._loop.kv_capacity, speculative=self._spec_k)
        return GenerateCall(self._loop, reqs, progress).run()

    def start(self) -> None:
        """Start the serving thread (submit() and generate() do it when needed)."""
        self._loop.start()

    @property
    def _spec_k(self) -> int:
        return self.speculative.k if self.speculative is not None else 0

    def stats(self) -> dict:
        """Steps, graph vs eager steps, drains and why, waits and their time, per-phase time,
        pool state, rows and KV blocks in use; prefix_cache: enabled, hit_rate (prompt tokens
        served from cached blocks / prompt tokens admitted), prompt_tokens, cached_tokens,
        cached_blocks (blocks naming a prefix), evictable_blocks (those nobody holds),
        evictions (cached blocks whose memory an allocation took), note (why it is on/off);
        speculative (None without it): method, k, verify_rows (verify-step rows of live
        requests), drafts, accepted, acceptance_rate (accepted / drafts),
        mean_accepted_length (tokens a verify row emits, 1 .. k + 1)."""
        self._loop.check_open()
        st = self.runner.stats.as_dict()
        pool = self.be.pool.stats()
        loop = self._loop.stats()
        wall_s = loop["wall_s"]
        st.update(tokens=loop["tokens"], wall_s=wall_s,
                  tokens_per_s=loop["tokens"] / wall_s if wall_s else 0.0,
                  mode=self.mode, pool=pool.__dict__, failed_steps=loop["failed_steps"],
                  drained_fraction=st["drains"] / st["steps"] if st["steps"] else 0.0,
                  requests_finished=loop["requests_finished"],
                  requests_running=loop["requests_running"], rows_free=loop["rows_free"],
                  kv_blocks_free=loop["kv_blocks_free"], kv_blocks_total=loop["kv_blocks_total"],
                  prefix_cache=dict(loop["prefix_cache"], note=self.prefix_caching_note),
                  speculative=None if loop["speculative"] is None else dict(
                      loop["speculative"], method=self.speculative.method, k=self._spec_k),
                  phases={k: dict(p, device_ms=st["device_by_phase"][k][0],
                                  device_steps=st["device_by_phase"][k][1])
                          for k, p in loop["phases"].items()},
                  driver_mallocs_since_warm_up=pool.driver_mallocs - self._pool_after_warm_up.driver_mallocs)
        return st

    def idle(self) -> bool:
        """Nothing queued or running, every row and KV block free."""
        return self._loop.idle()

    @property
    def mode(self) -> str:
        """The executor mode's name (vt.config.MODES), then the test hooks' ("+poison")."""
        return self.config.mode + self.runner.hooks.label

    def device_ceiling_us(self, n: int, replays: int = 200) -> float:
        """µs per replay of the captured decode graph for n rows, back to back with no host
        work: the device-bound ceiling of a decode step. It replays the fullest of that
        size's last steps (one a ring slot; all padding if none ran yet). Call it while the
        engine is idle."""
        self._loop.check_open()
        with driving(self._model_key, "Engine.device_ceiling_us()"):
            return self.runner.ceiling_us(n, replays)

    def close(self, *, finish: bool = False) -> str | None:
        """Stop serving and free the engine (idempotent). finish=False: requests queued or
        running are cancelled at the next step boundary (finish_reason "cancelled"; a
        generate() waiting on them raises ClosedError); finish=True: they are served to the
        end first. Either way the steps in flight are collected, the serving thread exits
        and is joined, then graphs and buffers are freed. submit() raises ClosedError from
        the moment close() starts. Returns the trace path when a trace was written."""
        return self._loop.close(finish=finish)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
