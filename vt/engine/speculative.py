"""generate_speculative: speculative decoding of a batch of prompts over the runner, at the
executor config's depth (docs/speculative.md).

Every prompt is admitted at once (one prefill step), then decode steps run until each request
has max_new_tokens or its stop token. A step's plan is each live row's token-table row and
block table only: positions, lengths and KV slots come from the device (SpeculativeModel), so
at depth 2 step N + 1 is launched before step N's tokens and accepted counts are read. A row
that finishes in step N is in step N + 1 already; what that step emits for it is dropped,
and it writes only KV slots past the request's end (reserved for it: k more than its tokens
need, or the pad slot past max_context).
"""
from __future__ import annotations

from collections import deque
from contextlib import closing
from dataclasses import dataclass, field

import numpy as np

from vt.executor.plan import StepPlan
from vt.executor.runner import Runner
from vt.forward.speculative import SpeculativeModel, read_record
from vt.engine.submit import check_speculative_sampling
from vt.step.contract import GREEDY, DecodeRows, PrefillSeq, row_vectors
from vt.hooks import NULL_HOOKS


@dataclass
class SpeculativeStats:
    """drafts: drafts verified for rows still live; accepted: those accepted; row_steps:
    verify-step rows counted; tokens: tokens kept."""
    drafts: int = 0
    accepted: int = 0
    row_steps: int = 0
    tokens: int = 0
    runner: dict = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafts if self.drafts else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a row emits per verify step (1 .. k + 1)."""
        return (self.accepted + self.row_steps) / self.row_steps if self.row_steps else 0.0


def generate_speculative(be, model: SpeculativeModel, config, prompts, max_new_tokens, *,
                         stop_token: int | None = None, sampling=None, hooks=NULL_HOOKS):
    """(tokens per prompt [list of int32 arrays], SpeculativeStats) of decoding with `model`'s
    drafts under ExecutorConfig `config` (its mode, capture sizes and trace). sampling: None
    (greedy), one vt.SamplingParams for every prompt or one per prompt (temperature, top_k,
    top_p, min_p and seed; no logprobs, penalties or grammar)."""
    g, k = model.geometry, model.config.k
    n = len(prompts)
    budgets = [int(max_new_tokens)] * n if np.isscalar(max_new_tokens) else [int(b) for b in max_new_tokens]
    if not 1 <= n <= g.max_seqs or len(budgets) != n:
        raise ValueError(f"generate_speculative: {n} prompts with {len(budgets)} budgets; "
                         f"1 to max_seqs={g.max_seqs} prompts, one budget each")
    samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling or GREEDY] * n
    if len(samplings) != n:
        raise ValueError(f"generate_speculative: {len(samplings)} SamplingParams for {n} prompts")
    for i, sp in enumerate(samplings):
        check_speculative_sampling(i, sp)
    if model.config.method == "oracle":
        missing = [i for i, p in enumerate(prompts)
                   if tuple(int(t) for t in p) not in model.config.references]
        if missing:
            raise ValueError(f"generate_speculative: the oracle has no reference for prompts {missing}")
    tables = _reserve(g, k, prompts, budgets)
    stats = SpeculativeStats()
    with closing(Runner(be, model, config, hooks=hooks)) as runner:
        runner.capture()
        runner.warm_up(sum(len(p) for p in prompts))
        seqs = [PrefillSeq(i, np.asarray(p, np.int32), tables[i], i, samplings[i])
                for i, p in enumerate(prompts)]
        first = runner.collect(runner.launch(StepPlan(None, seqs, tag=list(range(n)))))
        out = [[int(first[i])] for i in range(n)]
        done = [len(out[i]) >= budgets[i] or out[i][-1] == stop_token for i in range(n)]
        inflight: deque = deque()
        while True:
            live = [i for i in range(n) if not done[i]]
            if live:
                inflight.append(runner.launch(StepPlan(_rows(live, tables, samplings), tag=live)))
            if not inflight:
                break
            if live and config.depth == 2 and len(inflight) < 2:
                continue   # step N + 1 goes out before step N is read
            handle = inflight.popleft()
            runner.collect(handle)
            for j, i in enumerate(handle.tag):
                if done[i]:
                    continue   # finished in an earlier step: this step's tokens are past its end
                emitted = read_record(handle.records[j])
                stats.row_steps += 1
                stats.drafts += k
                stats.accepted += len(emitted) - 1
                for t in emitted:
                    out[i].append(int(t))
                    if len(out[i]) >= budgets[i] or t == stop_token or t < 0:
                        done[i] = True
                        break
        stats.runner = runner.stats.as_dict()
    stats.tokens = sum(len(o) for o in out)
    return [np.array(o, np.int32) for o in out], stats


def _reserve(g, k: int, prompts, budgets) -> list[np.ndarray]:
    """Each request's block table: blocks for its prompt, every token but its last, and the k
    positions a verify step may write past them."""
    free = [b for b in range(g.num_kv_blocks) if b != g.scratch_block]
    tables = []
    for p, budget in zip(prompts, budgets):
        if len(p) + budget > g.max_context:
            raise ValueError(f"generate_speculative: a prompt of {len(p)} tokens and "
                             f"{budget} new ones exceed max_context={g.max_context}")
        need = min(-(-(len(p) + budget - 1 + k) // g.block_size), g.max_blocks)
        if need > len(free):
            raise ValueError(f"generate_speculative: the KV cache has too few blocks "
                             f"({g.num_kv_blocks}) for these requests")
        bt = np.full(g.max_blocks, g.scratch_block, np.int32)
        bt[:need], free = free[:need], free[need:]
        tables.append(bt)
    return tables


def _rows(live: list[int], tables, samplings) -> DecodeRows:
    """The decode rows of a verify step: rows, block tables and sampling; the positions,
    lengths and slots the host would plan are the device's (zeros here: never read)."""
    rows = np.array(live, np.int32)
    zero = np.zeros(len(live), np.int32)
    return DecodeRows(rows, zero, zero + 1, zero, np.stack([tables[i] for i in live]), rows,
                      **row_vectors([samplings[i] for i in live]))

