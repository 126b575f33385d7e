"""The trainer's side of the weight push over HTTP: ``WeightPusher`` talks to a running Idleless (or
SGLang-shaped) server's RL routes (``idleless.server.routes_rl``).

    pusher = WeightPusher("http://127.0.0.1:30000")
    pusher.push_tensor(model.named_parameters_hf(), weight_version="step-1")       # shared memory
    pusher.init_group("127.0.0.1", free_port)                                      # gloo, trainer = rank 0
    pusher.push_distributed(named_tensors, weight_version="step-2")                # one broadcast per tensor
    pusher.destroy_group()

Every call raises ``WeightPushError`` with the server's message when the server refuses (the old weights
keep serving then).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from typing import Iterable, Optional

import torch

from idleless.rl.distributed import GroupSpec, WeightsUpdateGroup
from idleless.rl.shm import SharedTensors, dtype_name


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the server or the group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, args: Iterable[str] = (), timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """``python -m idleless.server --model model_dir <args>`` on a free local port; returns (process, url)
    once /health answers. RuntimeError if it exits or is not ready within ``timeout_s`` (then killed)."""
    import httpx
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "idleless.server", "--model", model_dir, "--host", "127.0.0.1",
                             "--port", str(port), *args])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s")


class WeightPushError(RuntimeError):
    """The server refused or failed a weight push; ``status`` is its HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


class _Call(threading.Thread):
    """One HTTP POST in a thread (the server answers only after the trainer's side of a collective)."""

    def __init__(self, pusher: "WeightPusher", route: str, body: dict, timeout: float):
        super().__init__(daemon=True)
        self.args = (pusher, route, body, timeout)
        self.result: Optional[dict] = None
        self.error: Optional[BaseException] = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.args[0].post(*self.args[1:])
        except BaseException as e:  # noqa: BLE001 - handed to the caller by wait()
            self.error = e

    def wait(self, timeout: float) -> dict:
        self.join(timeout)
        if self.is_alive():
            raise WeightPushError(f"no answer from the server within {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.result


class WeightPusher:
    """Pushes a trainer's weights into the server at ``url`` (``headers``: e.g. the API key's
    Authorization). ``timeout_s`` bounds every HTTP call and every collective."""

    def __init__(self, url: str, headers: Optional[dict] = None, timeout_s: float = 300.0):
        import httpx
        self.url = url.rstrip("/")
        self.http = httpx.Client(headers=headers or {}, timeout=timeout_s)
        self.timeout_s = timeout_s
        self.group: Optional[WeightsUpdateGroup] = None
        self.group_name = "weights_update_group"
        self.shared: Optional[SharedTensors] = None  # the tensor path's file, reused while the shapes match
        self.last_broadcast_s: Optional[float] = None  # push_distributed's broadcast, seconds

    def post(self, route: str, body: dict, timeout: Optional[float] = None) -> dict:
        """POST ``body`` to ``route``; the JSON answer, or WeightPushError with the server's message."""
        import httpx
        try:
            r = self.http.post(self.url + route, json=body, timeout=timeout or self.timeout_s)
        except httpx.HTTPError as e:
            raise WeightPushError(f"{route}: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            try:
                msg = r.json()["error"]["message"]
            except Exception:  # noqa: BLE001
                msg = r.text[:500]
            raise WeightPushError(f"{route}: {r.status_code}: {msg}", r.status_code)
        return r.json()

    def weight_version(self) -> str:
        return self.http.get(self.url + "/get_weight_version").json()["weight_version"]

    def push_disk(self, model_path: str, weight_version: Optional[str] = None, flush_cache: bool = True,
                  abort_all_requests: bool = False) -> dict:
        """``/update_weights_from_disk``: the server reads the checkpoint at ``model_path`` itself."""
        return self.post("/update_weights_from_disk", {"model_path": model_path, "weight_version": weight_version,
                                                       "flush_cache": flush_cache,
                                                       "abort_all_requests": abort_all_requests})

    def push_tensor(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: Optional[str] = None,
                    flush_cache: bool = True, abort_all_requests: bool = False) -> dict:
        """``/update_weights_from_tensor`` through a shared-memory file (written here, mapped by the
        server). The file is kept for the next push of the same names and shapes (rewritten in place)
        and removed by ``close``. The server must run on this machine."""
        items = list(named_tensors)
        if self.shared is not None and self.shared.matches(items):
            self.shared.write(items)
        else:
            if self.shared is not None:
                self.shared.close()
            self.shared = SharedTensors.create(items)
        return self.post("/update_weights_from_tensor", {**self.shared.payload(), "weight_version": weight_version,
                                                         "flush_cache": flush_cache,
                                                         "abort_all_requests": abort_all_requests})

    def init_group(self, master_address: str, master_port: int, group_name: str = "weights_update_group",
                   backend: str = "gloo") -> None:
        """Create the weights-update group with this process as rank 0 (the store's host) and the server
        as rank 1; returns once both joined. WeightPushError when the server refuses or the
        rendezvous fails (then nothing is left joined here)."""
        call = _Call(self, "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": 1, "world_size": 2,
            "group_name": group_name, "backend": backend, "timeout_s": self.timeout_s}, self.timeout_s + 30)
        try:
            self.group = WeightsUpdateGroup.join(GroupSpec(master_address, master_port, 0, 2, group_name, backend,
                                                           self.timeout_s))
        except (ValueError, RuntimeError) as e:
            call.join(self.timeout_s + 30)
            raise WeightPushError(f"could not create the weights-update group: {e}") from None
        self.group_name = group_name
        try:
            call.wait(self.timeout_s + 30)
        except BaseException:
            self.group.destroy()
            self.group = None
            raise

    def push_distributed(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                         weight_version: Optional[str] = None, flush_cache: bool = True,
                         abort_all_requests: bool = False) -> dict:
        """``/update_weights_from_distributed``: tell the server the names, dtypes and shapes, then
        broadcast each tensor from rank 0 (``WeightsUpdateGroup.broadcast``). Returns the server's answer
        (after it wrote the weights); ``last_broadcast_s`` is the wall seconds this side spent
        broadcasting (until the engine had the last byte). WeightPushError when the broadcast fails
        (with the server's message when it refused the update)."""
        if self.group is None:
            raise WeightPushError("init_group first")
        items = [(n, t.detach()) for n, t in named_tensors]
        call = _Call(self, "/update_weights_from_distributed", {
            "names": [n for n, _ in items], "dtypes": [dtype_name(t.dtype) for _, t in items],
            "shapes": [list(t.shape) for _, t in items], "group_name": self.group_name,
            "weight_version": weight_version, "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests}, self.timeout_s)
        t0 = time.perf_counter()
        try:
            self.group.broadcast(items)
        except RuntimeError as e:
            call.wait(30)  # the server's refusal, when it gave one, says why (raised from here)
            raise WeightPushError(str(e)) from None
        self.last_broadcast_s = time.perf_counter() - t0
        return call.wait(self.timeout_s + 30)

    def destroy_group(self) -> None:
        """Leave the group on both sides."""
        try:
            self.post("/destroy_weights_update_group", {"group_name": self.group_name})
        finally:
            if self.group is not None:
                self.group.destroy()
                self.group = None

    def close(self) -> None:
        """Close the HTTP client and remove the shared tensor file."""
        self.http.close()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
