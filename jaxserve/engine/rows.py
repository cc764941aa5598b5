"""A step between the engine and the runner: a plan's sequences as the rows the runner runs, and
the tokens and scores a step returns turned back into each sequence's new tokens.

The runner never sees a request (docs/architecture.md), so this is where a `Sequence` becomes a
`Chunk` (token ids, a start position, its pages, its sampling controls) and a `StepResult` row
becomes a sequence's `(token, logprobs)`. Plain functions of their arguments: the engine core and
the speculative path (engine/speculation.py) build their rows the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Sequence as Seq

import numpy as np

from jaxserve.engine import request as request_mod
from jaxserve.engine.request import Sequence
from jaxserve.engine.scheduler import StepPlan
from jaxserve.runner.step_batch import Chunk, Controls

# A sequence's new tokens from one step, by request id, each with its logprobs (or None):
# what Scheduler.apply and Scheduler.update take (speculative steps).
Sampled = dict[str, list[tuple[int, dict[int, float] | None]]]


def sampling_row(
    seq: Sequence, tokens: list[int], eos: frozenset[int], bitmask: np.ndarray | None = None, start: int | None = None
) -> Chunk:
    """A sampling row as the runner sees it: `tokens` from position `start` (default its last
    position: a decode row) through to its last token, where it samples, with its sampling
    controls (`eos`: the engine's EOS ids, which min_tokens holds back) and (constrained) its
    grammar's bitmask row for this step."""
    p = seq.params
    controls = None
    if p.controlled:
        penalty_ids, penalty_counts = seq.history.items() if seq.history is not None else ((), ())
        bias = p.logit_bias or {}
        controls = Controls(
            values=Controls.values_of(p),
            min_tokens=p.min_tokens,
            stop_ids=sorted(eos | set(p.stop_token_ids)) if p.min_tokens else (),
            penalty_ids=penalty_ids,
            penalty_counts=penalty_counts,
            bias_ids=list(bias),
            bias_values=[-np.inf if b <= request_mod.BAN else b for b in bias.values()],
            bitmask=bitmask,
        )
    return Chunk(
        tokens,
        seq.length - 1 if start is None else start,
        seq.pages,
        (p.temperature, p.top_k, p.top_p, seq.seed, seq.num_generated),
        controls=controls,
        local_pages=seq.local_pages,
    )


def prompt_row(c) -> Chunk:
    """A prompt chunk still being filled (a scheduler chunk): a row that samples nothing."""
    return Chunk(c.seq.all_ids[c.start : c.end], c.start, c.seq.pages, local_pages=c.seq.local_pages)


def next_tokens(c) -> list[int]:
    """A prompt chunk's scoring targets: each position's next token, padded past the known
    tokens (those positions are not kept)."""
    ids = c.seq.all_ids[c.start + 1 : c.end + 1]
    return ids + [0] * (c.end - c.start - len(ids))


def score(c, r) -> None:
    """Fill a sequence's prompt_logprobs for the positions chunk c covers from its scores r
    (the runner's PromptLogprobs)."""
    seq, n = c.seq, c.seq.params.prompt_logprobs
    for j in range(min(c.end, len(seq.prompt_ids) - 1) - c.start):  # a recomputed output is not scored
        lp = {seq.all_ids[c.start + 1 + j]: float(r.logprobs[j])}
        for k in range(n):
            lp.setdefault(int(r.top_ids[j, k]), float(r.top_logprobs[j, k]))
        seq.prompt_logprobs[c.start + 1 + j] = lp
        seq.prompt_ranks[c.start + 1 + j] = int(r.ranks[j])


def plan_rows(
    plan: StepPlan, eos: frozenset[int], masks: Mapping[int, np.ndarray], in_flight: Seq[Sequence]
) -> tuple[list[Chunk], list[int], list, list]:
    """The plan's rows for one ragged step: rows 0.. are the sequences that sample (a decode
    token, or a prompt's last chunk and its last token in one row), in plan.decodes' order, then
    the chunks of prompts still being filled. `masks`: the grammar bitmask of each constrained
    decode (by its index in plan.decodes); `in_flight`: the sampling sequences of the step on the
    device, whose row a sequence with a pending token is fed from.

    Returns the rows, each decode row's feed (its row in the step in flight, or -1), each row's
    scoring targets (empty when none is scored) and the scored (row, chunk) pairs."""
    prev_row = {id(s): i for i, s in enumerate(in_flight)}
    chunk_of = {id(c.seq): c for c in plan.prefills}
    rows, feed, targets, scored = [], [], [], []
    for i, s in enumerate(plan.decodes):
        c = chunk_of.pop(id(s), None) if chunk_of else None
        p = s.params
        if c is None and not p.controlled:  # a plain decode row (every row, in steady state): inlined
            n_out = len(s.output_ids) + s.num_pending
            if s.num_pending:
                last, f = 0, prev_row[id(s)]
            else:
                last, f = (s.output_ids or s.prompt_ids)[-1], -1
            sampling = (p.temperature, p.top_k, p.top_p, s.seed, n_out)
            rows.append(Chunk([last], len(s.prompt_ids) + n_out - 1, s.pages, sampling, local_pages=s.local_pages))
            feed.append(f)
            targets.append(None)
            continue
        last = 0 if s.num_pending else (s.output_ids or s.prompt_ids)[-1]
        if c is None:
            rows.append(sampling_row(s, [last], eos, masks.get(i)))
        else:  # the prompt's last chunk and its last token: one row that samples
            rows.append(sampling_row(s, s.all_ids[c.start : c.end] + [last], eos, masks.get(i), c.start))
        feed.append(prev_row[id(s)] if s.num_pending else -1)
        if c is not None and s.wants_prompt_logprobs:
            targets.append(next_tokens(c) + [0])
            scored.append((i, c))
        else:
            targets.append(None)
    for c in chunk_of.values():  # prompts still being filled: their rows sample nothing
        if c.seq.wants_prompt_logprobs:
            targets.append(next_tokens(c))
            scored.append((len(rows), c))
        else:
            targets.append(None)
        rows.append(prompt_row(c))
    return rows, feed, targets if scored else [], scored


def sampled_ids(seqs: list[Sequence], r) -> tuple[list, list[dict[int, float] | None] | None]:
    """Each sampling sequence's new tokens from a plain step's result r (the runner's
    StepResult, row i for seqs[i]), as `Scheduler.apply_ids` takes them: the step's ids in one
    `tolist` (one int a row; a list a row from a call of several decode steps) and, when any
    row asked, each row's logprobs (None for the others)."""
    n = len(seqs)
    if r.steps is not None:  # several decode steps: no logprobs
        return r.steps.T[:n].tolist(), None
    ids = r.tokens[:n].tolist()
    if r.logprobs is None:
        return ids, None
    chosen, top_ids, top_lps = r.logprobs.tolist(), r.top_ids.tolist(), r.top_logprobs.tolist()
    lps: list[dict[int, float] | None] = [None] * n
    for i, seq in enumerate(seqs):
        k = seq.params.logprobs
        if k is not None:  # the chosen token first, then the top k (which may include it)
            lp = {ids[i]: chosen[i]}
            for t, v in zip(top_ids[i][:k], top_lps[i][:k]):
                lp.setdefault(t, v)
            lps[i] = lp
    return ids, lps
