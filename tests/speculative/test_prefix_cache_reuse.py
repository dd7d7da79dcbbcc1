"""Prefix caching under speculation when blocks are reused. A verify step finishes a request
ahead of the batch's length schedule (up to k + 1 tokens a step, the schedule's one): its
answer's blocks are named when its tokens are collected, while it holds them; the
schedule's step for its last token comes later, when those blocks may be another request's.
Naming them again then gave a later prompt holding that answer (a conversation's next turn)
the other request's KV. The workload is the fault fuzz's (tools/fuzz_faults.py) positional
case of seed 4, served offline: prompts sharing prefixes, then each answer's next turn."""
import dataclasses
import random

import pytest

from tools import fuzz, fuzz_faults


@pytest.mark.parametrize("method,k", [("oracle", 1), ("oracle", 2), ("draft", 1)])
def test_a_next_turn_gets_its_answers_kv_after_the_blocks_were_reused(sim_backend, method, k):
    case = fuzz.with_speculation(fuzz_faults.positional_case(4, max_requests=24), method, k)
    models = fuzz.Models()
    first, stop = case.rounds[0], case.stops[0]
    answers = fuzz.run_mode(sim_backend, models, case, "sync", reference=True).rounds[0]
    turns = [t for t in fuzz_faults.second_turns(case, first, answers, random.Random(4)) if t]
    case = dataclasses.replace(case, rounds=(first, tuple(turns)), stops=(stop, stop))
    want = fuzz.run_mode(sim_backend, models, case, "sync", reference=True)
    got = fuzz.run_mode(sim_backend, models, case, "sync",
                        references=fuzz.references_of(case, want))
    assert got.stats["prefix_cache"]["cached_tokens"] > 0
    assert got.stats["prefix_cache"]["evictions"] > 0, "no block was reused: the test proves nothing"
    wrong = fuzz.compare(case, want, got)
    assert not wrong, wrong[:3]
