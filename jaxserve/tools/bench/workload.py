"""Workloads: the requests a benchmark sends, round after round.

One loader for every kind, so that `throughput`, `latency`, `serve` and `prefix` measure the
same thing the same way:

- ``random``: prompt and output lengths uniform in their ranges (inclusive);
- ``shared-prefix``: one shared prefix of ``prefix_len`` tokens, then a random suffix;
- ``long-short``: a ``long_fraction`` of the prompts long (``long_len``), the rest short;
- ``prefix-groups``: ``num_groups`` groups (shared system prompts, or the conversations of a
  multi-turn chat), each with its own prefix of ``prefix_len`` tokens; every request belongs to
  one group (drawn once from ``seed``, the groups interleaved in arrival order) and adds a
  random suffix. The workload that tells cache-aware routing from round-robin: a replica that
  sees a group again serves its prefix from its cache (docs/scaling.md);
- ``json``: the requests of a file such as ../shared/workloads/mixed-64.json (below).

Lengths are drawn once from ``seed``, so every round (and every configuration of an A/B run)
gets the same lengths. The token ids are drawn again for each round (seed, round): a second
round never hits the prefix cache the first one filled, in jaxserve or in vLLM (both cache
prefixes by default). Within a round, a shared-prefix workload shares its prefix on purpose.

A JSON workload file::

    {"requests": [{"prompt_ids": [5, 17, ...], "output_len": 128},
                  {"prompt": "Some text", "output_len": 32}, ...],
     "vocab_size": 32000,           # optional: the range of fresh ids in rounds after the first
     "model": {...}}                # optional: a random Llama to build (model_from_spec)

Round 0 sends the file's own prompts; later rounds send fresh ids of the same lengths (text
prompts get the round number in front, which changes their first token).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

KINDS = ("random", "shared-prefix", "prefix-groups", "long-short", "json")

# Text prompts (`serve --prompt-format text`): common words, about one token each in any
# English BPE vocabulary, so a prompt of N words is about N tokens.
WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or had not but "
    "one all their there been has when who will more no if out so said what up its about into than them can "
    "only other new some time could these two may then do first any like now my such make over our even most "
    "me state after also made many did must before back see through way where get much go well your know"
).split()


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: a prompt (token ids, or text), how many tokens to generate (EOS ignored
    unless `until_eos`: then at most that many, an answer that ends where the model ends it)
    and how: greedy unless the workload samples."""

    prompt: list[int] | str
    output_len: int
    temperature: float = 0.0
    top_p: float = 1.0
    until_eos: bool = False

    @property
    def prompt_len(self) -> int:
        """Token ids: exact. Text: words, about the tokens."""
        return len(self.prompt) if isinstance(self.prompt, list) else len(self.prompt.split())


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """What the command line says about the workload. Ranges are (low, high), both inclusive."""

    kind: str = "random"
    num_requests: int = 64
    prompt_len: tuple[int, int] = (16, 512)
    output_len: tuple[int, int] = (16, 256)
    prefix_len: int = 1024  # shared-prefix, prefix-groups: the shared part; prompt_len is the unique suffix
    num_groups: int = 8  # prefix-groups: how many distinct prefixes
    long_fraction: float = 0.25  # long-short
    long_len: tuple[int, int] = (1200, 1800)
    path: str | None = None  # json
    seed: int = 0
    token_range: tuple[int, int] = (3, 32000)  # ids drawn from [low, high): skips BOS/EOS/pad of small vocabularies
    text: bool = False  # prompts as text of random words instead of token ids
    temperature: float = 0.0  # 0: greedy; OpenAI clients send 1.0 unless told otherwise
    top_p: float = 1.0

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "json" and not self.path:
            raise ValueError("workload: json needs a file (--workload-file)")
        if self.num_requests < 1:
            raise ValueError(f"num_requests: must be >= 1, got {self.num_requests}")
        for name in ("prompt_len", "output_len", "long_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name}: need 1 <= low <= high, got {lo}-{hi}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction: must be in [0, 1], got {self.long_fraction}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len: must be >= 0, got {self.prefix_len}")
        if self.num_groups < 1:
            raise ValueError(f"num_groups: must be >= 1, got {self.num_groups}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ValueError(f"token_range: need 0 <= low < high, got {lo}-{hi}")


class Workload:
    """The requests of each round: `workload.round(k)`. Build with `Workload.load(spec)`."""

    def __init__(
        self,
        spec: WorkloadSpec,
        lengths: list[tuple[int, int]],
        prompts0: list | None = None,
        info=None,
        groups: list[int] | None = None,
    ):
        self.spec = spec
        self.lengths = lengths  # (prompt_len, output_len) per request; prompt_len excludes a shared prefix
        self._prompts0 = prompts0  # a JSON file's own prompts, sent in round 0
        self.info = info or {}  # a JSON file's other fields (description, model, ...)
        self.groups = groups  # shared-prefix, prefix-groups: each request's prefix (None: no prefix)

    @classmethod
    def load(cls, spec: WorkloadSpec) -> Workload:
        spec.validate()
        if spec.kind == "json":
            return cls._from_file(spec)
        rng = np.random.default_rng(spec.seed)
        n = spec.num_requests
        plen = rng.integers(spec.prompt_len[0], spec.prompt_len[1], n, endpoint=True)
        olen = rng.integers(spec.output_len[0], spec.output_len[1], n, endpoint=True)
        if spec.kind == "long-short":
            n_long = round(spec.long_fraction * n)
            is_long = np.zeros(n, bool)
            is_long[rng.choice(n, n_long, replace=False)] = True  # spread through the arrival order
            plen = np.where(is_long, rng.integers(spec.long_len[0], spec.long_len[1], n, endpoint=True), plen)
        groups = None
        if spec.kind == "shared-prefix":  # one prefix: a single group
            groups = [0] * n
        elif spec.kind == "prefix-groups":  # every group about equally often, interleaved at random
            groups = [int(g) for g in rng.permutation(np.arange(n) % spec.num_groups)]
        return cls(spec, [(int(p), int(o)) for p, o in zip(plen, olen)], groups=groups)

    @property
    def num_prefixes(self) -> int:
        """How many prefixes a round draws: one per group (0 without a prefix)."""
        if self.groups is None:
            return 0
        return self.spec.num_groups if self.spec.kind == "prefix-groups" else 1

    @classmethod
    def _from_file(cls, spec: WorkloadSpec) -> Workload:
        try:
            data = json.loads(Path(spec.path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"workload_file: cannot read {spec.path}: {e}") from None
        reqs = data.get("requests") if isinstance(data, dict) else None
        if not isinstance(reqs, list) or not reqs:
            raise ValueError("requests: the workload file needs a non-empty list 'requests'")
        prompts, lengths = [], []
        for i, r in enumerate(reqs):
            if not isinstance(r, dict):
                raise ValueError(f"requests[{i}]: must be an object")
            out = r.get("output_len")
            if not isinstance(out, int) or isinstance(out, bool) or out < 1:
                raise ValueError(f"requests[{i}].output_len: must be a positive integer, got {out!r}")
            if "prompt_ids" in r:
                ids = r["prompt_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(x, int) and x >= 0 for x in ids):
                    raise ValueError(f"requests[{i}].prompt_ids: must be a non-empty list of token ids")
                prompts.append(list(ids))
            elif isinstance(r.get("prompt"), str) and r["prompt"]:
                prompts.append(r["prompt"])
            else:
                raise ValueError(f"requests[{i}].prompt_ids: each request needs prompt_ids or a non-empty prompt")
            lengths.append((Request(prompts[-1], out).prompt_len, out))
        vocab = data.get("vocab_size")
        if vocab is not None and (not isinstance(vocab, int) or vocab <= spec.token_range[0]):
            raise ValueError(f"vocab_size: must be an integer > {spec.token_range[0]}, got {vocab!r}")
        if vocab is not None:
            spec = dataclasses.replace(spec, token_range=(spec.token_range[0], vocab))
        info = {k: v for k, v in data.items() if k != "requests"}
        return cls(dataclasses.replace(spec, num_requests=len(reqs)), lengths, prompts, info)

    def round(self, k: int) -> list[Request]:
        """The requests of round k: the same lengths every round, fresh token ids each round."""
        spec = self.spec
        how = dict(temperature=spec.temperature, top_p=spec.top_p)
        if self._prompts0 is not None and k == 0:
            return [Request(p, o, **how) for p, (_, o) in zip(self._prompts0, self.lengths)]
        rng = np.random.default_rng([spec.seed, k + 1])
        prefixes = [self._draw(rng, spec.prefix_len) for _ in range(self.num_prefixes)]
        out = []
        for i, (p, o) in enumerate(self.lengths):
            if self._prompts0 is not None and isinstance(self._prompts0[i], str):
                out.append(Request(f"{k} {self._prompts0[i]}", o, **how))
            else:
                ids = (prefixes[self.groups[i]] if self.groups else []) + self._draw(rng, p)
                out.append(Request(" ".join(ids) if spec.text else ids, o, **how))
        return out

    def _draw(self, rng: np.random.Generator, n: int) -> list:
        """n random token ids, or n random words when spec.text."""
        if self.spec.text:
            return [WORDS[j] for j in rng.integers(0, len(WORDS), n)]
        lo, hi = self.spec.token_range
        return [int(x) for x in rng.integers(lo, hi, n)]

    def describe(self) -> dict:
        """The workload as the result JSON records it."""
        d = {k: v for k, v in dataclasses.asdict(self.spec).items() if v is not None}
        if self.groups is None:
            d.pop("prefix_len")
        if self.spec.kind != "prefix-groups":
            d.pop("num_groups")
        if self.spec.kind != "long-short":
            d.pop("long_fraction"), d.pop("long_len")
        if self.spec.kind == "json":  # the file's lengths, not the flags'
            d.pop("prompt_len"), d.pop("output_len")
        d["total_prompt_tokens"] = sum(p for p, _ in self.lengths) + (
            self.spec.prefix_len * len(self.lengths) if self.groups is not None else 0
        )
        d["total_output_tokens"] = sum(o for _, o in self.lengths)
        if self.info.get("description"):
            d["description"] = self.info["description"]
        return d


def model_from_spec(spec: dict, out: Path) -> Path:
    """Save the random Llama a workload file's `model` field describes (transformers'
    LlamaForCausalLM after torch.manual_seed(0), float32) to `out`: the model of mixed-64.json,
    the 56.4M Llama of docs/benchmarks.md's figures. Needs torch (the `test` extra)."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise ValueError(f"model: building the workload's random model needs torch ({e})") from None
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=spec["hidden_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        intermediate_size=spec["intermediate_size"],
        vocab_size=spec["vocab_size"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=spec["tie_word_embeddings"],
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    LlamaForCausalLM(cfg).eval().save_pretrained(out)
    return out
