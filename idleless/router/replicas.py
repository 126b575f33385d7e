"""``idleless serve --dp N``: N engine replicas on this machine behind one router.

Each replica is a whole ``idleless serve`` (frontend + engine core) in a process of its own, on
127.0.0.1 and a free port, with ``--kv-events-config`` on two more free ports and its share of the
cores as torch threads (``(cores - 1) // N``, at least 1: one core is left for the frontends and the
router). The router runs in this process on ``--host``/``--port`` with ``--router-policy`` and the
server's ``--api-key`` (the replicas themselves are open, on the loopback only). The router starts
listening once every replica answers /health; SIGTERM/SIGINT stop the router, then the replicas
(each drains as a lone server would).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import logging
import multiprocessing
import os
import signal
import socket
import time

import httpx

log = logging.getLogger("idleless.router")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (free when asked: a later bind can still race)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def replica_args(args: argparse.Namespace, dp: int, port: int, pub_port: int, replay_port: int) -> argparse.Namespace:
    """The flags of one replica: the server's, on 127.0.0.1:``port``, open, one replica, its thread
    share, KV events on ``pub_port`` / ``replay_port``."""
    r = copy.copy(args)
    r.host, r.port, r.api_key, r.dp = "127.0.0.1", port, None, 1
    if not args.num_threads:
        from idleless.server.launch import usable_cores
        r.num_threads = max(1, usable_cores() // dp)  # the serve rule (launch.engine_threads) split over replicas
    r.kv_events_config = json.dumps({"endpoint": f"tcp://127.0.0.1:{pub_port}",
                                     "replay_endpoint": f"tcp://127.0.0.1:{replay_port}"})
    return r


def _replica_main(args: argparse.Namespace) -> None:
    from idleless.server import launch
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the parent drives the stop
    logging.basicConfig(level=str(args.log_level).upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[replica :{args.port}]: %(message)s")
    launch.exit_process(launch.main(args) or 0)


def wait_all_healthy(urls: list[str], exit_codes, timeout_s: float, poll_s: float = 0.2,
                     where: str = "") -> None:
    """Poll every replica's /health until all answer 200. ``exit_codes()``: per url, the exit code of a
    replica that is gone, else None. Raises RuntimeError (naming ``where`` its log is) when one exits
    or ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    pending = set(urls)
    while pending:
        for u, code in zip(urls, exit_codes()):
            if code is not None:
                raise RuntimeError(f"replica {u} exited with code {code} while starting{where}")
        for u in list(pending):
            try:
                if httpx.get(u + "/health", timeout=2.0).status_code == 200:
                    pending.discard(u)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas not ready after {timeout_s:.0f} s: {sorted(pending)}")
        time.sleep(poll_s)


def wait_ready(procs: list, urls: list[str], timeout_s: float) -> None:
    """``wait_all_healthy`` for local replica processes."""
    wait_all_healthy(urls, lambda: [None if p.is_alive() else p.exitcode for p in procs], timeout_s)


def start_replicas(args: argparse.Namespace, dp: int) -> tuple[list, list[str]]:
    """Spawn ``dp`` replicas of the server ``args`` describes; returns (processes, base URLs). They
    are not ready yet: see ``wait_ready``."""
    ports = free_ports(3 * dp)
    ctx = multiprocessing.get_context("spawn")
    procs, urls = [], []
    for i in range(dp):
        ra = replica_args(args, dp, *ports[3 * i: 3 * i + 3])
        p = ctx.Process(target=_replica_main, args=(ra,), name=f"idleless-replica-{i}")
        p.start()
        procs.append(p)
        urls.append(f"http://127.0.0.1:{ra.port}")
    return procs, urls


def stop_replicas(procs: list, grace_s: float) -> None:
    """SIGTERM every replica (each drains for up to its --shutdown-grace), SIGKILL what is left after
    ``grace_s`` + 10 s."""
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s + 10
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def serve_replicas(args: argparse.Namespace, ready_timeout_s: float = 900.0) -> int:
    """Start ``args.dp`` replicas and the router; returns the exit code (1 if a replica failed). A
    SIGINT before the router listens stops the replicas and returns 0, even when the interrupt was
    swallowed inside a blocking call of the start-up."""
    from idleless.router import launch as router_launch

    dp = args.dp
    start, ready, stop = start_replicas, wait_ready, stop_replicas
    on_ray = bool(getattr(args, "ray_address", None))
    if on_ray:  # Ray actors across the cluster's nodes, keeping --api-key (idleless.router.ray_replicas)
        from idleless.router import ray_replicas
        start, ready, stop = ray_replicas.start_replicas, ray_replicas.wait_ready, ray_replicas.stop_replicas
    # Ctrl-C while the replicas start: a KeyboardInterrupt raised inside a library's blocking call can be
    # swallowed there (Ray's ray.get polls signals and may turn it into a return), so the handler also
    # leaves a mark, and the launch stops at the next check instead of starting the router.
    interrupted = []

    def on_interrupt(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_interrupt)
    procs, urls = start(args, dp)
    code = 0
    try:
        if not interrupted:
            ready(procs, urls, ready_timeout_s)
        if interrupted:
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, previous)  # from here the router's own handlers drain and return
        log.info("%d replicas ready (%d threads each): %s", dp,
                 procs.threads if on_ray else replica_args(args, dp, 0, 0, 0).num_threads, " ".join(urls))
        parser = argparse.ArgumentParser()
        router_launch.add_args(parser)
        rargs = parser.parse_args(["--worker-urls", *urls, "--host", args.host, "--port", str(args.port),
                                   "--policy", args.router_policy, "--log-level", str(args.log_level)])
        rargs.api_key = args.api_key
        if on_ray:
            rargs.worker_api_key = args.api_key
        if args.chat_template:
            rargs.chat_template = args.chat_template
        asyncio.run(router_launch.serve(rargs))
    except RuntimeError as e:
        if interrupted:  # the start-up failed because it was interrupted: the stop the user asked for
            log.info("stopping on Ctrl-C (%s)", e)
        else:
            log.error("%s", e)
            code = 1
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, previous)
        try:
            stop(procs, args.shutdown_grace)
        except RuntimeError as e:  # a replica that had to be force-stopped (ray_replicas.stop_replicas)
            log.error("%s", e)
            code = 1
    return code
