"""``idleless router``: the cache-aware router, a process of its own that never loads a model.

    idleless router --worker-urls http://127.0.0.1:30001 http://127.0.0.1:30002 --port 30080
    idleless router --worker-urls ... --policy round_robin|power_of_two|cache_aware_approx|exact

Workers are ``idleless serve`` processes (any OpenAI-compatible server for the load-only policies);
the default ``exact`` policy follows each worker's KV events (``--kv-events-config`` on the workers:
the router finds the endpoints in their ``/get_server_info``) and tokenizes requests with the
workers' tokenizer (``--tokenizer``, default: the first worker's ``tokenizer_path``).
Several routers may run side by side: each subscribes to every engine, no broker.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Optional

import httpx

from idleless.router.app import Router, RouterSettings, build_app
from idleless.router.policies import POLICIES, make_policy
from idleless.router.prompts import PromptTokenizer
from idleless.router.workers import WorkerPool

log = logging.getLogger("idleless.router")


def add_args(p: argparse.ArgumentParser) -> None:
    """The router's flags (SGLang router names where it has them)."""
    p.add_argument("--worker-urls", nargs="*", default=[], help="engine base URLs, e.g. http://127.0.0.1:30001")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30080, help="port to listen on (default 30080)")
    p.add_argument("--policy", choices=POLICIES, default="exact", help="routing policy (default: exact)")
    p.add_argument("--api-key", default=os.environ.get("IDLELESS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $IDLELESS_API_KEY)")
    p.add_argument("--worker-api-key", default=None, help="the workers' API key, sent on every call to them")
    p.add_argument("--tokenizer", default=None, help="exact: the workers' tokenizer (default: the first worker's)")
    p.add_argument("--chat-template", default=None, help="exact: the workers' --chat-template, if they have one")
    p.add_argument("--health-check-interval-secs", type=float, default=5.0, help="seconds between health checks")
    p.add_argument("--health-check-timeout-secs", type=float, default=10.0,
                   help="seconds a health check waits (default 10; a worker still streaming is never failed by a "
                        "slow check)")
    p.add_argument("--dead-after-secs", type=float, default=60.0,
                   help="an unhealthy worker silent this long (no answer byte, no KV-event heartbeat) is dead: its "
                        "requests in flight end with an error (a refused connection: at once; default 60)")
    p.add_argument("--health-failure-threshold", type=int, default=3,
                   help="failed checks in a row that mark a worker unhealthy (default 3)")
    p.add_argument("--max-attempts", type=int, default=3, help="workers tried for a request that did not start")
    p.add_argument("--cache-threshold", type=float, default=0.3, help="cache_aware_approx: match share to follow")
    p.add_argument("--balance-abs-threshold", type=int, default=64, help="cache_aware_approx: load gap (requests)")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5, help="cache_aware_approx: load ratio")
    p.add_argument("--max-tree-size", type=int, default=1 << 26, help="cache_aware_approx: characters per worker")
    p.add_argument("--exact-running-cost", type=float, default=8.0,
                   help="exact: prefill tokens one request in flight is worth (default 8)")
    p.add_argument("--exact-spread", type=float, default=0.1,
                   help="exact: cached-prefix credit decay per request of load above the least loaded (default 0.1)")
    p.add_argument("--track-cache-hits", action="store_true",
                   help="tokenize and follow KV events whatever the policy, to count each policy's hits against "
                        "the oracle's (idleless_router_oracle_hit_tokens_total); the bench turns it on")
    g = p.add_argument_group("prefill/decode disaggregation (idleless.router.pd)")
    g.add_argument("--pd-disaggregation", action="store_true",
                   help="chain a prefill engine (--prefill) and a decode engine (--decode) per request")
    g.add_argument("--prefill", nargs="*", default=[], help="prefill engines' base URLs (--policy picks)")
    g.add_argument("--decode", nargs="*", default=[], help="decode engines' base URLs (--decode-policy picks)")
    g.add_argument("--decode-policy", choices=POLICIES, default="power_of_two",
                   help="how a decode engine is picked (default power_of_two: by load)")
    g.add_argument("--prefill-timeout-secs", type=float, default=60.0,
                   help="seconds the prefill leg may take before the decode engine prefills itself")
    g.add_argument("--pd-layerwise", action="store_true",
                   help="start both legs at once: the decode engine receives the KV layer by layer while the "
                        "prefill engine computes it (default: after the prefill leg's answer, in one message)")
    p.add_argument("--log-level", default="info", help="debug | info | warning | error")


def policy_from_args(args: argparse.Namespace):
    kw = {}
    if args.policy == "cache_aware_approx":
        kw = dict(cache_threshold=args.cache_threshold, balance_abs_threshold=args.balance_abs_threshold,
                  balance_rel_threshold=args.balance_rel_threshold, max_tree_size=args.max_tree_size)
    elif args.policy == "exact":
        kw = dict(running_cost=args.exact_running_cost, spread=args.exact_spread)
    return make_policy(args.policy, **kw)


async def _tokenizer(args, pool: WorkerPool) -> Optional[PromptTokenizer]:
    from idleless.text.tokenizer import Tokenizer, load_chat_template
    path = args.tokenizer
    for w in pool.healthy():
        if path:
            break
        try:
            r = await pool.client.get(w.url + "/get_model_info", headers=pool.headers)
            path = r.json().get("tokenizer_path")
        except (httpx.HTTPError, ValueError):
            continue
    if not path:
        log.warning("exact policy without a tokenizer (no --tokenizer, no worker answered): prefixes are "
                    "matched only among requests in flight")
        return None
    tok = await asyncio.to_thread(Tokenizer.load, path)
    if args.chat_template:
        tok.set_chat_template(load_chat_template(args.chat_template))
    return PromptTokenizer(tok)


async def build_router(args: argparse.Namespace) -> Router:
    """The Router for ``args``: workers added (and checked), health loop started, tokenizer loaded."""
    headers = {"authorization": f"Bearer {args.worker_api_key}"} if args.worker_api_key else {}
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
    pool = WorkerPool(client, health_interval_s=args.health_check_interval_secs,
                      health_timeout_s=args.health_check_timeout_secs, dead_after_s=args.dead_after_secs,
                      failure_threshold=args.health_failure_threshold, headers=headers,
                      use_kv_events=args.policy == "exact" or args.track_cache_hits)
    for url in args.worker_urls:
        await pool.add(url)
    pool.start()
    policy = policy_from_args(args)
    tokenizer = await _tokenizer(args, pool) if policy.needs_tokens or args.track_cache_hits else None
    settings = RouterSettings(api_key=args.api_key, worker_headers=headers, max_attempts=args.max_attempts,
                              track_cache_hits=args.track_cache_hits)
    return Router(pool, policy, settings, tokenizer)


async def serve(args: argparse.Namespace) -> int:
    import uvicorn

    if args.pd_disaggregation:
        return await _serve_pd(args)
    router = await build_router(args)
    app = build_app(router)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                                           lifespan="off", timeout_keep_alive=5))
    log.info("idleless router on http://%s:%d, policy %s, workers %s", args.host, args.port, router.policy.name,
             ", ".join(router.pool.workers) or "none yet")
    try:
        await server.serve()
    finally:
        await router.pool.stop()
        await router.pool.client.aclose()
    return 0


async def _serve_pd(args: argparse.Namespace) -> int:
    import uvicorn

    from idleless.router.pd import build_pd_app, build_pd_router
    try:
        pd = await build_pd_router(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    server = uvicorn.Server(uvicorn.Config(build_pd_app(pd), host=args.host, port=args.port, log_config=None,
                                           access_log=False, lifespan="off", timeout_keep_alive=5))
    log.info("idleless PD router on http://%s:%d: prefill %s (%s), decode %s (%s)", args.host, args.port,
             " ".join(args.prefill), pd.prefill.policy.name, " ".join(args.decode), pd.decode.policy.name)
    try:
        await server.serve()
    finally:
        await pd.close()
    return 0


def main(args: argparse.Namespace) -> int:
    """``idleless router`` entry point."""
    logging.getLogger("idleless.router").setLevel(str(args.log_level).upper())
    try:
        return asyncio.run(serve(args))
    except KeyboardInterrupt:
        return 0
