"""`vt bench --workload torch-decode --speculative oracle|ngram|draft`: speculative decoding
against decoding without it, on one torch Llama decoder (default torch-llama3-8b), in one run.

Per rows S (--rows), S prompts of L - steps/2 tokens each (L the first --live, the mean live
context of the steps, as in the floor table) decode --steps new tokens,
greedy, on one engine without speculation (the baseline) and on one speculative engine per
--accept fraction (oracle: the first round(accept * k) drafts of each step right, the rest
wrong; ngram: its own lookups, one engine; draft: a draft model of the target's shape with
--draft-layers layers and its own random weights, one engine: its acceptance on random weights
means nothing, its step time is what a draft of that size costs). Each run is timed
--repeats times after a warm
one; the median is kept. The baseline's warm run decodes k tokens more than the timed ones:
its tokens are the oracle's references, so that a request's last verify step, whose drafts
reach k tokens past the ones it keeps, proposes right ones too.

Both engines run the decoder in its batch-invariant mode (LlamaDecoder(batch_invariant=True);
--no-batch-invariant: its default kernels). A verify step is the decoder's decode step over
S * (k + 1) rows, and in that mode a token's logits bits do not depend on the rows of its
step, so the target's greedy token of every verify position is the one decoding without
speculation gives: the tokens equal the baseline's and the oracle's right drafts are all
accepted. With the default kernels the verify step's sums run in another order than a
one-token step's (another matmul kernel for k + 1 times the rows, attention split
otherwise), so on near-tied logits (random weights) the target's greedy token can flip; from
there on the oracle proposes the baseline's tokens, which the target no longer produces, and
its acceptance falls with no bug anywhere. In the batch-invariant mode the bench therefore
fails (exit 1, one line on stderr, after the table) where a speculative run's tokens differ
from the baseline's or an oracle run accepts less than the drafts it proposes right, less
ACCEPTANCE_SLACK: a broken oracle or verify step, never noise.

- step ms: a decode step's time, (last token's time - first token's) / the steps between
  them; each step's tokens share their time, so the steps are the distinct times. At one row
  the speculative step over the baseline's is the verify step (k + 1 tokens) over a
  one-token step, host included.
- tok/s: the tokens the S requests got after their first over the same span, all rows.
- speedup: tok/s over the baseline's at the same S; acceptance: Engine.stats()'s.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

METHODS = ("oracle", "ngram", "draft")
# An oracle run of the batch-invariant decoder accepts exactly the drafts it proposes right
# (round(accept * k) of k); the slack only keeps a float comparison from failing on equality.
ACCEPTANCE_SLACK = 0.01


def add_arguments(p) -> None:
    p.add_argument("--speculative", default=None, choices=METHODS,
                   help="compare speculative decoding (docs/speculative.md) with decoding "
                        "without it instead of the floor table: oracle (a set fraction of "
                        "right drafts, --accept), ngram, or draft (--draft-layers)")
    p.add_argument("--num-spec", type=int, default=4, metavar="K",
                   help="--speculative: drafts per step (default 4)")
    p.add_argument("--accept", type=float, nargs="+", default=[1.0, 0.5], metavar="F",
                   help="--speculative oracle: the fractions of right drafts (default 1.0 0.5)")
    p.add_argument("--draft-layers", type=int, default=None, metavar="N",
                   help="--speculative draft: the draft model, the target's shape with N layers "
                        "and random weights of its own (its acceptance means nothing; its cost "
                        "is that of a draft of that size)")
    p.add_argument("--no-batch-invariant", action="store_true",
                   help="--speculative: run the decoder on its default kernels, not its "
                        "batch-invariant ones (faster; greedy tokens with speculation may then "
                        "differ from those without, and the oracle's acceptance fall)")


def check_arguments(args, error) -> None:
    from vt.forward.speculative import MAX_K
    if (args.draft_layers is not None) != (args.speculative == "draft"):
        error("--speculative draft needs --draft-layers N, and --draft-layers needs "
              "--speculative draft")
    if args.speculative is None:
        if args.no_batch_invariant:
            error("--no-batch-invariant: only with --speculative (the floor table's decoder "
                  "follows VT_BATCH_INVARIANT)")
        return
    if args.draft_layers is not None and args.draft_layers < 1:
        error(f"--draft-layers {args.draft_layers}: must be at least 1")
    if not 1 <= args.num_spec <= MAX_K:
        error(f"--num-spec {args.num_spec}: must be in [1, {MAX_K}]")
    bad = [a for a in args.accept if not 0.0 <= a <= 1.0]
    if bad:
        error(f"--accept {bad}: fractions in [0, 1]")
    need = args.live[0] + args.steps // 2 + args.num_spec
    if need > args.max_context:
        error(f"--speculative: --live {args.live[0]}, --steps {args.steps} and --num-spec "
              f"{args.num_spec} need {need} positions within --max-context {args.max_context}")


def run(be, cfg, dtype, args, out) -> None:
    """Fill out['speculative'] (module docstring) on backend `be`."""
    import numpy as np
    import torch

    from vt.backend.zeros import zeros
    from vt.bench.torch_ttft import seeded_prompts
    from vt.bench.torch_workload import tool_decoder, whole_context_geometry
    from vt.engine import Engine
    from vt.forward.speculative import SpeculativeConfig, verify_table_rows
    from vt.config import ExecutorConfig
    from vt.torch import TorchForwardModel

    k, rows = args.num_spec, sorted(set(args.rows))
    geo = whole_context_geometry(rows[-1], args.max_context)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    module = tool_decoder(cfg, geo, dtype, be, args, "torch_decode",
                          batch_invariant=not args.no_batch_invariant)
    table = zeros(be, (verify_table_rows(geo.max_seqs, geo.max_seqs, k),), np.int32)
    draft = None
    if args.speculative == "draft":
        torch.manual_seed(1)
        draft_module = tool_decoder(dataclasses.replace(cfg, layers=args.draft_layers), geo,
                                    dtype, be, args, "torch_decode",
                                    batch_invariant=not args.no_batch_invariant)
        draft = TorchForwardModel(be, draft_module, vocab=cfg.vocab, geometry=geo, prefill="flat",
                                  token_table=zeros(be, table.shape, np.int32))
    config = ExecutorConfig(mode=args.mode, serving_conc=rows[-1], capture_sizes=tuple(rows))
    prompt_len = args.live[0] - args.steps // 2
    prompts = {S: seeded_prompts(cfg.vocab, S, prompt_len, S * 100003 + 7) for S in rows}

    def engine(spec):
        model = TorchForwardModel(be, module, vocab=cfg.vocab, geometry=geo, prefill="flat",
                                  token_table=table)
        return Engine(be, model, config, max_prefill_tokens=args.prefill_chunk, speculative=spec,
                      prefix_caching=False)

    res = dict(method=args.speculative, k=k, rows=rows, prompt=prompt_len,
               new_tokens=args.steps, batch_invariant=module.batch_invariant, runs=[],
               draft_layers=args.draft_layers)
    refs, repeatable = {}, True
    with engine(None) as eng:
        res["setup_s"] = time.perf_counter() - t0
        for S in rows:
            cell, tokens, warm = _timed(eng, prompts[S], args, args.steps + k)
            refs.update({tuple(p): t for p, t in zip(prompts[S], warm)})
            repeatable &= all(list(t) == list(w[:args.steps]) for t, w in zip(tokens, warm))
            res["runs"].append(dict(cell, rows=S, accept=None))
            _say(res["runs"][-1], args.speculative)
    res["baseline_repeatable"] = repeatable
    accepts = args.accept if args.speculative == "oracle" else [None]
    for a in accepts:
        spec = SpeculativeConfig(args.speculative, k=k, accept=1.0 if a is None else a,
                                 references=refs if args.speculative == "oracle" else None,
                                 draft=draft)
        with engine(spec) as eng:
            for S in rows:
                before = eng.stats()["speculative"]
                cell, tokens, _ = _timed(eng, prompts[S], args, args.steps)
                after = eng.stats()["speculative"]
                drafts = after["drafts"] - before["drafts"]
                cell["acceptance"] = (after["accepted"] - before["accepted"]) / drafts if drafts else 0.0
                cell["tokens_equal"] = all(list(t) == list(refs[tuple(p)][:args.steps])
                                           for p, t in zip(prompts[S], tokens))
                res["runs"].append(dict(cell, rows=S, accept=a))
                _say(res["runs"][-1], args.speculative)
    res.update(ratios(res["runs"], rows))
    res["failure"] = failure(res)
    out["speculative"] = res


def failure(s: dict) -> str | None:
    """The one line the bench fails with (module docstring), or None: with the batch-invariant
    decoder, the baseline's tokens must repeat run to run, every speculative run's must equal
    them, and an oracle run must accept the drafts it proposes right."""
    if not s["batch_invariant"]:
        return None
    where = "vt bench: torch-decode --speculative with the batch-invariant decoder"
    if not s["baseline_repeatable"]:
        return f"{where}: the baseline's tokens differ between its runs"
    for c in s["runs"]:
        if "acceptance" not in c:
            continue
        what = s["method"] if c["accept"] is None else f"oracle accept {c['accept']}"
        if not c["tokens_equal"]:
            return (f"{where}: {what} at S={c['rows']}: the tokens differ from the baseline's "
                    f"(acceptance {c['acceptance']:.3f})")
        if c["accept"] is not None:
            right = round(c["accept"] * s["k"]) / s["k"]
            if c["acceptance"] < right - ACCEPTANCE_SLACK:
                return (f"{where}: {what} at S={c['rows']} accepted {c['acceptance']:.3f} of its "
                        f"drafts, {right:.3f} of them right: the oracle or the verify step is "
                        f"broken")
    return None


def _timed(eng, prompts, args, warm_new_tokens: int):
    """(the median cell of --repeats runs of --steps new tokens after a warm run of
    warm_new_tokens, the last timed run's tokens, the warm run's tokens)."""
    warm = [r.tokens for r in eng.generate(prompts, max_new_tokens=warm_new_tokens)]
    cells, tokens = [], None
    for _ in range(args.repeats):
        results = eng.generate(prompts, max_new_tokens=args.steps)
        tokens = [r.tokens for r in results]
        cells.append(_cell([r.token_times for r in results]))
    pick = lambda key: statistics.median(c[key] for c in cells)   # noqa: E731
    return dict(step_s=pick("step_s"), tokens_per_s=pick("tokens_per_s")), tokens, warm


def _cell(times) -> dict:
    start, end = max(t[0] for t in times), max(t[-1] for t in times)
    steps = len({float(x) for t in times for x in t if x > start})
    kept = sum(int((t > start).sum()) for t in times)
    span = end - start
    return dict(step_s=span / steps if steps else float("nan"),
                tokens_per_s=kept / span if span > 0 else float("nan"))


def ratios(runs, rows) -> dict:
    """The headline ratios: the verify step at one row over a one-token step (the first
    --accept's engine), and every speculative run's tok/s over the baseline's at its rows."""
    base = {r["rows"]: r for r in runs if r["accept"] is None and "acceptance" not in r}
    spec = [r for r in runs if "acceptance" in r]
    for r in spec:
        r["speedup"] = r["tokens_per_s"] / base[r["rows"]]["tokens_per_s"]
    one = [r for r in spec if r["rows"] == rows[0]]
    return dict(verify_over_step=one[0]["step_s"] / base[rows[0]]["step_s"] if one else None)


def _say(r, method: str) -> None:
    what = "baseline" if "acceptance" not in r else (
        f"accept {r['accept']}" if r["accept"] is not None else method)
    print(f"  S={r['rows']:3d} {what:>12}: step {1e3 * r['step_s']:8.3f} ms, "
          f"{r['tokens_per_s']:9.1f} tok/s"
          + (f", acceptance {r['acceptance']:.2f}" if "acceptance" in r else ""), flush=True)


def format_table(r: dict) -> str:
    s = r["speculative"]
    kernels = ("batch-invariant decoder" if s["batch_invariant"] else
               "default kernels (not batch-invariant)")
    lines = [f"{r['preset']} on {r['device']} ({r['backend']}), {r['dtype']}, vt mode {r['mode']}, "
             f"{kernels}: speculative {s['method']}, k={s['k']}, prompts of {s['prompt']} "
             f"tokens, {s['new_tokens']} new ones",
             f"{'S':>3} {'run':>12} {'step ms':>8} {'tok/s':>9} {'speedup':>7} {'accepted':>8} "
             f"{'same':>5}"]
    for c in s["runs"]:
        spec = "acceptance" in c
        what = "baseline" if not spec else (f"accept {c['accept']}" if c["accept"] is not None
                                            else s["method"])
        lines.append(f"{c['rows']:3d} {what:>12} {1e3 * c['step_s']:8.3f} {c['tokens_per_s']:9.1f} "
                     + (f"{c['speedup']:7.2f} {c['acceptance']:8.2f} {str(c['tokens_equal']):>5}"
                        if spec else f"{'-':>7} {'-':>8} {'-':>5}"))
    v = s.get("verify_over_step")
    lines.append(f"verify step (k + 1 = {s['k'] + 1} tokens, {s['rows'][0]} row) / one-token step: "
                 + (f"{v:.3f}" if v is not None else "-"))
    lines.append("step ms: (last token time - first) / steps between; speedup: tok/s over the "
                 "baseline's at the same rows; accepted: drafts accepted / verified; same: the "
                 "tokens equal the baseline's")
    if s["method"] == "draft":
        lines.append(f"draft: the target's shape with {s['draft_layers']} layers and random "
                     f"weights of its own: its acceptance on random weights means nothing (the "
                     f"tokens and the step cost do)")
    if not s["batch_invariant"]:
        lines.append("default kernels: a verify step's logits may differ in their last bits from "
                     "a one-token step's, so greedy tokens may differ from the baseline's and the "
                     "oracle's acceptance fall below its right drafts (docs/speculative.md)")
    return "\n".join(lines)
