"""Tensor-parallel ranks as processes: rank 0 is the process that builds the first ``ModelRunner`` (the
engine core process or the offline Engine's) and runs the scheduler; it starts ranks 1..N-1 as
``python -m idleless.dist.worker`` subprocesses (the engine core is a daemonic multiprocessing child,
which may not have multiprocessing children of its own), each building a ``ModelRunner`` on its shard.

Each step rank 0 sends the ``StepPlan`` (pickled once) to every worker over a ZMQ PUSH socket per
worker, then all ranks run ``ModelRunner.execute(plan)``, whose forward joins the group's collectives.
A socket rather than a ``broadcast_object_list``: waiting for the next plan is then no collective, so an
idle engine never trips the group's timeout (``group.COLLECTIVE_TIMEOUT_S``), which is left to bound the
forward's collectives; a worker polls its socket and leaves when rank 0's process is gone. Every rank
samples the gathered logits alike; rank 0's result is the one committed.

Failure: a worker that fails to start reports its traceback and rank 0's ``connect`` raises; a worker
found dead before a step, or a collective that fails (peer gone or timed out), raises
``TensorParallelError`` in rank 0, which the engine core reports and exits on.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import subprocess
import sys
import time
import traceback
import weakref
from dataclasses import replace

from idleless.dist.group import COLLECTIVE_TIMEOUT_S, TensorParallelError, TPGroup, host_store
from idleless.dist.tp import check_shardable, checkpoint_shards, shard_model

log = logging.getLogger(__name__)

#: how long rank 0 waits for the workers to load their shards and report, seconds
START_TIMEOUT_S = 600.0


def check_tp_config(config, mc, weight_dtype: str) -> None:
    """Raise ValueError for a configuration tensor parallelism does not cover: heads not divisible
    (``check_shardable``), quantised weights or activations (``weight_dtype``: the resolved
    ``--weight-dtype``), a quantised KV cache, a draft model for speculative decoding, PD
    disaggregation."""
    n = config.tensor_parallel_size
    check_shardable(mc, n)
    if weight_dtype != "bf16" or config.activation_dtype != "bf16":
        raise ValueError(f"--tp-size {n} shards unquantised weights only (weights {weight_dtype}, activations "
                         f"{config.activation_dtype}); add --weight-dtype bf16")
    if config.speculative_algorithm == "draft":
        raise ValueError(f"--tp-size {n} with a draft model is not supported (ngram speculation is)")
    if config.kv_cache_dtype not in ("auto", "bf16"):  # the accuracy gate would run a forward on rank 0 alone
        raise ValueError(f"--tp-size {n} with --kv-cache-dtype {config.kv_cache_dtype} is not supported")
    if config.disaggregation_mode != "null":
        raise ValueError(f"--tp-size {n} with --disaggregation-mode {config.disaggregation_mode} is not supported")


class TensorParallel:
    """One rank's tensor-parallel side of a ``ModelRunner``: ``config`` (the per-rank config: the KV
    budget fixed in bytes by rank 0 so every rank's pool has the same slots, the threads split between
    ranks), ``group`` (``TPGroup``), and on rank 0 the ``workers`` (subprocess.Popen, rank i + 1).
    Make rank 0's with ``start``; a worker's is made by ``worker_main``."""

    def __init__(self, config, group: TPGroup, store, links=None, workers=()):
        self.config, self.group, self.store = config, group, store
        self.links, self.workers = links, list(workers)
        self._close = weakref.finalize(self, _stop, self.workers, links) if self.workers else None

    @property
    def rank(self) -> int:
        return self.group.rank

    @classmethod
    def start(cls, config, mc, weight_dtype: str) -> "TensorParallel":
        """Rank 0: check the configuration (``check_tp_config``; ValueError), host the rendezvous store
        and start ranks 1..N-1, which load in parallel with rank 0. ``mc``: the model's ModelConfig."""
        import zmq

        check_tp_config(config, mc, weight_dtype)
        n = config.tensor_parallel_size
        config = replace(config, kv_cache_memory=str(int(config.kv_cache_bytes())),
                         num_threads=max(1, config.resolved_threads() // n))
        store = host_store(n)
        ctx = zmq.Context()
        ready = ctx.socket(zmq.PULL)
        ready_port = ready.bind_to_random_port("tcp://127.0.0.1")
        plans, workers = [], []
        for rank in range(1, n):
            sock = ctx.socket(zmq.PUSH)
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            plans.append(sock)
            proc = subprocess.Popen([sys.executable, "-m", "idleless.dist.worker"], stdin=subprocess.PIPE)
            proc.stdin.write(pickle.dumps((config, rank, store.port, port, ready_port, os.getpid())))
            proc.stdin.close()
            workers.append(proc)
        return cls(config, TPGroup(0, n), store, (ctx, ready, plans), workers)

    def local_heads(self, num_heads: int) -> int:
        """This rank's share of ``num_heads`` attention (or KV) heads."""
        return num_heads // self.group.size

    def shard(self, model) -> None:
        """``tp.shard_model`` on this rank's group."""
        shard_model(model, self.group)

    def checkpoint_shards(self, model, named_tensors):
        """``tp.checkpoint_shards``: this rank's piece of each whole checkpoint tensor."""
        return checkpoint_shards(model, named_tensors)

    def connect(self) -> None:
        """Rank 0: wait for every worker to load and report, then join the group. Raises
        TensorParallelError (a worker failed, exited or did not report within START_TIMEOUT_S). A
        worker's does nothing (``worker_main`` reports and joins once its runner is built)."""
        if self.links is None:
            return
        _, ready, _ = self.links
        waiting = set(range(1, self.group.size))
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            if ready.poll(200):
                waiting.discard(self._report(ready))
                continue
            try:
                self.check_workers()
            except TensorParallelError:
                if ready.poll(500):  # a failing worker reports before it exits: prefer its traceback
                    self._report(ready)
                raise
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks {sorted(waiting)} did not load within "
                                          f"{START_TIMEOUT_S:.0f} s")
        self.group.connect(self.store, self.config.device)

    @staticmethod
    def _report(ready) -> int:
        """Read one worker's start-up report: its rank if ready, else TensorParallelError with its traceback."""
        status, rank, detail = pickle.loads(ready.recv())
        if status != "ready":
            raise TensorParallelError(f"tensor-parallel rank {rank} failed to start:\n{detail}")
        return rank

    def check_workers(self) -> None:
        """Raise TensorParallelError naming the first worker that has exited."""
        for rank, proc in enumerate(self.workers, 1):
            if proc.poll() is not None:
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                          f"{proc.returncode}")

    def send_plan(self, plan) -> None:
        """Rank 0, before its forward: check the workers live, then send them ``plan``."""
        if not self.workers:
            return
        self.check_workers()
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self.links[2]:
            sock.send(data)

    def close(self) -> None:
        """Rank 0: stop the workers (a shutdown message, then SIGKILL after 5 s) and close the sockets.
        Also runs when this object is collected and at interpreter exit."""
        if self._close is not None:
            self._close()


def _stop(workers, links) -> None:
    ctx, ready, plans = links
    import zmq

    for sock, proc in zip(plans, workers):
        if proc.poll() is None:
            try:
                sock.send(pickle.dumps(None), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    for proc in workers:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for sock in (ready, *plans):
        sock.close(linger=0)
    ctx.term()


def worker_main() -> None:
    """Entry point of ranks 1..N-1 (``python -m idleless.dist.worker``; its arguments come pickled on
    stdin from ``TensorParallel.start``): build a ModelRunner on this rank's shard, report, join the
    group, then run every plan rank 0 sends until a shutdown message, rank 0's exit (checked every
    second) or a failed step (exit code 1). Exits with ``os._exit``: nothing this process holds needs
    flushing beyond its logs, and the runner's background loader threads would delay a normal exit."""
    import torch.distributed as dist
    import zmq

    config, rank, store_port, plan_port, ready_port, parent = pickle.load(sys.stdin.buffer)
    if config.device == "cuda":  # one GPU per rank (rank 0 keeps the default, cuda:0)
        config = replace(config, device=f"cuda:{rank}")
    logging.basicConfig(level=str(config.log_level).upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[tp{rank}]: %(message)s")
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PUSH)
    ready.connect(f"tcp://127.0.0.1:{ready_port}")
    plans = ctx.socket(zmq.PULL)
    plans.connect(f"tcp://127.0.0.1:{plan_port}")
    try:
        from idleless.model.runner import ModelRunner

        store = dist.TCPStore("127.0.0.1", store_port, config.tensor_parallel_size, False,
                              datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        tp = TensorParallel(config, TPGroup(rank, config.tensor_parallel_size), store)
        runner = ModelRunner(config, tp=tp)
    except BaseException:  # noqa: BLE001 - report any start-up failure to rank 0
        ready.send(pickle.dumps(("failed", rank, traceback.format_exc())))
        ready.close(linger=2000)
        plans.close(linger=0)
        ctx.term()
        os._exit(1)
    ready.send(pickle.dumps(("ready", rank, None)))
    code = 0
    try:
        tp.group.connect(store, config.device)
        while True:
            if not plans.poll(1000):
                if os.getppid() != parent:
                    log.warning("rank 0 is gone; exiting")
                    break
                continue
            plan = pickle.loads(plans.recv())
            if plan is None:
                break
            runner.execute(plan)
    except Exception:  # noqa: BLE001 - a failed collective: rank 0 is gone or failed too
        log.exception("tensor-parallel step failed; exiting")
        code = 1
    ready.close(linger=0)
    plans.close(linger=0)
    ctx.term()
    logging.shutdown()
    os._exit(code)  # not sys.exit: that would wait for the runner's structured-output loader thread


if __name__ == "__main__":
    worker_main()
