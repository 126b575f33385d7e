"""idleless.router: a cache-aware router in front of engine replicas (a separate process, no model).

``index`` (a token-level index of one engine's prefix cache), ``events`` (the engines' KV events over
ZMQ and the subscriber's bookkeeping), ``policies`` (round_robin, power_of_two, cache_aware_approx,
exact), ``workers`` (the worker pool, health checks, load), ``app`` (the HTTP proxy) and ``launch``
(``idleless router``).
"""
