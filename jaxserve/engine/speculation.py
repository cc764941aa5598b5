"""Speculative decoding on the host: whether a step speculates, prompt lookup's drafts, and the
verify steps' accepted tokens as each sequence's new tokens.

The device side (proposing with a draft model or an EAGLE head, verifying, the acceptance rule)
is the runner's (runner/speculative.py); this is what the engine core decides around it. A step
speculates when its decoding sequences are few enough (speculative_disable_by_batch_size), none
of them asks for a plain decode (logprobs, grammars, penalties) and, under adaptive prompt lookup
(engine/spec_policy.py), some draft is expected to pay; otherwise it runs as a plain step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from jaxserve.engine import rows as rows_mod
from jaxserve.engine.engine_config import EngineConfig
from jaxserve.engine.request import Sequence, Status
from jaxserve.engine.scheduler import StepPlan
from jaxserve.runner.step_batch import Chunk


@dataclasses.dataclass(frozen=True)
class Verify:
    """How a speculative step runs: `rows` the plan as one ragged step with prompt-lookup
    drafts, or None for a verify step of its own after the prompt chunks are filled (a draft
    model, prompt logprobs, more tokens than the largest bucket)."""

    rows: list[Chunk] | None


class Speculation:
    """A speculative engine's host state: its step counts (SpecStats), adaptive prompt lookup's
    policy when on, and how many steps ran plain because of the batch size or the policy."""

    def __init__(self, runner, cfg: EngineConfig, eos: frozenset[int], name: str, policy=None):
        from jaxserve.runner.speculative import SpecStats

        self.runner = runner
        self.cfg = cfg
        self.eos = eos  # the engine's EOS ids (rows' min_tokens controls)
        self.k = runner.spec_k
        self.name = name  # "ngram", "eagle" or the draft checkpoint's directory name (model info)
        self.stats = SpecStats(self.k)
        self.policy = policy  # adaptive prompt lookup (engine/spec_policy.py), or None
        # Steps with more decoding sequences than this run plain (EngineConfig's comment).
        self.max_batch = runner.cfg.speculative_disable_by_batch_size
        self.plain_steps = 0  # steps run plain because of it (or the policy)
        # steps whose in-flight step was read first to speculate, that then ran plain (each gives
        # up a plain step's overlap of host and device)
        self.plain_after_read = 0

    def may_speculate(self, running: Iterable[Sequence]) -> bool:
        """Whether the next step may speculate: its decoding sequences are no more than
        speculative_disable_by_batch_size (a prompt finishing its prefill may still push the
        step over it; that step then runs plain)."""
        decoding = [s for s in running if not s.prefilling]
        if self.max_batch is not None and len(decoding) > self.max_batch:
            return False
        if self.policy is not None:
            return self.policy.worth_trying([s.request_id for s in decoding])
        return True

    def choose(self, plan: StepPlan, in_flight: bool) -> Verify | None:
        """How the plan's decodes run: a Verify, or None for a plain step (no decodes, a row that
        needs a plain decode, a step still in flight, too many decodes, or no draft that pays)."""
        if not plan.decodes or any(s.params.plain_decode_only for s in plan.decodes):
            return None
        if in_flight or (self.max_batch is not None and len(plan.decodes) > self.max_batch):
            self.plain_steps += 1
            return None
        rows = self._lookup_rows(plan)
        if rows == "plain":  # adaptive prompt lookup: no draft pays this step
            self.plain_steps += 1
            return None
        return Verify(rows)

    def run(self, plan: StepPlan, verify: Verify) -> rows_mod.Sampled:
        """Run a speculative step; each decoding sequence's accepted tokens (no logprobs)."""
        if verify.rows is not None:  # prompt lookup: one ragged step verifies the decodes beside the chunks
            return self._verify_ragged(plan.decodes, verify.rows)
        # a draft model proposes on the device first; prompt logprobs; more tokens than a step
        if plan.prefills:
            self._prefill(plan.prefills)
        return self._verify(plan.decodes)

    def measure(
        self, plan: StepPlan, verify: Verify | None, seqs: list[Sequence], seconds: float | None, overlapped: bool
    ) -> None:
        """Adaptive prompt lookup's inputs: each touched request's new tokens against its shadow
        window, and a decode-only step's time (plain by rows, speculative by real tokens;
        `overlapped`: a plain step left in flight, whose time is its period)."""
        for seq in seqs:
            if seq.status is Status.FINISHED:
                self.policy.forget(seq.request_id)
            else:
                self.policy.observe(seq.request_id, seq.all_ids, len(seq.prompt_ids))
        if seconds is not None and plan.decodes and not plan.prefills and not plan.preempted:
            if verify is not None and verify.rows is not None:
                self.policy.costs.observe("spec", sum(len(r.tokens) for r in verify.rows), seconds)
            elif verify is None and overlapped:
                self.policy.costs.observe("plain", len(plan.decodes), seconds)

    def as_dict(self) -> dict:
        """The engine's speculative statistics (EngineCore.stats)."""
        return {
            **self.stats.as_dict(),
            "spec_plain_steps": self.plain_steps,
            "spec_plain_after_read": self.plain_after_read,
            **({"spec_step_seconds": self.policy.costs.table} if self.policy is not None else {}),
        }

    def _propose(self, seq: Sequence) -> tuple[list[int], float]:
        """Prompt lookup's drafts for a sequence (EngineConfig's prompt_lookup_min/max) and, when
        adaptive, their acceptance estimate (1.0 otherwise)."""
        if self.policy is not None:
            self.policy.observe(seq.request_id, seq.all_ids, len(seq.prompt_ids))
            return self.policy.propose(seq.request_id, seq.all_ids)
        from jaxserve.runner.speculative import ngram_propose

        c = self.cfg
        return ngram_propose(seq.all_ids, self.k, c.prompt_lookup_max, c.prompt_lookup_min), 1.0

    def _lookup_rows(self, plan: StepPlan) -> list[Chunk] | str | None:
        """The plan as one ragged step with prompt-lookup drafts: each decoding sequence's row is
        [its prompt's last chunk..., last token, drafts...] (sampling rows first, in plan.decodes'
        order), then the chunks of prompts still being filled. None where that step does not
        apply: a draft model, a chunk to score, or more tokens than the largest bucket; "plain"
        where adaptive prompt lookup finds no draft that pays (a plain step serves it)."""
        if self.runner.draft is not None or any(c.seq.wants_prompt_logprobs for c in plan.prefills):
            return None
        chunk_of = {id(c.seq): c for c in plan.prefills}
        proposals = [self._propose(s) for s in plan.decodes]
        if self.policy is not None:
            counts = self.policy.choose([(len(d), a, 1.0) for d, a in proposals])
            if counts is None:
                return "plain"
            proposals = [(d[:n], a) for (d, a), n in zip(proposals, counts)]
        rows = []
        for s, (drafts, _) in zip(plan.decodes, proposals):
            c = chunk_of.pop(id(s), None)
            start = s.length - 1 if c is None else c.start
            row = rows_mod.sampling_row(s, s.all_ids[start:] + drafts, self.eos, None, start)
            rows.append(dataclasses.replace(row, num_drafts=len(drafts)))
        rows += [rows_mod.prompt_row(c) for c in chunk_of.values()]
        if sum(len(r.tokens) for r in rows) > self.runner.token_buckets[-1]:
            return None
        return rows

    def _prefill(self, chunks) -> None:
        """Fill KV for the plan's prompt chunks ahead of a verify step of its own; chunks of
        sequences that ask for prompt logprobs are scored in the same device call."""
        targets = [rows_mod.next_tokens(c) if c.seq.wants_prompt_logprobs else None for c in chunks]
        results = self.runner.prefill([rows_mod.prompt_row(c) for c in chunks], targets)
        for c, r in zip(chunks, results):
            if r is not None:
                rows_mod.score(c, r)

    def _verify_ragged(self, seqs: list[Sequence], rows: list[Chunk]) -> rows_mod.Sampled:
        out, n_out = self.runner.speculate_ragged(rows)
        return self._accepted(seqs, out, n_out, [r.num_drafts for r in rows])

    def _verify(self, seqs: list[Sequence]) -> rows_mod.Sampled:
        if self.runner.draft is None:
            rows = [rows_mod.sampling_row(s, [s.all_ids[-1]] + self._propose(s)[0], self.eos) for s in seqs]
        else:
            rows = [rows_mod.sampling_row(s, [s.all_ids[-1]], self.eos) for s in seqs]
        out, n_out, num_drafts = self.runner.speculate(rows)
        return self._accepted(seqs, out, n_out, num_drafts)

    def _accepted(self, seqs: list[Sequence], out, n_out, num_drafts) -> rows_mod.Sampled:
        """Sequence i's tokens out[i, :n_out[i]] of a verify step, its drafts and their
        acceptance recorded."""
        result = {}
        for i, seq in enumerate(seqs):
            self.stats.record(int(num_drafts[i]), int(n_out[i]))
            result[seq.request_id] = [(int(t), None) for t in out[i, : n_out[i]]]
        return result
