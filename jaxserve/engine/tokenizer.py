"""Text in and out: the checkpoint's tokenizer, and incremental detokenization with stop
strings that are never partly streamed.

Plain Python over a transformers tokenizer; no jax. The engine core runs it off the
frontends' event loops (in its own thread, or the frontends' worker threads for prompts).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import threading
import weakref
from pathlib import Path
from typing import Any, Collection

from jaxserve.engine.request import RequestOutput, Sequence, Status

log = logging.getLogger("jaxserve.tokenizer")

_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Path) -> Any | None:
    """The checkpoint's own tokenizer, or None: token-id prompts still work without one. A GGUF
    file's tokenizer and chat template come from its metadata, through transformers' GGUF
    tokenizer conversion (the reference for what llama.cpp's vocabulary means)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return _with_family_template(path, _gguf_tokenizer(path))
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    if (path / "tokenizer.json").is_file() and _tokenizer_class(path) in _GENERIC_TOKENIZERS:
        # The class AutoTokenizer would pick, without importing the auto machinery: that
        # imports every model config and, where torch is installed, torch (about 1.5 s a start).
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _with_family_template(path: Path, tok: Any) -> Any:
    """A GGUF without a chat template is chatted with its family's (`Family.chat_template`),
    as llama.cpp falls back to its built-in template of the architecture."""
    if getattr(tok, "chat_template", None):
        return tok
    from jaxserve.models import gguf, registry

    arch = gguf.hf_architecture(path)
    template = registry.family(arch).chat_template if arch else None
    if template:
        tok.chat_template = template
    return tok


def _gguf_tokenizer(path: Path) -> Any:
    """A GGUF's tokenizer, converted once (seconds: tens of thousands of tokens and merges) and
    saved as tokenizer.json beside the converted weights' cache, keyed by the file's fingerprint;
    a restart loads that in a fraction of a second."""
    import hashlib

    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from jaxserve.models import gguf
    from jaxserve.models.loader import default_cache_root, replace_dir

    h = hashlib.sha256(b"tokenizer:2")
    gguf.fingerprint_update(h, path)
    cache = default_cache_root().parent / "tokenizers" / f"{path.stem}-{h.hexdigest()[:16]}"
    if (cache / "tokenizer.json").is_file():
        try:
            return TokenizersBackend.from_pretrained(str(cache))
        except Exception as e:  # an unreadable cache is rebuilt, never used
            log.warning("tokenizer cache %s is unreadable (%s); converting again", cache, e)
    tok = _convert_gguf_tokenizer(path)
    try:
        replace_dir(cache, lambda tmp: tok.save_pretrained(str(tmp)))
    except OSError as e:  # a read-only home: convert every time
        log.warning("could not cache the GGUF tokenizer in %s (%s)", cache, e)
    return tok


def _convert_gguf_tokenizer(path: Path) -> Any:
    """What `AutoTokenizer.from_pretrained(dir, gguf_file=name)` builds (the reference: transformers'
    `get_gguf_tokenizer` + `convert_gguf_tokenizer`), with the metadata read by the `gguf` package
    instead of transformers' GGUF reader, which imports torch (a test-only dependency here). As
    that reader does, string arrays other than the vocabulary and the merges are given as counts."""
    from gguf import GGUFReader
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    reader = GGUFReader(str(path))
    full = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") or key == "general.architecture":
            value = field.contents()
            if isinstance(value, list) and value and isinstance(value[0], str) and key not in full:
                value = len(value)
            meta[key] = value
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # as transformers: sentencepiece files add BOS unless told
        config.setdefault("add_bos_token", True)
    elif tokenizer.get("tokenizer_type") == "gemma4":
        config["add_bos_token"] = False
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    fast, extra = convert_gguf_tokenizer(meta["general.architecture"], tokenizer)
    return TokenizersBackend(tokenizer_object=fast, **config, **extra)


def _tokenizer_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


class FastDecode:
    """A tokenizer's `decode(ids, skip_special_tokens=True)` straight through its Rust
    `tokenizers.Tokenizer` where that is all transformers would do (no clean-up of spaces): the
    engine decodes a window of every running sequence's ids each step, and transformers' Python
    around the same call costs three times the decode itself."""

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        plain = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend = backend if plain else None
        self._tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@dataclasses.dataclass
class IncrementalDetokenizer:
    """One request's text so far (vLLM's prefix/read offsets): decode a short window so each
    step costs O(1) tokens, hold back text that ends inside a UTF-8 character, and hold back
    the last len(longest stop) - 1 characters while they could still start a stop string.

    A request without stop strings needs no text to decide anything, so its outputs' text is
    deferred: decoded when a caller first reads `out.text` (in whichever thread reads it), in
    output order, never for an output no one reads (its text goes to the next one read). Only
    a request with stop strings is decoded on the engine thread, every step."""

    tokenizer: Any | None
    stop_token_ids: Collection[int]  # EOS and the request's stop tokens: never part of the text
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    # Output tokens through the one that completed a stop string (None: no stop string yet). A
    # speculative step can accept drafts past it; plain decoding would have stopped there.
    keep: int | None = None
    # Deferred outputs not read yet, oldest first: (the output, weakly; its sequence; how many
    # of its output ids make its text). Appended by the engine thread, taken by readers.
    _unread: collections.deque = dataclasses.field(default_factory=collections.deque)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def update(self, seq: Sequence) -> bool:
        """Decode the sequence's new tokens, if it has stop strings (the others' text is
        deferred to its readers). True when a stop string ended the text (the caller finishes
        the request with reason "stop")."""
        stops = seq.params.stop
        if self.tokenizer is None or not stops:
            return False
        ids = seq.output_ids
        if seq.finish_reason == "stop" and ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]  # the stop token itself is not text
        start = (self.prefix_offset, self.read_offset, len(self.text))
        self._take(ids)
        if seq.finish_reason != "abort":
            window_start = max(0, self.sent_text - max(map(len, stops)))
            hits = [(i, i + len(s)) for s in stops if (i := self.text.find(s, window_start)) >= 0]
            if hits:
                self.keep = self._tokens_through(ids, min(end for _, end in hits), *start)
                self.text = self.text[: min(i for i, _ in hits)]
                return True
        return False

    def _take(self, ids: list[int]) -> None:
        """Take output ids past read_offset into the text."""
        if self.read_offset < len(ids) and not self._advance(ids, len(ids)):
            # The new tokens end inside a character (or add no text yet): take them one at a
            # time, as a step of one token would, so the text never depends on how many tokens
            # a step brought (several decode steps a call, speculation, overlapped steps, a
            # deferred text read after several outputs).
            for end in range(self.read_offset + 1, len(ids)):
                self._advance(ids, end)

    def _advance(self, ids: list[int], end: int) -> bool:
        """Take ids[read_offset:end] into the text if they complete it (vLLM's prefix and read
        offsets: decode a short window, keep what it adds past the prefix's text)."""
        tok = self.tokenizer
        prefix = tok.decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        new = tok.decode(ids[self.prefix_offset : end], skip_special_tokens=True)
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            self.text += new[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, end
            return True
        return False

    def _tokens_through(self, ids: list[int], end: int, prefix: int, read: int, length: int) -> int:
        """How many of `ids` the text needs to reach `end` characters, given that ids[:read]
        made the first `length` (decoded from `prefix`, as update does): the token that
        completed the stop string and the ones before it."""
        base = len(self.tokenizer.decode(ids[prefix:read], skip_special_tokens=True))
        for j in range(read + 1, len(ids)):
            text = self.tokenizer.decode(ids[prefix:j], skip_special_tokens=True)
            if not text.endswith("\ufffd") and length + len(text) - base >= end:
                return j
        return len(ids)

    def delta(self, seq: Sequence) -> RequestOutput:
        """What the request produced since its last output (its text deferred, for a request
        without stop strings: `_read`)."""
        deferred = self.tokenizer is not None and not seq.params.stop
        finished = seq.status is Status.FINISHED
        ids = seq.output_ids
        n = len(ids) if self.keep is None else min(self.keep, len(ids))
        if deferred:
            text = ""
        else:
            hold = 0 if finished or not seq.params.stop else max(map(len, seq.params.stop)) - 1
            end = max(self.sent_text, len(self.text) - hold)
            text = self.text[self.sent_text : end]
            self.sent_text = end
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            token_ids=ids[self.sent_tokens : max(n, self.sent_tokens)],
            text=text,
            finish_reason=seq.finish_reason,
            logprobs=seq.logprobs[self.sent_logprobs : max(n, self.sent_logprobs)]
            if seq.params.logprobs is not None
            else None,
            num_cached_prompt_tokens=seq.num_cached_prompt_tokens,
        )
        self.sent_tokens = max(n, self.sent_tokens)
        self.sent_logprobs = max(min(n, len(seq.logprobs)), self.sent_logprobs)
        if deferred:
            stop_token = seq.finish_reason == "stop" and n and ids[n - 1] in self.stop_token_ids
            del out.__dict__["text"]  # RequestOutput.__getattr__ calls _read on the first read
            out.__dict__["_read_text"] = self._read
            self._unread.append((weakref.ref(out), seq, n - 1 if stop_token else n))
        return out

    def _read(self, out: RequestOutput) -> None:
        """Decode the text of `out` and of every unread output before it, in order (any thread:
        the engine thread only appends to `_unread`). An output no one holds any more is
        skipped: its text goes to the next one."""
        with self._lock:
            if "text" in out.__dict__:  # another thread read it first
                return
            while self._unread:
                ref, seq, n = self._unread.popleft()
                o = ref()
                if o is None:
                    continue
                self._take(seq.output_ids[:n])
                o.__dict__["text"] = self.text[self.sent_text :]
                o.__dict__.pop("_read_text", None)
                self.sent_text = len(self.text)
                if o is out:
                    return
            out.__dict__["text"] = ""  # not this detokenizer's (never happens): no text rather than a loop


def word_tokenizer(vocab: int, specials: bool = False) -> Any:
    """A tokenizer built in memory with a word for every id ("w0", "w1", ...; words split on
    spaces and joined with spaces): text for every token a random or fake model emits, with no
    checkpoint or hub behind it. specials: ids 0-2 are <s>, </s> and <unk> (BOS, EOS, unknown
    words) instead of w0-w2, and w0 stops being the unknown word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(vocab)}
    names = dict(unk_token="w0")
    if specials:
        words.update({"<s>": 0, "</s>": 1, "<unk>": 2})
        for i in range(3):
            del words[f"w{i}"]
        names = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok = Tokenizer(models.WordLevel(words, unk_token=names["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **names)
