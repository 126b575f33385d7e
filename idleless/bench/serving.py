"""``idleless bench serving``: an async HTTP load generator for any OpenAI-compatible server.

    idleless bench serving --base-url http://127.0.0.1:30000 --workload shared-prefix \\
        --gsp-num-groups 4 --gsp-prompts-per-group 8 --request-rate inf --output-file run.json --plot run.png

Workloads (``--workload``):

* ``shared-prefix``: the generated-shared-prefix shape (SGLang's ``generated-shared-prefix``):
  ``--gsp-num-groups`` groups x ``--gsp-prompts-per-group`` prompts; every prompt of a group starts
  with the group's system prompt (``--gsp-system-prompt-len`` tokens) and ends with its own question
  (``--gsp-question-len`` tokens); ``--gsp-output-len`` new tokens each. Submitted shuffled (seeded).
* ``multi-turn``: ``--mt-turns``-turn chat sessions (``/v1/chat/completions``): a session's system
  prompt (``--mt-system-len`` tokens) and user turns (``--mt-user-len``) are random text; turn
  k+1's messages are turn k's plus the answer the server streamed for it plus the next user turn,
  so it is sent only when turn k has finished. ``--num-prompts`` counts requests (turns): sessions =
  ceil(num_prompts / turns). The request rate applies to session starts.
* ``random``: unrelated prompts; input and output lengths drawn uniformly from
  ``[len x --random-range-ratio, len]`` (SGLang's definition) around ``--random-input-len`` /
  ``--random-output-len``.
* a workload JSON file (``../shared/workloads/*.json``, or a bare name such as ``shared_prefix``):
  sent as the recorded ``prompt_token_ids`` to ``/v1/completions`` (``--prompt-format ids``, the
  default: every server sees the same tokens) or as the recorded text (``--prompt-format text``;
  with ``--api chat`` the recorded ``messages``). Its ``sampling`` block (temperature, ignore_eos)
  and per-request ``max_tokens`` are used; shuffled with ``--seed`` unless ``--no-shuffle``.

Generated prompts are random words that are one token each in the tokenizer (``--tokenizer``, an
HF directory; default the bundled SmolLM2's), so a prompt of N words is N tokens.

Load: ``--request-rate R`` requests/s with exponential (Poisson) gaps drawn from ``--seed``;
``inf`` (the default) sends everything at once. ``--max-concurrency C`` caps requests in flight
(arrived requests wait for a slot; their TTFT starts when they are sent, as in SGLang and vLLM).

Metrics (SGLang's / vLLM's ``bench_serving`` definitions; every request streams, with
``stream_options.include_usage``; times are ``time.perf_counter`` on the client):

* TTFT: send -> first chunk carrying text. E2E latency: send -> end of the stream.
* ITL: the gaps between successive text-carrying chunks (all requests' gaps pooled).
* TPOT: per request, (E2E - TTFT) / (output_len - 1), for requests with output_len > 1.
* output_len / input_len: the server's ``usage`` (completion_tokens / prompt_tokens) when reported,
  else the tokenizer's count of the streamed text / the prompt.
* throughputs over the benchmark duration (first send to last finish): requests/s, input, output
  and total (input + output) tokens/s; concurrency = sum of E2E / duration.
* goodput (``--slo ttft:MS,tpot:MS[,e2e:MS]``): requests/s of completed requests that meet every
  given bound (a request with one output token has TPOT 0).
* cache hit rate: sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of prompt tokens.
* busy fraction of the server over the run: from its engine time buckets, scraped before and after
  the run (``/metrics``; for Idleless ``/server_info`` when ``/metrics`` has no buckets):
  forward / (wall - idle_no_work), with the split of the wall time into buckets. Left out (and
  said so) when the server exposes none.

Percentiles: mean, median, p90, p99 (numpy's linear interpolation). The result JSON
(``--output-file``) holds the settings, the metrics and one summary row per request;
``--plot PNG`` draws the run over time (see ``idleless.bench.plot``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from idleless.telemetry.timing import BUCKETS  # the engine's wall-time buckets

GENERATED = ("shared-prefix", "multi-turn", "random")


def _log(msg: str) -> None:
    print(f"[bench serving] {msg}", file=sys.stderr, flush=True)


def load_avg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# --------------------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------------------
@dataclass
class BenchRequest:
    """One request to send. Exactly one of ``prompt`` (``/v1/completions``: text or token ids) and
    ``messages`` (``/v1/chat/completions``) is set, except for multi-turn turns, whose messages are
    built at run time from ``user`` and the session's history. ``input_len``: the client's count of
    prompt tokens (None when unknown before the run)."""

    id: str
    max_tokens: int
    prompt: Any = None
    messages: Optional[list[dict]] = None
    input_len: Optional[int] = None
    user: Optional[str] = None  # multi-turn: this turn's user message
    group: Optional[int] = None


@dataclass
class Session:
    """A multi-turn chat: ``system`` then ``turns`` sent one after another."""

    id: str
    system: Optional[str]
    turns: list[BenchRequest]


@dataclass
class WorkloadPlan:
    """What to send: ``items`` in submission order (a BenchRequest, or a Session for multi-turn),
    the sampling settings and a description for the result file."""

    name: str
    items: list  # BenchRequest | Session
    temperature: float = 0.0
    ignore_eos: bool = True
    api: str = "completions"  # completions | chat
    info: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(it.turns) if isinstance(it, Session) else 1 for it in self.items)


class WordSource:
    """Random text with a known token count: words that the tokenizer encodes as exactly one token
    each (a leading-space piece of 3-10 ASCII letters that round-trips alone), so ``text(n)`` is
    n tokens for a byte-level BPE tokenizer (its pre-tokenizer splits before every space)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        hf = getattr(tokenizer, "hf", tokenizer)
        vocab = hf.get_vocab()
        words = []
        for piece, tid in sorted(vocab.items(), key=lambda kv: kv[1]):
            if not (piece.startswith("Ġ") or piece.startswith("▁")):
                continue
            w = piece[1:]
            if 3 <= len(w) <= 10 and w.isascii() and w.isalpha():
                words.append((" " + w, tid))
        # keep words that encode alone to their own id (no merges across the leading space)
        texts = [t for t, _ in words]
        enc = hf(texts, add_special_tokens=False)["input_ids"] if texts else []
        self.words = [t for (t, tid), ids in zip(words, enc) if list(ids) == [tid]]
        if len(self.words) < 100:
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r}: too few single-token words "
                             f"({len(self.words)}) to generate prompts of known length")

    def text(self, n: int, rng: random.Random) -> str:
        return "".join(rng.choices(self.words, k=max(0, int(n))))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(path: Optional[str]):
    """An ``idleless.text.tokenizer.Tokenizer`` from an HF directory; None -> the bundled SmolLM2
    (converted once, like the engine does). Raises OSError / FileNotFoundError if unavailable."""
    from idleless.text.tokenizer import Tokenizer

    if path is None:
        from idleless.model.loader import prepare_model_dir
        path = prepare_model_dir(None)
    return Tokenizer.load(path)


def gen_shared_prefix(words: WordSource, num_groups: int, prompts_per_group: int, system_len: int,
                      question_len: int, output_len: int, seed: int, shuffle: bool = True,
                      num_prompts: Optional[int] = None) -> WorkloadPlan:
    """Groups x prompts per group; each prompt = its group's system prompt + its own question."""
    rng = random.Random(seed)
    items = []
    for g in range(num_groups):
        system = words.text(system_len, rng)
        for p in range(prompts_per_group):
            q = words.text(question_len, rng)
            items.append(BenchRequest(f"g{g}-p{p}", output_len, prompt=system + q,
                                      input_len=system_len + question_len, group=g))
    if shuffle:
        random.Random(seed + 1).shuffle(items)
    if num_prompts:
        items = items[:num_prompts]
    info = {"num_groups": num_groups, "prompts_per_group": prompts_per_group, "system_prompt_len": system_len,
            "question_len": question_len, "output_len": output_len, "shuffled": shuffle}
    total = sum(r.input_len for r in items)
    unique = len({r.group for r in items}) * system_len + len(items) * question_len
    info["hit_rate_upper_bound"] = 1 - unique / total if total else 0.0
    return WorkloadPlan("shared-prefix", items, info=info)


def gen_random(words: WordSource, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
               seed: int) -> WorkloadPlan:
    """Unrelated prompts; lengths uniform in [max(1, int(len * range_ratio)), len]."""
    rng = random.Random(seed)
    items = []
    for i in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), max(1, input_len))
        n_out = rng.randint(max(1, int(output_len * range_ratio)), max(1, output_len))
        items.append(BenchRequest(f"r{i}", n_out, prompt=words.text(n_in, rng), input_len=n_in))
    return WorkloadPlan("random", items, info={"input_len": input_len, "output_len": output_len,
                                               "range_ratio": range_ratio})


def gen_multi_turn(words: WordSource, num_prompts: int, turns: int, system_len: int, user_len: int,
                   output_len: int, seed: int) -> WorkloadPlan:
    """ceil(num_prompts / turns) sessions of ``turns`` turns (the last may be shorter)."""
    rng = random.Random(seed)
    sessions, left, s = [], num_prompts, 0
    while left > 0:
        k = min(turns, left)
        system = words.text(system_len, rng) if system_len > 0 else None
        ts = [BenchRequest(f"s{s}-t{t}", output_len, user=words.text(user_len, rng)) for t in range(k)]
        sessions.append(Session(f"s{s}", system, ts))
        left -= k
        s += 1
    return WorkloadPlan("multi-turn", sessions, api="chat",
                        info={"sessions": len(sessions), "turns": turns, "system_len": system_len,
                              "user_len": user_len, "output_len": output_len})


def load_workload_file(path: str, prompt_format: str = "ids", api: str = "completions", seed: int = 0,
                       shuffle: bool = True, num_prompts: Optional[int] = None) -> WorkloadPlan:
    """A workload JSON (see ../shared/workloads/README.md). ``prompt_format``: ``ids`` sends
    ``prompt_token_ids``, ``text`` the recorded ``prompt`` (``api="chat"``: the ``messages``).
    Raises FileNotFoundError, or ValueError for a file without requests."""
    from idleless.bench.offline import resolve_workload_path

    resolved = resolve_workload_path(path)
    data = json.loads(resolved.read_text(encoding="utf-8"))
    reqs = data.get("requests") if isinstance(data, dict) else None
    if not reqs:
        raise ValueError(f"workload {resolved} has no 'requests'")
    sampling = data.get("sampling") or {}
    default_max = int(sampling.get("max_tokens", 128))
    items = []
    for i, r in enumerate(reqs):
        ids = r.get("prompt_token_ids")
        mt = int(r.get("max_tokens", default_max))
        rid = str(r.get("id", i))
        if api == "chat":
            if not r.get("messages"):
                raise ValueError(f"workload {resolved}: request {rid} has no 'messages' (needed by --api chat)")
            items.append(BenchRequest(rid, mt, messages=list(r["messages"]), input_len=len(ids) if ids else None))
        elif prompt_format == "ids":
            if not ids:
                raise ValueError(f"workload {resolved}: request {rid} has no prompt_token_ids")
            items.append(BenchRequest(rid, mt, prompt=list(ids), input_len=len(ids)))
        else:
            if not isinstance(r.get("prompt"), str):
                raise ValueError(f"workload {resolved}: request {rid} has no text 'prompt'")
            items.append(BenchRequest(rid, mt, prompt=r["prompt"], input_len=len(ids) if ids else None))
    if shuffle:
        random.Random(seed).shuffle(items)
    if num_prompts:
        items = items[:num_prompts]
    return WorkloadPlan(str(data.get("name", resolved.stem)), items,
                        temperature=float(sampling.get("temperature", 0.0)),
                        ignore_eos=bool(sampling.get("ignore_eos", True)), api=api,
                        info={"path": str(resolved), "prompt_format": prompt_format, "shuffled": shuffle,
                              "stats": data.get("stats") or {}})


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of n arrivals: 0 for all when rate is inf; else cumulative exponential gaps
    with mean 1/rate from ``random.Random(seed)`` (the first arrival after one gap)."""
    if n <= 0:
        return []
    if rate is None or math.isinf(rate) or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


# --------------------------------------------------------------------------------------------------
# the client
# --------------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    """What the client saw of one request. Times: perf_counter seconds; ``chunk_times``: arrival of
    each text-carrying chunk; ``usage``: the last usage object the server sent (or None)."""

    id: str
    success: bool = False
    error: Optional[str] = None
    send_time: float = 0.0
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    usage: Optional[dict] = None
    input_len: Optional[int] = None
    output_len: Optional[int] = None
    cached_tokens: Optional[int] = None
    max_tokens: int = 0

    @property
    def ttft(self) -> Optional[float]:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def latency(self) -> float:
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        c = self.chunk_times
        return [b - a for a, b in zip(c, c[1:])]

    @property
    def tpot(self) -> Optional[float]:
        if not self.success or self.ttft is None or not self.output_len or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def _chunk_text(obj: dict) -> str:
    parts = []
    for c in obj.get("choices") or []:
        t = c.get("text")
        if t is None:
            t = (c.get("delta") or {}).get("content")
        if t:
            parts.append(t)
    return "".join(parts)


async def send_request(client, url: str, body: dict, res: RequestResult, headers: Optional[dict] = None) -> None:
    """POST one streaming request and fill ``res`` (never raises for HTTP or stream errors: they
    land in ``res.error``)."""
    res.send_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                res.error = f"HTTP {resp.status_code}: {raw[:300].decode('utf-8', 'replace')}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                try:
                    obj = json.loads(payload)
                except ValueError:
                    res.error = f"bad SSE payload: {payload[:200]}"
                    return
                if obj.get("error"):
                    err = obj["error"]
                    res.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                    return
                text = _chunk_text(obj)
                if text:
                    res.chunk_times.append(time.perf_counter())
                    res.text += text
                if obj.get("usage"):
                    res.usage = obj["usage"]
        res.success = True
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.end_time = time.perf_counter()


def _finish_counts(res: RequestResult, tokenizer, prompt_for_count: Any) -> None:
    """input_len / output_len / cached_tokens from usage, else counted with the tokenizer."""
    u = res.usage or {}
    if isinstance(u.get("prompt_tokens"), int):
        res.input_len = u["prompt_tokens"]
    elif res.input_len is None and tokenizer is not None and prompt_for_count is not None:
        if isinstance(prompt_for_count, str):
            res.input_len = len(tokenizer.encode(prompt_for_count, add_special_tokens=False))
        elif isinstance(prompt_for_count, list) and prompt_for_count and isinstance(prompt_for_count[0], dict):
            try:
                res.input_len = len(tokenizer.apply_chat_template(prompt_for_count))
            except Exception:  # noqa: BLE001 - no chat template: leave it unknown
                pass
    if isinstance(u.get("completion_tokens"), int):
        res.output_len = u["completion_tokens"]
    elif tokenizer is not None:
        res.output_len = len(tokenizer.encode(res.text, add_special_tokens=False)) if res.text else 0
    else:
        res.output_len = len(res.chunk_times)
    det = u.get("prompt_tokens_details") or {}
    if isinstance(det.get("cached_tokens"), int):
        res.cached_tokens = det["cached_tokens"]
    elif isinstance(u.get("cached_tokens"), int):
        res.cached_tokens = u["cached_tokens"]


@dataclass
class RunSettings:
    base_url: str
    model: Optional[str]
    request_rate: float = math.inf
    max_concurrency: Optional[int] = None
    seed: int = 0
    api_key: Optional[str] = None
    timeout: float = 3600.0
    extra_body: dict = field(default_factory=dict)
    disable_ignore_eos: bool = False


def _body(plan: WorkloadPlan, st: RunSettings, req: BenchRequest, messages: Optional[list[dict]]) -> tuple[str, dict]:
    body: dict[str, Any] = {"model": st.model, "max_tokens": req.max_tokens, "temperature": plan.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if plan.ignore_eos and not st.disable_ignore_eos:
        body["ignore_eos"] = True
    body.update(st.extra_body)
    if messages is not None:
        body["messages"] = messages
        return "/v1/chat/completions", body
    body["prompt"] = req.prompt
    return "/v1/completions", body


async def run_plan(plan: WorkloadPlan, st: RunSettings, tokenizer=None, progress: bool = False
                   ) -> tuple[list[RequestResult], float, float]:
    """Send the plan; returns (results in submission order, start, end) (perf_counter seconds)."""
    import httpx

    n = plan.num_requests
    limit = st.max_concurrency or max(1, n)
    sem = asyncio.Semaphore(limit)
    headers = {"Authorization": f"Bearer {st.api_key}"} if st.api_key else None
    arrivals = arrival_times(len(plan.items), st.request_rate, st.seed)
    results: list[RequestResult] = []
    done = [0]
    limits = httpx.Limits(max_connections=min(limit, 1024), max_keepalive_connections=min(limit, 1024))
    timeout = httpx.Timeout(st.timeout, connect=60.0)

    async with httpx.AsyncClient(base_url=st.base_url.rstrip("/"), limits=limits, timeout=timeout) as client:
        async def one(req: BenchRequest, messages: Optional[list[dict]]) -> RequestResult:
            res = RequestResult(req.id, input_len=req.input_len, max_tokens=req.max_tokens)
            results.append(res)
            path, body = _body(plan, st, req, messages)
            async with sem:
                await send_request(client, path, body, res, headers)
            _finish_counts(res, tokenizer, messages if messages is not None else req.prompt)
            done[0] += 1
            if progress and (done[0] % max(1, n // 10) == 0 or done[0] == n):
                _log(f"{done[0]}/{n} done")
            return res

        async def item_task(item, delay: float, start: float) -> None:
            wait = start + delay - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            if isinstance(item, Session):
                history = [{"role": "system", "content": item.system}] if item.system else []
                for turn in item.turns:
                    history = history + [{"role": "user", "content": turn.user}]
                    res = await one(turn, history)
                    if not res.success:
                        return  # the session cannot go on without its answer
                    history = history + [{"role": "assistant", "content": res.text}]
            else:
                await one(item, item.messages)

        start = time.perf_counter()
        await asyncio.gather(*(item_task(it, d, start) for it, d in zip(plan.items, arrivals)))
        end = time.perf_counter()
    return results, start, end


# --------------------------------------------------------------------------------------------------
# server telemetry: busy fraction from /metrics (or /server_info)
# --------------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([^\s]+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict, float]]:
    """Samples of a Prometheus text exposition: (name, labels, value); comments skipped."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            v = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, v))
    return out


def busy_counters_from_metrics(samples: list[tuple[str, dict, float]]) -> dict:
    """Cumulative engine time buckets (s) found in /metrics samples. Recognized shapes: a seconds
    family with a ``bucket``/``kind``/``state``/``phase`` label whose value is a bucket name (or
    ``wall``), or one metric per bucket named ``*engine_<bucket>_seconds[_total]`` /
    ``*_<bucket>_seconds[_total]``; plus a gauge whose name contains ``busy_fraction``
    (key ``busy_fraction_gauge``). Values of several label sets (models) are summed."""
    names = set(BUCKETS) | {"wall"}
    out: dict[str, float] = {}
    for name, labels, v in samples:
        low = name.lower()
        if "busy_fraction" in low:
            out["busy_fraction_gauge"] = v
            continue
        if "second" not in low and "time" not in low:
            continue
        if low.endswith("_created") or low.endswith("_bucket") or low.endswith("_count") or low.endswith("_sum"):
            continue
        key = None
        for lab in ("bucket", "kind", "state", "phase"):
            if labels.get(lab) in names:
                key = labels[lab]
                break
        if key is None:
            base = re.sub(r"_total$", "", low)
            for b in names:
                if base.endswith(f"_{b}_seconds") or base.endswith(f":{b}_seconds") or base.endswith(f"_{b}_time"):
                    key = b
                    break
        if key is not None:
            out[key] = out.get(key, 0.0) + v
    return out


async def scrape_telemetry(base_url: str, api_key: Optional[str] = None) -> dict:
    """One snapshot: ``{"metrics": {bucket: s}, "server_info": {bucket: s} or None, "t": perf_counter,
    "errors": [...]}``. Never raises."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    snap: dict[str, Any] = {"metrics": {}, "server_info": None, "errors": [], "t": time.perf_counter()}
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=30.0) as c:
        try:
            r = await c.get("/metrics", headers=headers)
            if r.status_code == 200:
                snap["metrics"] = busy_counters_from_metrics(parse_prometheus(r.text))
            else:
                snap["errors"].append(f"/metrics: HTTP {r.status_code}")
        except Exception as e:  # noqa: BLE001
            snap["errors"].append(f"/metrics: {type(e).__name__}: {e}")
        try:
            r = await c.get("/server_info", headers=headers)
            if r.status_code == 200:
                tm = ((r.json() or {}).get("stats") or {}).get("time")
                if isinstance(tm, dict):
                    snap["server_info"] = {k: float(v) for k, v in tm.items() if isinstance(v, (int, float))}
        except Exception:  # noqa: BLE001 - another engine has no /server_info: fine
            pass
    snap["t"] = time.perf_counter()
    return snap


def busy_over_run(before: dict, after: dict) -> dict:
    """Busy fraction of the server between two snapshots, and the split of its wall time.

    Preference: /metrics with forward, wall and idle_no_work -> /server_info buckets -> /metrics
    forward seconds only, over the client's time between the scrapes (forward / wall, idle
    included: equal to the busy fraction while the server always had work). ``source`` says
    which; ``busy_fraction`` is None (and ``note`` says why) when the server exposes none."""
    full = ("forward", "wall", "idle_no_work")
    for src in ("metrics", "server_info"):
        b, a = before.get(src) or {}, after.get(src) or {}
        if all(k in b and k in a for k in full):
            d = {k: a[k] - b[k] for k in a if k in b and k != "busy_fraction" and k != "busy_fraction_gauge"}
            wall = d["wall"]
            work = wall - d["idle_no_work"]
            split = {k: d[k] / wall for k in BUCKETS if k in d and wall > 0}
            return {"busy_fraction": d["forward"] / work if work > 0 else None, "source": src,
                    "seconds": d, "split_of_wall": split,
                    "split_of_work": {k: d[k] / work for k in BUCKETS if k in d and k != "idle_no_work" and work > 0}}
    b, a = before.get("metrics") or {}, after.get("metrics") or {}
    if "forward" in b and "forward" in a:
        span = after["t"] - before["t"]
        fwd = a["forward"] - b["forward"]
        return {"busy_fraction": fwd / span if span > 0 else None, "source": "metrics forward seconds / client wall",
                "seconds": {"forward": fwd, "wall": span},
                "note": "the server exposes forward seconds but no wall/idle buckets: forward / wall between "
                        "the scrapes (idle time included)"}
    return {"busy_fraction": None, "source": None,
            "note": "the server exposes no engine time buckets in /metrics (nor /server_info): busy fraction "
                    "not measured" + (f" ({'; '.join(after.get('errors') or [])})" if after.get("errors") else "")}


# --------------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------------
def _dist(xs: Sequence[float], scale: float = 1000.0) -> dict:
    """mean / median / p90 / p99 / std / max (numpy linear percentiles) x scale; Nones if empty."""
    import numpy as np

    if not xs:
        return {k: None for k in ("mean", "median", "p90", "p99", "std", "max")}
    a = np.asarray(xs, dtype=float) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "std": float(a.std()), "max": float(a.max())}


def parse_slo(spec: Optional[str]) -> dict:
    """``ttft:MS,tpot:MS[,e2e:MS]`` -> {"ttft": s, ...}. Raises ValueError on bad input."""
    if not spec:
        return {}
    out = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        k, sep, v = part.partition(":")
        k = k.strip().lower()
        if not sep or k not in ("ttft", "tpot", "e2e", "itl"):
            raise ValueError(f"bad --slo part {part!r}: want ttft:MS, tpot:MS, e2e:MS")
        out[k] = float(v) / 1000.0
    return out


def compute_metrics(results: Sequence[RequestResult], duration: float, slo: Optional[dict] = None) -> dict:
    """The metric set (module docstring) over the completed requests; times in ms."""
    ok = [r for r in results if r.success]
    in_tok = sum(r.input_len or 0 for r in ok)
    out_tok = sum(r.output_len or 0 for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [g for r in ok for g in r.itls]
    e2es = [r.latency for r in ok]
    m: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "input_throughput": in_tok / duration if duration > 0 else None,
        "output_throughput": out_tok / duration if duration > 0 else None,
        "total_throughput": (in_tok + out_tok) / duration if duration > 0 else None,
        "concurrency": sum(e2es) / duration if duration > 0 else None,
        "ttft_ms": _dist(ttfts), "tpot_ms": _dist(tpots), "itl_ms": _dist(itls), "e2e_ms": _dist(e2es),
    }
    with_cache = [r for r in ok if r.cached_tokens is not None and r.input_len]
    if with_cache:
        p = sum(r.input_len for r in with_cache)
        m["cached_tokens"] = sum(r.cached_tokens for r in with_cache)
        m["cache_hit_rate"] = m["cached_tokens"] / p if p else None
    else:
        m["cached_tokens"] = None
        m["cache_hit_rate"] = None
    if slo:
        good = 0
        for r in ok:
            vals = {"ttft": r.ttft, "tpot": r.tpot if r.tpot is not None else 0.0, "e2e": r.latency,
                    "itl": max(r.itls) if r.itls else 0.0}
            if all(vals[k] is not None and vals[k] <= v for k, v in slo.items()):
                good += 1
        m["slo_ms"] = {k: v * 1000 for k, v in slo.items()}
        m["good_requests"] = good
        m["goodput"] = good / duration if duration > 0 else None
        m["good_fraction"] = good / len(results) if results else None
    if len(results) != len(ok):
        m["errors"] = sorted({r.error or "?" for r in results if not r.success})[:5]
    return m


def request_rows(results: Sequence[RequestResult], start: float) -> list[dict]:
    """One compact row per request for the result file (times in s from the benchmark start)."""
    rows = []
    for r in results:
        rows.append({"id": r.id, "ok": r.success, "error": r.error, "send_s": round(r.send_time - start, 6),
                     "ttft_s": None if r.ttft is None else round(r.ttft, 6), "e2e_s": round(r.latency, 6),
                     "tpot_s": None if r.tpot is None else round(r.tpot, 6), "input_len": r.input_len,
                     "output_len": r.output_len, "cached_tokens": r.cached_tokens, "chunks": len(r.chunk_times),
                     "chunk_s": [round(t - start, 5) for t in r.chunk_times]})
    return rows


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def format_table(result: dict) -> str:
    """The one-screen summary (SGLang's layout)."""
    m, w, s = result["metrics"], result["workload"], result["settings"]
    b = result.get("busy") or {}
    rate = s["request_rate"]
    lines = [
        "=" * 20 + " Serving Benchmark Result " + "=" * 20,
        f"{'Server:':<40}{s['base_url']}  (model {s['model']})",
        f"{'Workload:':<40}{w['name']} ({w['num_requests']} requests, {w['api']})",
        f"{'Request rate / max concurrency:':<40}{rate} req/s / {s['max_concurrency'] or 'unlimited'}",
        f"{'Successful / failed requests:':<40}{m['completed']} / {m['failed']}",
        f"{'Benchmark duration (s):':<40}{_f(m['duration_s'])}",
        f"{'Total input / output tokens:':<40}{m['total_input_tokens']} / {m['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{_f(m['request_throughput'], '{:.3f}')}",
        f"{'Input token throughput (tok/s):':<40}{_f(m['input_throughput'])}",
        f"{'Output token throughput (tok/s):':<40}{_f(m['output_throughput'])}",
        f"{'Total token throughput (tok/s):':<40}{_f(m['total_throughput'])}",
        f"{'Concurrency (sum E2E / duration):':<40}{_f(m['concurrency'])}",
        f"{'Cache hit rate (usage.cached_tokens):':<40}"
        + ("not reported by the server" if m.get("cache_hit_rate") is None else f"{100 * m['cache_hit_rate']:.1f}%"),
    ]
    if b.get("busy_fraction") is not None:
        split = b.get("split_of_wall") or {}
        sp = ", ".join(f"{k} {100 * v:.1f}%" for k, v in split.items())
        lines.append(f"{'Server busy fraction (' + b['source'] + '):':<40}{100 * b['busy_fraction']:.1f}%")
        if sp:
            lines.append(f"{'  engine wall split:':<40}{sp}")
    else:
        lines.append(f"{'Server busy fraction:':<40}not measured ({b.get('note', 'no telemetry')[:60]})")
    if "goodput" in m:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in m["slo_ms"].items())
        lines.append(f"{'Goodput (req/s):':<40}{_f(m['goodput'], '{:.3f}')} "
                     f"({m['good_requests']}/{m['completed'] + m['failed']} requests meet {slo})")
    lines.append(f"{'':<14}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}   (ms)")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        d = m[key]
        lines.append(f"{name:<14}" + "".join(f"{_f(d[k], '{:.1f}'):>10}" for k in ("mean", "median", "p90", "p99")))
    if m.get("errors"):
        lines.append(f"errors: {m['errors']}")
    lines.append(f"client load average (1 min): {result.get('load_avg_1m_before')} -> {result.get('load_avg_1m_after')}")
    lines.append("=" * 66)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# the command
# --------------------------------------------------------------------------------------------------
def build_plan(args: argparse.Namespace, tokenizer=None) -> WorkloadPlan:
    """The workload named by ``args.workload`` (generated ones need ``tokenizer``)."""
    wl = args.workload
    if wl in GENERATED:
        words = WordSource(tokenizer)
        if wl == "shared-prefix":
            plan = gen_shared_prefix(words, args.gsp_num_groups, args.gsp_prompts_per_group,
                                     args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len,
                                     args.seed, shuffle=not args.no_shuffle, num_prompts=args.num_prompts)
        elif wl == "random":
            plan = gen_random(words, args.num_prompts or 32, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.seed)
        else:
            plan = gen_multi_turn(words, args.num_prompts or 24, args.mt_turns, args.mt_system_len,
                                  args.mt_user_len, args.mt_output_len, args.seed)
        if args.api == "chat" and wl != "multi-turn":
            for r in plan.items:
                r.messages, r.prompt = [{"role": "user", "content": r.prompt}], None
            plan.api = "chat"
        if args.temperature is not None:
            plan.temperature = args.temperature
        return plan
    plan = load_workload_file(wl, args.prompt_format, args.api, args.seed, not args.no_shuffle, args.num_prompts)
    if args.temperature is not None:
        plan.temperature = args.temperature
    return plan


async def _detect_model(base_url: str, api_key: Optional[str]) -> Optional[str]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=30.0) as c:
            r = await c.get("/v1/models", headers=headers)
            data = r.json().get("data") or []
            return data[0]["id"] if data else None
    except Exception:  # noqa: BLE001
        return None


async def run_benchmark(args: argparse.Namespace) -> tuple[dict, list[RequestResult], float]:
    """Build the workload, scrape telemetry, run, scrape again; returns (result dict, results, start)."""
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
    need_tok = args.workload in GENERATED
    tokenizer = None
    if need_tok or args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    plan = build_plan(args, tokenizer)
    model = args.model or await _detect_model(args.base_url, args.api_key)
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    st = RunSettings(args.base_url, model, args.request_rate, args.max_concurrency, args.seed, args.api_key,
                     args.request_timeout, extra, args.disable_ignore_eos)
    slo = parse_slo(args.slo)
    if args.warmup_requests:
        first = plan.items[0].turns[0] if isinstance(plan.items[0], Session) else plan.items[0]
        wplan = WorkloadPlan("warmup", [dataclasses.replace(first, id="warmup", max_tokens=min(4, first.max_tokens),
                                                            messages=first.messages or (
                                                                [{"role": "user", "content": first.user}]
                                                                if first.user else None))],
                             plan.temperature, plan.ignore_eos, plan.api)
        for _ in range(args.warmup_requests):
            await run_plan(wplan, dataclasses.replace(st, request_rate=math.inf), tokenizer)
        if args.flush_cache:
            import httpx
            async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), timeout=60.0) as c:
                try:
                    await c.post("/flush_cache", headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else None)
                except Exception:  # noqa: BLE001 - another engine may have no such route
                    pass
    trace_offset = None
    if args.trace_file and os.path.exists(args.trace_file):
        trace_offset = os.path.getsize(args.trace_file)  # the engine flushes its trace when it idles
    _log(f"{plan.name}: {plan.num_requests} requests to {args.base_url} (model {model}), rate {args.request_rate}, "
         f"max concurrency {args.max_concurrency or 'unlimited'} (load {load_avg()})")
    load0 = load_avg()
    before = await scrape_telemetry(args.base_url, args.api_key)
    results, start, end = await run_plan(plan, st, tokenizer, progress=not args.quiet)
    after = await scrape_telemetry(args.base_url, args.api_key)
    metrics = compute_metrics(results, end - start, slo)
    busy = busy_over_run(before, after)
    result = {
        "benchmark": "serving",
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "idleless " + " ".join(sys.argv[1:]) if sys.argv[1:3] == ["bench", "serving"] else None,
        "settings": {"base_url": args.base_url, "model": model, "request_rate": args.request_rate,
                     "max_concurrency": args.max_concurrency, "seed": args.seed, "slo": args.slo,
                     "ignore_eos": plan.ignore_eos and not args.disable_ignore_eos,
                     "temperature": plan.temperature},
        "workload": {"name": plan.name, "num_requests": plan.num_requests, "api": plan.api, **plan.info},
        "metrics": metrics,
        "busy": busy,
        "telemetry_before": before, "telemetry_after": after,
        "load_avg_1m_before": load0, "load_avg_1m_after": load_avg(),
        "trace_file": args.trace_file, "trace_offset": trace_offset,
        "requests": request_rows(results, start),
    }
    return result, results, start


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("IDLELESS_API_KEY"))
    p.add_argument("--workload", default="shared-prefix",
                   help="shared-prefix | multi-turn | random | a workload JSON file (or a bare name: "
                        "../shared/workloads/<name>.json)")
    p.add_argument("--api", choices=("completions", "chat"), default="completions",
                   help="endpoint for single-turn workloads (multi-turn is always chat)")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="workload files: send prompt_token_ids (default) or the recorded text")
    p.add_argument("--no-shuffle", action="store_true", help="keep the workload's order (default: shuffled by --seed)")
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer directory for generated prompts and token counts (default: the bundled SmolLM2's)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests to send (default: the whole file / groups x prompts per group / 32 random / 24 turns)")
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=None, help="override the workload's temperature (default 0)")
    p.add_argument("--disable-ignore-eos", action="store_true", help="do not send ignore_eos (servers without it)")
    p.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--slo", default=None, help="goodput bounds, e.g. ttft:2000,tpot:100 (milliseconds)")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--warmup-requests", type=int, default=1, help="untimed requests first (short, 4 tokens)")
    p.add_argument("--flush-cache", action="store_true",
                   help="POST /flush_cache after the warm-up (Idleless, SGLang) so the run starts cold")
    p.add_argument("--output-file", default=None, help="write the result JSON here")
    p.add_argument("--trace-file", default=None,
                   help="the server's --trace-file (same machine): the part written during the run feeds --plot")
    p.add_argument("--plot", default=None, help="write a PNG of the run (needs matplotlib: pip install idleless[plot])")
    p.add_argument("--quiet", action="store_true")
    g = p.add_argument_group("shared-prefix")
    g.add_argument("--gsp-num-groups", type=int, default=4)
    g.add_argument("--gsp-prompts-per-group", type=int, default=8)
    g.add_argument("--gsp-system-prompt-len", type=int, default=512)
    g.add_argument("--gsp-question-len", type=int, default=64)
    g.add_argument("--gsp-output-len", type=int, default=64)
    g = p.add_argument_group("random")
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=64)
    g.add_argument("--random-range-ratio", type=float, default=0.5)
    g = p.add_argument_group("multi-turn")
    g.add_argument("--mt-turns", type=int, default=3)
    g.add_argument("--mt-system-len", type=int, default=128)
    g.add_argument("--mt-user-len", type=int, default=64)
    g.add_argument("--mt-output-len", type=int, default=32)


def main(args: argparse.Namespace) -> int:
    """``idleless bench serving``: run, print the table, write --output-file / --plot. Exit 2 on a
    bad workload or flag, 1 if every request failed."""
    if args.plot:
        from idleless.bench.plot import require_matplotlib
        try:
            require_matplotlib()
        except ImportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        parse_slo(args.slo)
        result, results, start = asyncio.run(run_benchmark(args))
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.output_file:
        out = Path(args.output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    if args.plot:
        from idleless.bench.plot import plot_run
        plot_run(result, args.plot, trace_file=args.trace_file, trace_offset=result.get("trace_offset") or 0)
        print(f"wrote {args.plot}")
    return 0 if result["metrics"]["completed"] else 1
