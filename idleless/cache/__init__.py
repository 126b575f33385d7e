"""idleless.cache: the KV pool and the prefix caches behind one interface (``base.PrefixCache``)."""

from __future__ import annotations


def make_prefix_cache(config, pool):
    """The prefix cache ``config`` asks for over ``pool``: the radix tree, or ``NoPrefixCache`` with
    ``disable_radix_cache``. Raises ValueError for an unknown eviction policy."""
    from idleless.cache.radix_cache import NoPrefixCache, RadixCache
    if config.disable_radix_cache:
        return NoPrefixCache(pool, config.page_size)
    return RadixCache(pool, config.page_size, config.radix_eviction_policy, config.max_pinned_tokens)
