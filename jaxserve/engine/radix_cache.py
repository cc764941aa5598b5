"""Prefix caching: a radix tree over token ids whose nodes own KV pages. Plain Python.

Like SGLang's RadixAttention, at page granularity: a node holds a run of whole pages and
their tokens; children are keyed by their first page of tokens. The tree holds one
reference on every page it owns (the allocator's counts), requests hold their own, so a
page returns to the pool only when neither the tree nor any request uses it.

- match: the longest cached prefix. It may end inside a page: that page is shared too, and
  the scheduler copies it on write before the request writes its own tokens into it.
- insert: after a prefill, and again when a request finishes, so the next turn of a
  conversation reuses the answer too. Returns how many tokens were already cached; for
  those, the tree keeps its own pages and the request keeps (and later releases) its copy.
- lock: a running request pins its matched path; eviction takes least-recently-used
  unlocked leaves only, re-examining a parent that becomes a leaf.

A model with sliding-window layers (a "local" page pool, see kv_manager) has a local page
beside every full one of a node (the dummy page where the request that inserted it had
already freed it). A match then ends where the local pages of the window before its end are
all present: a request resumes there, and its first query needs the keys of the W - 1
positions before it. Local pages are cheap to drop: `evict_local` releases the least recently
used nodes' local pages alone (their full pages stay, and hits there shorten) when the small
local pool runs dry.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence as Seq

from jaxserve.engine.allocator import DUMMY_PAGE, PageAllocator


@dataclasses.dataclass(eq=False)
class Node:
    tokens: tuple[int, ...] = ()
    pages: list[int] = dataclasses.field(default_factory=list)
    parent: "Node | None" = None
    children: dict[tuple[int, ...], "Node"] = dataclasses.field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    local_pages: list[int] = dataclasses.field(default_factory=list)  # beside `pages`, with a local pool


@dataclasses.dataclass
class Match:
    pages: list[int]  # shared (a reference taken on each) for the request's block table
    num_tokens: int  # cached tokens, possibly ending inside the last page
    node: Node  # deepest node used: locked until release
    local_pages: list[int] = dataclasses.field(default_factory=list)  # beside `pages`; dummy ones not shared


class RadixCache:
    def __init__(self, allocator: PageAllocator, local: PageAllocator | None = None, window: int | None = None):
        """local, window: the sliding layers' page pool and their window (None: no such layers)."""
        self.alloc = allocator
        self.local = local
        self.window = window
        self.ps = allocator.page_size
        self.root = Node()
        self._clock = itertools.count(1)
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.num_cached_pages = 0

    # -- lookup ------------------------------------------------------------------------
    def _key(self, tokens: Seq[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i : i + self.ps])

    def match(self, tokens: Seq[int]) -> Match:
        """Longest cached prefix of `tokens` (with a local pool: whose window of local pages is
        all present); shares its pages and locks its path."""
        node, pos, pages, path = self.root, 0, [], []
        now = next(self._clock)
        while True:
            node.last_access = now
            child = node.children.get(self._key(tokens, pos)) if len(tokens) - pos >= self.ps else None
            if child is None:
                break
            k = 0  # whole pages of child that match
            while (
                k < len(child.pages)
                and tuple(tokens[pos + k * self.ps : pos + (k + 1) * self.ps])
                == child.tokens[k * self.ps : (k + 1) * self.ps]
            ):
                k += 1
            if k < len(child.pages):
                child = self._split(child, k)
            pages += child.pages
            path.append(child)
            pos += k * self.ps
            node = child
        # A partial page: the longest common prefix with any child's first page.
        best, best_child = 0, None
        rest = tokens[pos : pos + self.ps]
        for key, child in node.children.items():
            n = 0
            while n < len(rest) and n < self.ps and key[n] == rest[n]:
                n += 1
            if n > best:
                best, best_child = n, child
        if best_child is not None:
            best_child = self._split(best_child, 1) if len(best_child.pages) > 1 else best_child
            best_child.last_access = now
            pages.append(best_child.pages[0])
            path.append(best_child)
            node = best_child
            pos += best
        local = [p for n in path for p in n.local_pages] if self.local is not None else []
        if self.local is not None and not self._window_present(local, pos):
            node, pos = self._truncate(path, local, pos)
            pages, local = pages[: pos // self.ps], local[: pos // self.ps]
        for p in pages:
            self.alloc.share(p)
        for p in local:
            if p != DUMMY_PAGE:
                self.local.share(p)
        self._lock(node, +1)
        return Match(pages, pos, node, local)

    def _window_present(self, local: list[int], end: int) -> bool:
        """The local pages a request resuming at `end` reads (positions end - W + 1 .. end - 1)
        are all present."""
        if end == 0:
            return True
        lo = max(0, end - self.window + 1) // self.ps
        return all(p != DUMMY_PAGE for p in local[lo : (end - 1) // self.ps + 1])

    def _truncate(self, path: list[Node], local: list[int], pos: int) -> tuple[Node, int]:
        """The longest page-aligned match shorter than pos whose window is present: (its deepest
        node, split to end there, or the root; its length)."""
        j = pos // self.ps if pos % self.ps else pos // self.ps - 1
        while j > 0 and not self._window_present(local, j * self.ps):
            j -= 1
        if j == 0:
            return self.root, 0
        start = 0
        for n in path:
            if start + len(n.pages) >= j:
                return (self._split(n, j - start) if start + len(n.pages) > j else n), j * self.ps
            start += len(n.pages)
        raise AssertionError("a truncated match past its path")

    def record(self, queried: int, hit: int) -> None:
        """Hit-rate accounting, once per admitted request (not per admission attempt)."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def _split(self, node: Node, k: int) -> Node:
        """Split node after k pages; returns the new upper node (holding the first k pages)."""
        upper = Node(node.tokens[: k * self.ps], node.pages[:k], node.parent, {}, node.lock_ref, node.last_access)
        upper.local_pages, node.local_pages = node.local_pages[:k], node.local_pages[k:]
        node.parent.children[upper.tokens[: self.ps]] = upper
        node.tokens, node.pages, node.parent = node.tokens[k * self.ps :], node.pages[k:], upper
        upper.children[node.tokens[: self.ps]] = node
        return upper

    def _lock(self, node: Node, delta: int) -> None:
        while node is not None and node is not self.root:
            node.lock_ref += delta
            assert node.lock_ref >= 0
            node = node.parent

    def release_match(self, m: Match) -> None:
        """Undo a match that was not used (admission failed)."""
        self._lock(m.node, -1)
        for p in m.pages:
            self.alloc.release(p)
        for p in m.local_pages:
            if p != DUMMY_PAGE:
                self.local.release(p)

    def unlock(self, node: Node) -> None:
        self._lock(node, -1)

    # -- insert ------------------------------------------------------------------------
    def insert(self, tokens: Seq[int], pages: Seq[int], local_pages: Seq[int] = ()) -> int:
        """Cache the whole pages of tokens (len(pages) * ps tokens at most), with their local
        pages (a local pool: the dummy page where freed). Returns how many tokens were cached
        already (their pages stay the request's own; a local page the tree had lost is taken)."""
        n_pages = min(len(tokens) // self.ps, len(pages))
        if self.local is not None:
            local_pages = list(local_pages[:n_pages]) + [DUMMY_PAGE] * (n_pages - len(local_pages))
        node, pos, i = self.root, 0, 0
        now = next(self._clock)
        while i < n_pages:
            node.last_access = now
            key = self._key(tokens, pos)
            child = node.children.get(key)
            if child is None:
                new = Node(tuple(tokens[pos : n_pages * self.ps]), list(pages[i:n_pages]), node, {}, 0, now)
                for p in new.pages:
                    self.alloc.share(p)
                if self.local is not None:
                    new.local_pages = list(local_pages[i:n_pages])
                    for p in new.local_pages:
                        if p != DUMMY_PAGE:
                            self.local.share(p)
                self.num_cached_pages += len(new.pages)
                node.children[key] = new
                return pos
            k = 0
            while (
                k < len(child.pages)
                and i + k < n_pages
                and tuple(tokens[pos + k * self.ps : pos + (k + 1) * self.ps])
                == child.tokens[k * self.ps : (k + 1) * self.ps]
            ):
                k += 1
            if k < len(child.pages):
                child = self._split(child, k)
            if self.local is not None:
                self._take_local(child, local_pages[i : i + k])
            node, pos, i = child, pos + k * self.ps, i + k
        node.last_access = now
        return pos

    def _take_local(self, node: Node, local_pages: Seq[int]) -> None:
        """The request's local pages where the node had lost its own (same tokens, same KV)."""
        for x, p in enumerate(local_pages):
            if node.local_pages[x] == DUMMY_PAGE and p != DUMMY_PAGE:
                self.local.share(p)
                node.local_pages[x] = p

    # -- eviction ----------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Drop least-recently-used unlocked leaves until num_pages pages came back to the
        pool (or nothing evictable is left). Returns the pages actually freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.tokens[: self.ps]]
            for p in node.pages:
                self.alloc.release(p)
                if self.alloc.refcount[p] == 0:
                    freed += 1
            self._drop_local(node, len(node.local_pages))
            self.num_cached_pages -= len(node.pages)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def evict_local(self, num_pages: int) -> int:
        """Release the tree's local pages, least recently used nodes first (each node's from its
        first page: the last are what a match ending there reads), until num_pages came back to
        the local pool. The nodes and their full pages stay. Returns the pages freed."""
        freed = 0
        nodes = sorted(
            (n for n in self._nodes() if any(p != DUMMY_PAGE for p in n.local_pages)), key=lambda n: n.last_access
        )
        for node in nodes:
            for x in range(len(node.local_pages)):
                if freed >= num_pages:
                    return freed
                freed += self._drop_local(node, x + 1, start=x)
        return freed

    def _drop_local(self, node: Node, end: int, start: int = 0) -> int:
        """Release node's local pages [start, end) (dummy in their place); returns those freed."""
        freed = 0
        for x in range(start, end):
            p = node.local_pages[x]
            if p != DUMMY_PAGE:
                node.local_pages[x] = DUMMY_PAGE
                self.local.release(p)
                freed += self.local.refcount[p] == 0
        return freed

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root:
                yield n

    def flush(self) -> int:
        """Evict everything unlocked (every page, once no request runs)."""
        return self.evict(self.alloc.num_pages)

    def _leaves(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                yield n

    def pages(self) -> list[int]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out += n.pages
            stack.extend(n.children.values())
        return out

    def local_page_ids(self) -> list[int]:
        """The local pages the tree holds (one reference each)."""
        return [p for n in self._nodes() for p in n.local_pages if p != DUMMY_PAGE]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
