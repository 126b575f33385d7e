"""``idleless serve --dp N --ray-address auto|HOST:PORT``: the N engine replicas as Ray actors.

The same replicas as ``idleless.router.replicas`` (each a whole ``idleless serve``: frontend + engine
core, KV events on two more ports), placed across a Ray cluster's nodes instead of this machine:
one Ray actor per replica, in a placement group of N bundles of ``{"CPU": threads}`` (``"GPU": 1``
more with ``--device cuda``) with the ``SPREAD`` strategy, so replicas land on different nodes while
there are nodes to spread over. Each actor starts its replica as a child process (``_child``) and
reports its URL: ``http://<the node's IP>:<free port>``, or ``http://127.0.0.1:<port>`` on the node
this process runs on. The router stays in this process, as with local replicas, and reaches the
replicas over HTTP and their KV-event ZMQ sockets at those addresses.

The replicas keep the server's ``--api-key`` (the router sends it to them): they may listen on a
network interface.
The model path, and ``idleless`` itself, must be present on every node (a shared filesystem, or the
same image on every node). Threads per replica: ``--num-threads`` if given, else the smallest node's
CPUs divided by the replicas that node gets (``ceil(N / nodes)``), at least 1.

Failures end the whole launch: a placement the cluster cannot satisfy, an actor that cannot start,
or a replica that exits while starting raises ``RuntimeError`` after every actor is stopped; the
caller's SIGTERM/Ctrl-C path calls ``stop_replicas``. Actors are owned by this process, so Ray ends
them if it dies, and a replica whose actor dies stops itself (it watches its parent process). A
replica that dies later is seen by the router's health checks, as with local replicas.

Ray is the optional extra ``idleless[ray]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from idleless.router.replicas import free_ports, replica_args, wait_all_healthy

log = logging.getLogger("idleless.router")

PLACEMENT_TIMEOUT_S = 120.0  # a placement group still pending after this: the cluster lacks the resources
ACTOR_START_TIMEOUT_S = 300.0  # an actor process (a Ray worker importing idleless) reporting its URL
CALL_TIMEOUT_S = 30.0  # one call to a live actor
STOP_MARGIN_S = 30.0  # stop_replicas: beyond the drain grace, for the actors' SIGKILL of a replica and Ray's calls
SHUTDOWN_TIMEOUT_S = 30.0  # stop_replicas: ray.shutdown() (disconnecting from the cluster)


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("--ray-address needs Ray, the optional extra: pip install 'idleless[ray]'") from e
    return ray


def _child() -> None:
    """A replica's process (started by ``ReplicaActor``): reads the pickled flags from stdin, stops
    itself (SIGTERM: a drain, as a lone server) when its parent, the actor, is gone, then runs
    ``idleless serve``."""
    from idleless.router.replicas import _replica_main

    args = pickle.load(sys.stdin.buffer)
    parent = os.getppid()

    def watch_parent():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    _replica_main(args)


class ReplicaActor:
    """One replica on a Ray node (the class is made a Ray actor by ``start_replicas``).

    ``args``: the server's flags (``--num-threads`` already set); ``driver_ip``: the IP of the node
    the router runs on, where the replica listens on 127.0.0.1 instead of the node's IP."""

    def __init__(self, args: argparse.Namespace, driver_ip: str):
        import ray

        node_ip = ray.util.get_node_ip_address()
        host = "127.0.0.1" if node_ip == driver_ip else node_ip
        port, pub_port, replay_port = free_ports(3)
        r = replica_args(args, 1, port, pub_port, replay_port)
        r.host, r.api_key = host, args.api_key
        r.kv_events_config = json.dumps({"endpoint": f"tcp://{host}:{pub_port}",
                                         "replay_endpoint": f"tcp://{host}:{replay_port}"})
        self.url = f"http://{host}:{r.port}"
        self.node_ip = node_ip
        self.proc = subprocess.Popen([sys.executable, "-c", "from idleless.router.ray_replicas import _child; _child()"],
                                     stdin=subprocess.PIPE)
        self.proc.stdin.write(pickle.dumps(r))
        self.proc.stdin.close()

    def info(self) -> tuple[str, str, int]:
        """(the replica's base URL, the node's IP, the replica's pid)."""
        return self.url, self.node_ip, self.proc.pid

    def exitcode(self):
        """The replica's exit code, or None while it runs."""
        return self.proc.poll()

    def stop(self, grace_s: float):
        """SIGTERM the replica (it drains for up to its --shutdown-grace), SIGKILL it after ``grace_s``
        + 10 s; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=grace_s + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=5)


@dataclass
class RayReplicas:
    """The launched replicas: their actor handles, placement group, torch threads each, and whether
    this process connected to Ray (then ``stop_replicas`` disconnects)."""
    actors: list = field(default_factory=list)
    threads: int = 0
    placement_group: object = None
    connected: bool = False


def replica_threads(args: argparse.Namespace, dp: int, node_cpus: list[float]) -> int:
    """Torch threads (and CPUs requested) per replica: ``--num-threads`` if set, else the smallest
    node's CPU count over the replicas a SPREAD placement puts on it (``ceil(dp / nodes)``), at
    least 1. ``node_cpus``: each alive node's CPU resource. Raises RuntimeError with no CPU node."""
    if args.num_threads:
        return args.num_threads
    if not node_cpus:
        raise RuntimeError("the Ray cluster has no node with CPUs")
    return max(1, int(min(node_cpus)) // math.ceil(dp / len(node_cpus)))


def start_replicas(args: argparse.Namespace, dp: int) -> tuple[RayReplicas, list[str]]:
    """Connect to the Ray cluster at ``args.ray_address`` and start ``dp`` replica actors there;
    returns (the replicas, their base URLs), not ready yet (``wait_ready``). Raises RuntimeError
    (everything started is stopped first) if Ray is missing or unreachable, the cluster cannot
    place the replicas within PLACEMENT_TIMEOUT_S, or an actor fails to start."""
    ray = _import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    reps = RayReplicas()
    try:
        if not ray.is_initialized():
            handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                ray.init(address=args.ray_address, log_to_driver=True)
            except ConnectionError as e:
                raise RuntimeError(f"no Ray cluster at --ray-address {args.ray_address} ({e}); "
                                   f"start one with `ray start --head`") from e
            finally:  # a driver's ray.init makes SIGTERM exit at once; the server's handlers drain first
                for s, h in handlers.items():
                    signal.signal(s, h)
            reps.connected = True
        node_cpus = [n["Resources"]["CPU"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
        reps.threads = threads = replica_threads(args, dp, node_cpus)
        bundle = {"CPU": threads, **({"GPU": 1} if str(args.device).startswith("cuda") else {})}
        reps.placement_group = placement_group([dict(bundle) for _ in range(dp)], strategy="SPREAD")
        try:
            ray.get(reps.placement_group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the Ray cluster cannot place {dp} replicas of {bundle} each within "
                               f"{PLACEMENT_TIMEOUT_S:.0f} s (available: {ray.available_resources()})") from None
        ra = argparse.Namespace(**vars(args))
        ra.num_threads, ra.ray_address = threads, None
        actor_cls = ray.remote(ReplicaActor)
        driver_ip = ray.util.get_node_ip_address()
        for i in range(dp):
            strategy = PlacementGroupSchedulingStrategy(placement_group=reps.placement_group,
                                                        placement_group_bundle_index=i)
            reps.actors.append(actor_cls.options(num_cpus=threads, num_gpus=bundle.get("GPU", 0),
                                                 scheduling_strategy=strategy).remote(ra, driver_ip))
        infos = []
        for i, a in enumerate(reps.actors):
            try:
                infos.append(ray.get(a.info.remote(), timeout=ACTOR_START_TIMEOUT_S))
            except ray.exceptions.RayError as e:
                raise RuntimeError(f"replica actor {i} failed to start: {e}") from e
        log.info("%d replicas placed on Ray: %s", dp, ", ".join(f"{url} (node {ip}, pid {pid})" for url, ip, pid in infos))
        return reps, [url for url, _, _ in infos]
    except BaseException:
        stop_replicas(reps, 0.0)
        raise


def _exitcodes(reps: RayReplicas) -> list:
    """Each replica's exit code (None: running); an actor that is gone counts as exit code -1."""
    import ray

    codes = []
    for a in reps.actors:
        try:
            codes.append(ray.get(a.exitcode.remote(), timeout=CALL_TIMEOUT_S))
        except ray.exceptions.RayError:
            codes.append(-1)
    return codes


def wait_ready(reps: RayReplicas, urls: list[str], timeout_s: float) -> None:
    """Poll every replica's /health until all answer 200 (``replicas.wait_all_healthy``). Raises
    RuntimeError when one exits (or its actor dies) or the time runs out."""
    wait_all_healthy(urls, lambda: _exitcodes(reps), timeout_s, 0.5,
                     " (its log is in the Ray worker's output above)")


def stop_replicas(reps: RayReplicas, grace_s: float) -> None:
    """Stop every replica (each drains for up to ``grace_s``), kill the actors, remove the placement
    group and, if ``start_replicas`` connected, disconnect from Ray. Never raises for an actor that
    is already gone.

    Bounded: the actors' ``stop`` calls are awaited together for ``grace_s`` + STOP_MARGIN_S at
    most; an actor still busy then is force-killed (``ray.kill``: its replica stops itself when its
    parent is gone), and ``ray.shutdown`` gets SHUTDOWN_TIMEOUT_S (a driver that does not disconnect
    in time is left behind with a warning: the actors and the placement group are released by then, and
    the process exits anyway). Raises RuntimeError, after everything is released, when an actor had to
    be force-killed (the caller exits non-zero)."""
    import ray

    if not ray.is_initialized():
        return
    problems = []
    try:
        refs = [a.stop.remote(grace_s) for a in reps.actors]
        wait_s = grace_s + STOP_MARGIN_S
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s) if refs else ([], [])
        for i, (a, r) in enumerate(zip(reps.actors, refs)):
            if r not in done:
                log.error("replica actor %d did not stop within %.0f s: force-killing it", i, wait_s)
                problems.append(f"replica actor {i} force-killed after {wait_s:.0f} s")
            ray.kill(a)
        if reps.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(reps.placement_group)
    finally:
        if reps.connected:
            t = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
            t.start()
            t.join(SHUTDOWN_TIMEOUT_S)
            if t.is_alive():  # the actors and their resources are released above; only this driver's link lingers
                log.warning("ray.shutdown() did not return within %.0f s: leaving without it (the replicas are "
                            "already stopped)", SHUTDOWN_TIMEOUT_S)
    if problems:
        raise RuntimeError("the Ray replicas did not stop cleanly: " + "; ".join(problems))
