"""A real `idleless serve` in a subprocess, for the server tests (not a test module itself).

    srv = ServerProcess(["--kv-cache-memory", "256MiB"], api_key="k")   # starts it on a free port
    srv.wait_ready()                                                      # polls /health
    httpx.get(srv.url + "/v1/models", headers=srv.headers)
    srv.stop()                                                            # SIGTERM, returns the exit code
    srv = shared_server(pytestconfig, MAIN_ARGS, api_key=MAIN_API_KEY)    # one per session, for several modules

The process inherits the environment (IDLELESS_CACHE_DIR set by the ``smollm2_dir`` fixture, so
it finds the converted model). Its stdout+stderr go to ``srv.log_path``; ``srv.log()`` reads it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m idleless.server --host 127.0.0.1 --port <free> <args>`` as a subprocess."""

    def __init__(self, args: list[str], api_key: Optional[str] = None, env: Optional[dict] = None,
                 port: Optional[int] = None):
        self.port = port or free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        fd, self.log_path = tempfile.mkstemp(prefix="idleless-server-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        # `python -m idleless.server` is `idleless serve` (same add_args/main) without the other CLI
        # subcommands' imports; test_server.py::test_cli_serve_help covers the `idleless serve` wiring.
        cmd = [sys.executable, "-m", "idleless.server", "--host", "127.0.0.1", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        # its own process group, as under systemd or a container runtime: a signal to the group
        # reaches the frontend and the engine core together, and never this test process
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})},
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 600.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stats(self) -> dict:
        r = httpx.get(self.url + "/server_info", headers=self.headers, timeout=30)
        r.raise_for_status()
        return r.json()["stats"]

    def wait_idle_kv(self, timeout: float = 30.0) -> dict:
        """Poll until no request is running or waiting and no KV slot is held by a request; returns
        the last stats (raises AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        s = self.stats()
        while time.monotonic() < deadline:
            s = self.stats()
            if s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv"]["in_use"] == 0:
                return s
            time.sleep(0.05)
        raise AssertionError(f"KV not idle after {timeout} s: {s}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()
        return self.proc.returncode


# The server most tests share (test_server.py, test_server_fuzz.py): float32 because test_server.py
# compares with the offline Engine token for token and bf16 CPU matmuls are not batch-invariant;
# one engine thread because the CI machine has 2 cores and OpenMP threads that share a core with
# the frontend and the test process slow every step down many times over.
# The float copy of the bundled weights (not the default native Q4_1): the server tests compare against the
# offline engine and transformers on the converted float directory.
MAIN_ARGS = ("--dtype", "float32", "--weight-dtype", "bf16", "--kv-cache-memory", "256MiB", "--num-threads", "1",
             "--log-level", "warning")
MAIN_API_KEY = "test-key"
_SHARED: dict = {}


def shared_server(pytestconfig, args=MAIN_ARGS, api_key: Optional[str] = MAIN_API_KEY) -> ServerProcess:
    """Start (once per test session) and return a server; it is stopped with SIGTERM at the end of
    the session. A failed start is remembered, so later modules fail fast instead of retrying."""
    key = (tuple(args), api_key)
    if key not in _SHARED:
        srv = ServerProcess(list(args), api_key=api_key)
        _SHARED[key] = srv
        pytestconfig.add_cleanup(srv.stop)
        try:
            srv.wait_ready()
        except Exception as e:  # noqa: BLE001
            _SHARED[key] = e
            raise
    srv = _SHARED[key]
    if isinstance(srv, Exception):
        raise RuntimeError(f"the shared server failed to start earlier: {srv}")
    return srv


class PDRouter:
    """``idleless router --pd-disaggregation`` in a subprocess in front of a prefill and a decode
    ``ServerProcess`` (round robin), its output appended to ``<prefill log>.router``; ``extra``: more
    router flags (``--pd-layerwise``, ...). ``start()`` waits (up to 60 s) for its /health and returns
    its URL; ``stop()`` sends SIGTERM (SIGKILL after 20 s). Raises AssertionError when it exits or
    does not come up."""

    def __init__(self, prefill: ServerProcess, decode: ServerProcess, extra: list[str] = (),
                 prefill_timeout_s: int = 30):
        self.log_path = prefill.log_path + ".router"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "idleless.cli", "router", "--port", str(self.port), "--pd-disaggregation",
                     *extra, "--prefill", prefill.url, "--decode", decode.url, "--policy", "round_robin",
                     "--prefill-timeout-secs", str(prefill_timeout_s)]
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> str:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, open(self.log_path).read()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the PD router did not come up"
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
