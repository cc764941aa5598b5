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
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence as Seq

from jaxserve.engine.allocator import PageAllocator


@dataclasses.dataclass(eq=False)
class Node:
    tokens: tuple[int, ...] = ()
    pages: list[int] = dataclasses.field(default_factory=list)
    parent: "Node | None" = None
    children: dict[tuple[int, ...], "Node"] = dataclasses.field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


@dataclasses.dataclass
class Match:
    pages: list[int]  # shared (a reference taken on each) for the request's block table
    num_tokens: int  # cached tokens, possibly ending inside the last page
    node: Node  # deepest node used: locked until release


class RadixCache:
    def __init__(self, allocator: PageAllocator):
        self.alloc = allocator
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
        """Longest cached prefix of `tokens`; shares its pages and locks its path."""
        node, pos, pages = self.root, 0, []
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
            node = best_child
            pos += best
        for p in pages:
            self.alloc.share(p)
        self._lock(node, +1)
        return Match(pages, pos, node)

    def record(self, queried: int, hit: int) -> None:
        """Hit-rate accounting, once per admitted request (not per admission attempt)."""
        self.queried_tokens += queried
        self.hit_tokens += hit

    def _split(self, node: Node, k: int) -> Node:
        """Split node after k pages; returns the new upper node (holding the first k pages)."""
        upper = Node(node.tokens[: k * self.ps], node.pages[:k], node.parent, {}, node.lock_ref, node.last_access)
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

    def unlock(self, node: Node) -> None:
        self._lock(node, -1)

    # -- insert ------------------------------------------------------------------------
    def insert(self, tokens: Seq[int], pages: Seq[int]) -> int:
        """Cache the whole pages of tokens (len(pages) * ps tokens at most). Returns how many
        tokens were cached already (their pages stay the request's own)."""
        n_pages = min(len(tokens) // self.ps, len(pages))
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
            node, pos, i = child, pos + k * self.ps, i + k
        node.last_access = now
        return pos

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
            self.num_cached_pages -= len(node.pages)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

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

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
