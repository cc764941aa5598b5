"""Adaptive prompt lookup: how far each request speculates, step by step (plain Python, no jax).

A verify row of 1 + n tokens costs more than a decode row on a CPU, so a draft pays only when
it is accepted often enough. Each request keeps an n-gram index over its prompt and output
(`NgramIndex`: the latest earlier occurrence of its last 8, 3 or 2 tokens, O(1) a token) and a
record of how its proposals fare, by match length (a suffix that matched 16 tokens back is right
far more often than one that matched 2). The record is kept in plain steps too: a proposal made
at a token is checked against the tokens that follow (a "shadow" window), so a request that
stopped speculating keeps measuring what it would gain, and resumes when its answer starts to
copy its prompt. Each step then takes the drafts whose expected acceptance pays for the tokens
they add to the step, against the step times measured on this host (`StepCosts`): nothing
(a plain, overlapped step) when nothing pays, up to the compiled k where a long match continues.
Outputs never depend on these choices: verification emits plain decoding's tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

LONG_N = 8  # a suffix this long that occurred before is tried first (SuffixDecoding's long matches)
MAX_MATCH = 32  # how far back a match's length is counted
MATCH_CLASSES = (1, 4, 16)  # match lengths 1-3, 4-15, 16+: each has its own acceptance record
DECAY = 0.9  # a request's record: each window weighs 0.9 of the one after it
GLOBAL_DECAY = 0.99  # the engine's record across requests (a new request's prior)
PRIOR_WEIGHT = 2.0  # windows' worth of the engine's record in a new request's estimate
MARGIN = 1.05  # a speculative step must promise this much more than a plain one per second
# ... and this much more per further decoding row: a verify step gives up the overlap of the next
# step's dispatch with this one, and at batch 8 chat's few long matches lost 3-8% (measured 2026-12-07)
MARGIN_PER_ROW = 0.02
# At least one step in this many verifies the best drafts found even when the table says it does
# not pay: the table's verify costs are measured only by verify steps, and a host's load moves.
EXPLORE_EVERY = 256


class NgramIndex:
    """For each n in `ns`, the latest start of every n-gram of the tokens seen that has a token
    after it; `propose` returns what followed the latest earlier occurrence of the longest
    suffix found (the same drafts as speculative.ngram_propose for the same n's)."""

    def __init__(self, ns: Sequence[int]):
        self.ns = tuple(sorted(set(ns), reverse=True))
        self.starts: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.ns}
        self.done = 0  # tokens[:done] have their n-grams ending at done - 2 indexed

    def extend(self, tokens: Sequence[int]) -> None:
        for i in range(max(self.done - 1, 0), len(tokens) - 1):  # n-grams ending at i, followed by i + 1
            for n in self.ns:
                if i + 1 >= n:
                    self.starts[n][tuple(tokens[i + 1 - n : i + 1])] = i + 1 - n
        self.done = max(self.done, len(tokens))

    def propose(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """(drafts, match length): up to k tokens and how many tokens before them matched."""
        self.extend(tokens)
        size = len(tokens)
        for n in self.ns:
            if size <= n:
                continue
            start = self.starts[n].get(tuple(tokens[size - n :]))
            if start is None or start + n >= size:
                continue
            match = n
            while match < MAX_MATCH and start - (match - n) - 1 >= 0:
                if tokens[start - (match - n) - 1] != tokens[size - match - 1]:
                    break
                match += 1
            return list(tokens[start + n : start + n + k]), match
        return [], 0


def match_class(match: int) -> int:
    return bisect.bisect_right(MATCH_CLASSES, max(match, 1)) - 1


@dataclasses.dataclass
class Record:
    """Accepted and rejected drafts, decayed: the per-draft acceptance rate of a geometric run."""

    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, accepted: int, rejected: int, decay: float) -> None:
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + rejected

    def rate(self, prior: float, weight: float) -> float:
        return (self.accepted + weight * prior) / (self.accepted + self.rejected + weight)


@dataclasses.dataclass
class Window:
    drafts: list[int]
    cls: int
    matched: int = 0


class SeqSpec:
    """One request's index, its open shadow window and its records by match class."""

    def __init__(self, ns: Sequence[int]):
        self.index = NgramIndex(ns)
        self.seen = 0  # tokens checked against windows
        self.window: Window | None = None
        self.records = [Record() for _ in MATCH_CLASSES]
        self.proposing = 0.5  # decayed share of the points where a proposal exists
        self.last_cls = 0


class StepCosts:
    """Seconds a decode step takes, by kind ("plain": rows of one token; "spec": a verify step's
    real tokens) and size, from warm-up timings and then from the steps served (an average that
    follows the host's load); sizes between measured ones are interpolated, past them
    extrapolated from the last two."""

    def __init__(self, prior: dict[str, dict[int, float]] | None = None):
        # Without timings (an engine built without warm-up) a shape in units of a decode step,
        # scaled to seconds by the first step measured.
        self.in_seconds = prior is not None
        self.table: dict[str, dict[int, float]] = {
            "plain": dict((prior or {}).get("plain", {1: 1.0, 16: 2.0})),
            "spec": dict((prior or {}).get("spec", {2: 1.1, 16: 2.2})),
        }

    def observe(self, kind: str, size: int, seconds: float, weight: float = 0.2) -> None:
        if not self.in_seconds:
            scale = seconds / self.cost(kind, size)
            self.table = {k: {n: v * scale for n, v in t.items()} for k, t in self.table.items()}
            self.in_seconds = True
        t = self.table[kind]
        # a step the host stalled (another process, a collection) moves the average by at most 2x
        # its weight: verify steps of one size are rare, and one outlier must not stop them
        seconds = min(seconds, 2 * self.cost(kind, size))
        t[size] = seconds if size not in t else (1 - weight) * t[size] + weight * seconds

    def cost(self, kind: str, size: int) -> float:
        t = self.table[kind]
        keys = sorted(t)
        if size in t:
            return t[size]
        i = bisect.bisect_left(keys, size)
        if len(keys) == 1:
            return t[keys[0]] * size / keys[0]
        lo, hi = (keys[i - 1], keys[i]) if 0 < i < len(keys) else (keys[:2] if i == 0 else keys[-2:])
        return max(t[lo] + (t[hi] - t[lo]) * (size - lo) / (hi - lo), 1e-9)


class SpecPolicy:
    """Per-request lookahead for prompt lookup (module docstring). `k` is the compiled maximum."""

    def __init__(self, k: int, min_n: int, max_n: int, costs: StepCosts | None = None):
        self.k = k
        self.ns = tuple(n for n in {min_n, max_n, *range(min_n, max_n + 1), LONG_N} if n >= min_n)
        self.costs = costs or StepCosts()
        self.global_records = [Record(1.0, 2.0) for _ in MATCH_CLASSES]
        self.seqs: dict[str, SeqSpec] = {}
        self.plain_run = 0  # decode steps since the last verify step

    def state(self, request_id: str) -> SeqSpec:
        st = self.seqs.get(request_id)
        if st is None:
            st = self.seqs[request_id] = SeqSpec(self.ns)
        return st

    def forget(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)

    def rate(self, st: SeqSpec, cls: int) -> float:
        """A request's per-draft acceptance at a match class: its record there, with its record
        over all classes as the prior, whose own prior is the engine's record at that class."""
        pooled = Record(sum(r.accepted for r in st.records), sum(r.rejected for r in st.records))
        prior = pooled.rate(self.global_records[cls].rate(0.3, 1.0), PRIOR_WEIGHT)
        return st.records[cls].rate(prior, PRIOR_WEIGHT)

    # -- measuring ---------------------------------------------------------------------
    def observe(self, request_id: str, tokens: Sequence[int], start: int) -> None:
        """Check the tokens from `start` on (a request's output so far: prompt tokens are never
        checked) against its shadow windows, opening a window at every token where none is."""
        st = self.state(request_id)
        st.seen = max(st.seen, start)
        while st.seen < len(tokens):
            if st.window is None:
                self._open(st, tokens[: st.seen])
            tok = tokens[st.seen]
            st.seen += 1
            w = st.window
            if w is None:
                continue
            if tok == w.drafts[w.matched]:
                w.matched += 1
                if w.matched == len(w.drafts):
                    self._close(st, w.matched, 0)
            else:
                self._close(st, w.matched, 1)

    def _open(self, st: SeqSpec, tokens: Sequence[int]) -> None:
        drafts, match = st.index.propose(tokens, self.k)
        st.proposing = DECAY * st.proposing + (1 - DECAY) * bool(drafts)
        if drafts:
            st.last_cls = match_class(match)
            st.window = Window(drafts, st.last_cls)

    def _close(self, st: SeqSpec, accepted: int, rejected: int) -> None:
        cls = st.window.cls
        st.records[cls].add(accepted, rejected, DECAY)
        self.global_records[cls].add(accepted, rejected, GLOBAL_DECAY)
        st.window = None

    # -- choosing ----------------------------------------------------------------------
    def propose(self, request_id: str, tokens: Sequence[int]) -> tuple[list[int], float]:
        """A request's drafts at its last token (up to k) and their per-draft acceptance estimate."""
        st = self.state(request_id)
        drafts, match = st.index.propose(tokens, self.k)
        return drafts, self.rate(st, match_class(match)) if drafts else 0.0

    def choose(self, proposals: Sequence[tuple[int, float, float]]) -> list[int] | None:
        """How many drafts each row verifies, given (drafts available, acceptance estimate a,
        chance p that it proposes at all) per decoding row; None: a plain step is expected to
        serve more tokens a second. Draft j of a row is accepted with probability p a^j; the
        drafts are taken best first, and the step size that maximises expected tokens /
        measured seconds wins."""
        rows = len(proposals)
        gains = sorted(
            ((p * a**j, i) for i, (n, a, p) in enumerate(proposals) for j in range(1, min(n, self.k) + 1)),
            key=lambda g: -g[0],
        )
        plain = rows / self.costs.cost("plain", rows)
        explore = self.plain_run >= EXPLORE_EVERY
        margin = MARGIN + MARGIN_PER_ROW * (rows - 1)
        best, best_m, expected = (0.0 if explore else plain * margin), 0, float(rows)
        for m, (g, _) in enumerate(gains, start=1):
            expected += g
            v = expected / self.costs.cost("spec", rows + m)
            if v > best:
                best, best_m = v, m
        if best_m == 0:
            self.plain_run += 1
            return None
        self.plain_run = 0
        counts = [0] * rows
        for _, i in gains[:best_m]:
            counts[i] += 1
        return counts

    def worth_trying(self, request_ids: Sequence[str]) -> bool:
        """Whether the next step may speculate, before its tokens are known (a speculative step
        needs the step in flight read first, giving up the overlap): by each request's share of
        points with a proposal and the acceptance of its latest match class."""
        if not request_ids:
            return False
        if self.plain_run >= EXPLORE_EVERY:
            return True
        est = []
        for rid in request_ids:
            st = self.state(rid)
            est.append((self.k, self.rate(st, st.last_cls), min(1.0, st.proposing * 1.25)))
        run = self.plain_run
        verdict = self.choose(est) is not None
        self.plain_run = run + (not verdict)  # a step that is not tried counts as plain once
        return verdict
