"""A token-level index of what one engine's prefix cache holds, rebuilt from its KV events.

The engine's radix tree reports two kinds of change (``idleless.router.events``): *stored* — the
tree now holds ``tokens`` (its first ``start`` tokens were held already) — and *removed* — the tree
no longer holds ``tokens[start:]`` (a leaf was evicted; ``tokens[:start]`` stay), plus *cleared*.
``TokenIndex`` is a radix tree over token ids that applies those changes and answers the longest
held prefix of a prompt, so a router knows to the token how much of a prompt each engine has cached.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence


class _Node:
    __slots__ = ("key", "children", "parent")

    def __init__(self, key: tuple, parent: Optional["_Node"]):
        self.key = key  # token ids of the edge into this node
        self.children: dict[int, _Node] = {}  # first token of the child's key -> child
        self.parent = parent


class TokenIndex:
    """A radix tree of held token sequences (compressed edges, keyed by their first token).

    ``num_tokens`` is the number of distinct held positions (the engine's cached token count when
    the event stream is complete). All operations cost O(len(tokens)) plus dictionary look-ups."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        """Forget everything (the engine flushed its cache, or a snapshot replaces the index)."""
        self.root = _Node((), None)
        self.num_tokens = 0

    def _walk(self, tokens: Sequence[int]) -> tuple[_Node, int, int]:
        """Follow ``tokens`` from the root: (deepest node reached, tokens matched up to and including
        it, tokens of the next edge that also match, 0 when none)."""
        node, done, n = self.root, 0, len(tokens)
        while done < n:
            child = node.children.get(tokens[done])
            if child is None:
                return node, done, 0
            key = child.key
            if tuple(tokens[done:done + len(key)]) == key:  # the whole edge matches (compared in C)
                node, done = child, done + len(key)
                continue
            lo, hi = 1, min(len(key), n - done)  # the longest equal slice, by bisection (slices compare in C)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if tuple(tokens[done:done + mid]) == key[:mid]:
                    lo = mid
                else:
                    hi = mid - 1
            return child, done, lo
        return node, done, 0

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest held prefix of ``tokens`` (token ids), in tokens."""
        _, done, partial = self._walk(tokens)
        return done + partial

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node``'s edge after k tokens; returns the new upper node."""
        upper = _Node(node.key[:k], node.parent)
        node.parent.children[node.key[0]] = upper
        node.key = node.key[k:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def stored(self, tokens: Sequence[int], start: int = 0) -> None:
        """The engine now holds every prefix of ``tokens``. ``start`` (the tokens it held before)
        is not needed to apply the change and is accepted for symmetry with ``removed``."""
        node, done, partial = self._walk(tokens)
        if done + partial >= len(tokens):
            return
        if partial:
            node = self._split(node, partial)
            done += partial
        if done < len(tokens):
            rest = tuple(tokens[done:])
            node.children[rest[0]] = _Node(rest, node)
            self.num_tokens += len(rest)

    def removed(self, tokens: Sequence[int], start: int) -> None:
        """The engine no longer holds ``tokens[start:]`` (nor anything extending it); it still holds
        ``tokens[:start]``. Parts the index does not hold are ignored."""
        start = max(0, start)
        node, done, partial = self._walk(tokens[:start])
        if partial:  # start falls inside an edge: cut the edge there
            node = self._split(node, partial)
            done += partial
        if done < start or start >= len(tokens):
            return
        child = node.children.pop(tokens[start], None)
        if child is not None:
            self.num_tokens -= self._size(child)
            self._merge(node)

    def _size(self, node: _Node) -> int:
        total, stack = 0, [node]
        while stack:
            n = stack.pop()
            total += len(n.key)
            stack.extend(n.children.values())
        return total

    def _merge(self, node: _Node) -> None:
        """Re-join ``node`` with its only child (keeps edges maximal after a removal)."""
        if node is self.root or len(node.children) != 1:
            return
        (child,) = node.children.values()
        child.key = node.key + child.key
        child.parent = node.parent
        node.parent.children[child.key[0]] = child

    def paths(self) -> Iterator[list[int]]:
        """Every held sequence that no other held sequence extends (the leaves' full token paths):
        storing each of them into an empty index rebuilds this one (a snapshot)."""
        stack = [(self.root, ())]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key
            if not node.children and node is not self.root:
                yield list(path)
            stack.extend((c, path) for c in node.children.values())
