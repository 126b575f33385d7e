"""``idleless serve``: the OpenAI-compatible HTTP server.

    idleless serve                                  # bundled SmolLM2-135M-Instruct on 127.0.0.1:30000
    idleless serve --model PATH --port 8000 --api-key sk-local --kv-cache-memory 1GiB
    idleless serve --dp 2                           # 2 replicas behind the cache-aware router (idleless.router)

Two processes: this one (frontend: uvicorn + FastAPI, tokenization, detokenization, stop strings)
and the engine core (scheduler + model), spawned with multiprocessing "spawn" and reached over ZMQ
(``idleless.server.engine_client``). The port is bound before the model loads (a port conflict
fails at once) but only listens once the engine is ready, so a client never waits on a half-started
server. SIGTERM/SIGINT: stop accepting, let in-flight requests finish for up to
``--shutdown-grace`` seconds (then abort them), stop the core, exit 0. If the engine core dies,
in-flight requests get an error, /health answers 503 and the process exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import socket
import sys
import time
from typing import Optional

from idleless import OPENMP_SPINCOUNT, bound_openmp_spin
from idleless.config import EngineConfig, add_cli_args, config_from_args

log = logging.getLogger("idleless.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: the server's step token budget (--max-num-batched-tokens): a burst of prompts is prefilled over
#: several steps, so first tokens come out staggered instead of all after the whole burst
SERVE_MAX_NUM_BATCHED_TOKENS = 1024
#: OpenMP spin before sleeping (GOMP_SPINCOUNT) for the engine core's threads (every idleless process's default)
SERVE_GOMP_SPINCOUNT = OPENMP_SPINCOUNT


def add_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags (one per EngineConfig field: --model, --dtype, --kv-cache-memory,
    --max-running-requests, --max-prefill-tokens, --schedule-policy, --disable-radix-cache,
    --max-queued-requests, --served-model-name, --log-level, ..., with their SGLang / vLLM names)
    plus the server's own (SGLang's --enable-metrics is accepted: the metrics are always on)."""
    add_cli_args(parser)
    # the server's own step budget (offline keeps EngineConfig's): benchmarks/README.md "Server threads"
    parser.set_defaults(max_prefill_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
    for action in parser._actions:  # noqa: SLF001 - the help states the server's default
        if action.dest == "max_prefill_tokens":
            action.help = action.help.replace(f"(default: {EngineConfig.max_prefill_tokens})",
                                              f"(default: {SERVE_MAX_NUM_BATCHED_TOKENS} for serve)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    parser.add_argument("--api-key", default=os.environ.get("IDLELESS_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on every route but /health "
                             "(default: $IDLELESS_API_KEY, else open)")
    parser.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="seconds in-flight requests may run after SIGTERM before they are aborted (default 30)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--chat-template", default=None,
                        help="the chat template for /v1/chat/completions: a Jinja file, or the template itself "
                             "inline (as vLLM's flag); default: the model's own")
    parser.add_argument("--enable-metrics", action="store_true",
                        help="accepted for SGLang's flag: GET /metrics is always on (idleless: and vllm: names)")
    parser.add_argument("--dp", "--dp-size", "--data-parallel-size", type=int, default=1, dest="dp", metavar="N",
                        help="N engine replicas on this machine behind a router on --host/--port, the cores split "
                             "between them; --kv-cache-memory is per replica (default 1: one server, no router)")
    parser.add_argument("--router-policy", default="exact",
                        choices=("round_robin", "power_of_two", "cache_aware_approx", "exact"),
                        help="with --dp: the router's policy (default exact)")
    parser.add_argument("--ray-address", default=None, metavar="auto|HOST:PORT",
                        help="with --dp: place the replicas as Ray actors across this Ray cluster's nodes (SPREAD), "
                             "the router here; needs the extra idleless[ray] (idleless.router.ray_replicas)")


def served_model_names(config: EngineConfig) -> list[str]:
    """Names accepted in the ``model`` field; the first is the one reported. Default: the
    model's file/dir name without ``.gguf`` (``SmolLM2-135M-Instruct`` for the bundled one),
    plus the ``--model`` string as given."""
    if config.served_model_name:
        names = [n.strip() for n in config.served_model_name.split(",") if n.strip()]
    elif config.model is None:
        names = [DEFAULT_MODEL_NAME]
    else:
        base = os.path.basename(os.path.normpath(config.model))
        names = [base[:-5] if base.lower().endswith(".gguf") else base]
    if config.model and config.model not in names:
        names.append(config.model)
    return names


def _bind(host: str, port: int) -> socket.socket:
    """Bind (not listen) a TCP socket; raises OSError at once if the address is taken."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, stype, proto, _, addr = infos[0]
    sock = socket.socket(family, stype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


# A SIGTERM within this many seconds of the first is the same stop request delivered twice (to the process
# group and forwarded by a parent such as make), not a request to skip the drain.
REPEAT_SIGTERM_S = 2.0


def _make_server(app, args, client) -> "object":
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn, but SIGTERM/SIGINT drain and return (exit 0) instead of re-raising the signal."""

        @contextlib.contextmanager
        def capture_signals(self):
            first = {}  # the first signal: its number and time.monotonic()

            def handler(sig, frame):
                if self.should_exit:
                    if sig == signal.SIGTERM == first["sig"] and time.monotonic() - first["at"] < REPEAT_SIGTERM_S:
                        # the same stop request again: a group SIGTERM that `make` or a supervisor also
                        # forwards to us; keep draining (a later signal, or Ctrl-C twice, forces)
                        log.info("repeated SIGTERM: still draining")
                        return
                    log.warning("second signal: exiting now")
                    self.force_exit = True
                    return
                first.update(sig=sig, at=time.monotonic())
                log.info("received %s: draining (up to %.0f s), no new requests", signal.Signals(sig).name,
                         args.shutdown_grace)
                client.draining = True
                self.should_exit = True

            old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    cfg = uvicorn.Config(app, log_config=None, access_log=bool(args.access_log), lifespan="off",
                         timeout_graceful_shutdown=max(0.0, args.shutdown_grace), timeout_keep_alive=5,
                         log_level=str(getattr(args, "log_level", "info")).lower())
    return _Server(cfg)


def usable_cores() -> int:
    """Processors this process may run on (its affinity mask: a container's or ``taskset``'s share),
    not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def engine_threads(config: EngineConfig) -> None:
    """The server's thread rule (benchmarks/README.md, "Server threads", has the measurements): with
    ``--num-threads 0`` the engine core gets every usable core, and its OpenMP threads spin
    ``SERVE_GOMP_SPINCOUNT`` times (tens of microseconds) before they sleep, unless the user set
    ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``: long enough to catch the next op of a step, short
    enough that a thread waiting on a descheduled one (a busy machine, the frontend's turn) gives its
    core back; and before each step it uses only the cores other processes leave free
    (``adaptive_threads``, idleless.engine.threads: a load generator beside the server no longer
    halves every step). An explicit ``--num-threads N`` is kept as given. The frontend's own torch
    work (HTTP, tokenization, detokenization need none) runs on one thread."""
    import torch

    if config.num_threads == 0:
        config.num_threads = usable_cores()
        config.adaptive_threads = True
    bound_openmp_spin()  # read by the spawned engine core's libgomp
    torch.set_num_threads(1)


async def serve(args: argparse.Namespace) -> int:
    """Start everything, serve until a signal or the engine's death; returns the exit code."""
    from idleless.server.app import ServerSettings, build_app
    from idleless.server.engine_client import EngineClient
    from idleless.telemetry.metrics import ServerMetrics

    from idleless.text.tokenizer import load_chat_template

    t0 = time.monotonic()
    config = config_from_args(args)
    chat_template = load_chat_template(args.chat_template) if args.chat_template else None  # fails before the load
    engine_threads(config)
    names = served_model_names(config)
    sock = _bind(args.host, args.port)
    metrics = ServerMetrics(names[0])
    client: Optional[EngineClient] = None
    try:
        client = await EngineClient.start(config, metrics)
        if chat_template is not None:
            client.tokenizer.set_chat_template(chat_template)
        info = client.info
        fp = hashlib.sha256(f"{info.model_dir}|{info.dtype}".encode()).hexdigest()[:10]
        settings = ServerSettings(model_names=names, model_path=config.model or info.model_dir, api_key=args.api_key,
                                  system_fingerprint=f"idleless-0.1.0-{info.dtype}-{fp}",
                                  extra_info={"host": args.host, "port": args.port})
        app = build_app(client, settings, metrics)
        server = _make_server(app, args, client)
        exit_code = {"code": 0}

        def on_death():
            exit_code["code"] = 1
            server.should_exit = True

        client.on_death = on_death

        async def announce():
            while not server.started:
                if server.should_exit:
                    return
                await asyncio.sleep(0.02)
            host, port = sock.getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            log.info("Idleless server ready on http://%s:%d (model %s, dtype %s, KV capacity %d tokens, "
                     "context %d, model load %.1f s, start-up %.1f s)%s", shown, port, names[0], info.dtype,
                     info.kv_slots, info.context_length, info.load_seconds, time.monotonic() - t0,
                     "; API key required" if args.api_key else "")

        ann = asyncio.create_task(announce())
        await server.serve(sockets=[sock])
        ann.cancel()
        if client.dead:
            exit_code["code"] = 1
        log.info("server stopped; stopping the engine core")
        return exit_code["code"]
    finally:
        sock.close()
        if client is not None:
            await client.shutdown()


def exit_process(code: int) -> None:
    """Leave the server process now with ``code``, after flushing logs and stdio. Interpreter
    finalization after a clean shutdown was seen spinning in the garbage collector for over a
    minute (py-spy: gc_collect_main) with the engine core already stopped; nothing is left to
    finalize by then, so the process skips it."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def main(args: argparse.Namespace) -> int:
    """``idleless serve`` entry point (called by idleless.cli with the parsed flags)."""
    def early_exit(sig, frame):  # a signal while the model loads: clean up and leave
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, early_exit)
    try:
        if getattr(args, "dp", 1) > 1 or getattr(args, "ray_address", None):  # replicas (one on Ray too)
            from idleless.router.replicas import serve_replicas
            return serve_replicas(args)
        return asyncio.run(serve(args))
    except KeyboardInterrupt:
        log.info("interrupted during start-up")
        return 0
    except (OSError, RuntimeError, ValueError) as e:
        log.error("cannot start the server: %s", e)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
