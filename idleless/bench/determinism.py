"""``idleless bench determinism``: one greedy prompt under 16 batch compositions; how many distinct
outputs came back (the target is 1).

    idleless bench determinism --dtype bfloat16     # in-process Engine (--disable-deterministic-inference: the other kernels)
    idleless bench determinism --url http://127.0.0.1:30000 --output det.json        # a running server

The probe: one chat prompt (``--prompt``, default a short paragraph about Richard Feynman and a
question on it, wrapped in the model's chat template; ``--raw-prompt`` sends the text as is),
greedy, ``--max-tokens`` (32) new tokens with eos ignored, the sampled token's logprob returned.
One *output* is the probe's generated tokens with their logprobs; two outputs are the same when
every token and every logprob are bitwise equal (logprobs compared as ``float.hex``). In-process
the tokens are ids; over HTTP they are the ``logprobs.tokens`` pieces of ``/v1/completions``.

The 16 trials, in three modes borrowed from SGLang's ``python -m sglang.test.test_deterministic``
(single: the prompt alone or beside copies of itself; mixed: beside unrelated prompts; prefix:
beside prompts sharing a prefix with it). Every trial starts from an empty prefix cache (POST
``/flush_cache`` over HTTP), may first run *warm-up* prompts (1 token each, not counted) so part of
the probe's prompt is cached, then submits its batch at once:

    single  alone | alone, its prompt cached | as n=3 | 4 copies in one batch
    mixed   beside 1 (first) | 3 (last) | 7 (middle) | 15 (first) | 15 (last) other prompts;
            arriving while 15 others decode (sent once one of them has its first token)
    prefix  half its prompt cached | beside 3 sharing half of it (last) | beside 7 sharing 1/4, 1/2,
            3/4 and all but one token (middle) | beside 8 sharing and 7 unrelated (middle) | its
            prompt cached, beside 15 sharing | as n=3 beside 7 sharing

Other prompts are slices of a fixed filler text (12 to 480 tokens), some behind a prefix of the
probe's prompt; half are greedy, half sampled at temperature 0.8 with their own seed; they ask for
4 to 32 new tokens, so the batch shrinks and grows while the probe decodes.

Targets: without ``--url``, the offline ``Engine`` in this process, built from the usual engine
flags (``--model``, ``--dtype``, ``--enable-deterministic-inference``, ...; trials submit through
``Engine.generate``, the arriving-late one from a second thread). With ``--url``, a running
OpenAI-compatible server (``idleless serve``; vLLM and SGLang have the same routes): prompts are
token ids from its ``/tokenize`` (chat ``messages`` for the probe), the requests of a trial go to
``/v1/completions`` concurrently, the model name is ``--model`` or the first of ``/v1/models``.

Output: one table per mode (each trial: batch size, probe samples, equal to the trial "alone" or
where it first differs), the number of distinct outputs over all samples and ``deterministic:
yes/no``; ``--output FILE`` writes the JSON (settings, trials, the distinct outputs with their
counts). The exit status is 0 whatever the count (it is a measurement); 2 when the target cannot be
used (no server, a refused request, a flush refused).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as _dt
import json
import os
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

DEFAULT_PROMPT = (
    "Richard Feynman was an American theoretical physicist, known for the path integral formulation of "
    "quantum mechanics, the theory of quantum electrodynamics and the physics of superfluid liquid helium. "
    "He shared the 1965 Nobel Prize in Physics with Julian Schwinger and Shin'ichiro Tomonaga, worked on "
    "the atomic bomb during the Second World War, and became known to a wide public through his books and "
    "lectures. Using only this paragraph, tell me about Richard Feynman in three sentences.")
MODES = ("single", "mixed", "prefix")
OTHER_LENGTHS = (12, 40, 96, 200, 24, 320, 60, 480)  # filler tokens of the other prompts, cycled
FILLER_WORDS = (
    "the river morning light garden stone window quiet market music paper island winter letter bridge "
    "people city forest summer number yellow green story history table simple kitchen village harbor "
    "mountain careful system engine station morning evening weather travel coffee bread school teacher "
    "student answer question little large small ancient modern north south east west road field cloud "
    "rain snow wind fire water earth metal glass wooden silver golden animal bird horse fish dog cat"
).split()
FILLER_NUM_WORDS = 900  # enough for the longest slice (480 tokens) at any of the offsets used


def _log(msg: str) -> None:
    print(f"[bench determinism] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# the trials
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Entry:
    """One request of a trial: prompt token ids, new tokens, temperature (0 = greedy), sampling
    seed, choices ``n``; ``probe`` marks the request whose outputs are compared."""

    ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    seed: Optional[int] = None
    n: int = 1
    probe: bool = False


@dataclass
class Trial:
    """One batch composition. ``warm``: prompts run first (1 new token each, outputs ignored) so
    their KV is cached; ``batch``: submitted together after them; ``late``: the probe (the last
    entry) is submitted only once one of the others has its first token (it joins a decoding batch)."""

    name: str
    mode: str
    batch: list[Entry]
    warm: list[tuple[int, ...]] = field(default_factory=list)
    late: bool = False

    @property
    def probe_samples(self) -> int:
        """Probe outputs this trial yields (the probe's n, summed over its copies)."""
        return sum(e.n for e in self.batch if e.probe)


def filler_text(seed: int = 0) -> str:
    """The text the other prompts are cut from: FILLER_NUM_WORDS words drawn from FILLER_WORDS by
    ``random.Random(seed)``, in sentences of 12 words."""
    rng = random.Random(seed)
    words = [rng.choice(FILLER_WORDS) for _ in range(FILLER_NUM_WORDS)]
    return " ".join(" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, len(words), 12))


def build_trials(probe_ids: Sequence[int], filler_ids: Sequence[int], max_tokens: int) -> list[Trial]:
    """The 16 trials (see the module docstring) for a probe prompt of token ids ``probe_ids``; other
    prompts are slices of ``filler_ids`` (at least 600 ids), optionally behind a prefix of the probe.
    Raises ValueError when the probe has fewer than 4 tokens or the filler fewer than 600."""
    probe_ids, filler_ids = tuple(probe_ids), tuple(filler_ids)
    lp = len(probe_ids)
    if lp < 4:
        raise ValueError(f"the probe prompt has {lp} tokens; at least 4 are needed to share parts of it")
    if len(filler_ids) < 600:
        raise ValueError(f"the filler text has {len(filler_ids)} tokens; at least 600 are needed")
    probe = Entry(probe_ids, max_tokens, probe=True)

    def other(i: int, share: int = 0) -> Entry:
        length = OTHER_LENGTHS[i % len(OTHER_LENGTHS)]
        start = (37 * i) % (len(filler_ids) - length)
        sampled = i % 2 == 1
        return Entry(probe_ids[:share] + filler_ids[start:start + length], 4 + (7 * i) % 29,
                     temperature=0.8 if sampled else 0.0, seed=1000 + i if sampled else None)

    def others(k: int, shares: Sequence[int] = (0,)) -> list[Entry]:
        return [other(i, shares[i % len(shares)]) for i in range(k)]

    half = lp // 2
    quarters = (lp // 4, half, 3 * lp // 4, lp - 1)
    o7, o15, s7 = others(7), others(15), others(7, quarters)
    return [
        Trial("alone", "single", [probe]),
        Trial("alone, its prompt cached", "single", [probe], warm=[probe_ids]),
        Trial("as n=3", "single", [dataclasses.replace(probe, n=3)]),
        Trial("4 copies in one batch", "single", [probe] * 4),
        Trial("beside 1 other (first)", "mixed", [probe] + others(1)),
        Trial("beside 3 others (last)", "mixed", others(3) + [probe]),
        Trial("beside 7 others (middle)", "mixed", o7[:3] + [probe] + o7[3:]),
        Trial("beside 15 others (first)", "mixed", [probe] + o15),
        Trial("beside 15 others (last)", "mixed", o15 + [probe]),
        Trial("joins 15 others decoding", "mixed", o15 + [probe], late=True),
        Trial("half its prompt cached", "prefix", [probe], warm=[probe_ids[:half]]),
        Trial("beside 3 sharing half (last)", "prefix", others(3, (half,)) + [probe]),
        Trial("beside 7 sharing 1/4..all-but-1 (middle)", "prefix", s7[:3] + [probe] + s7[3:]),
        Trial("beside 8 sharing + 7 unrelated (middle)", "prefix", s7[:4] + [probe] + s7[4:] + [other(7, lp - 1)]
              + o15[8:]),
        Trial("its prompt cached, beside 15 sharing", "prefix", [probe] + others(15, quarters), warm=[probe_ids]),
        Trial("as n=3 beside 7 sharing", "prefix", others(7, (half, lp - 1)) + [dataclasses.replace(probe, n=3)]),
    ]


# --------------------------------------------------------------------------------------------------
# outputs
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One probe output: its tokens (ids in-process, pieces over HTTP) and their logprobs."""

    tokens: tuple
    logprobs: tuple[float, ...]

    def key(self) -> tuple:
        """Bitwise identity: the tokens and each logprob's ``float.hex`` (so -0.0 != 0.0 and NaNs compare)."""
        return self.tokens, tuple(float(x).hex() for x in self.logprobs)


def compare(ref: Sample, s: Sample) -> dict:
    """How ``s`` differs from ``ref``: ``equal`` (bitwise), ``first_diff`` (the first token index
    where the token or its logprob bits differ; None if equal), ``first_token_diff`` (the first
    index where the tokens differ, or where one output ends; None if the tokens are equal) and
    ``max_abs_logprob_diff`` over the positions before ``first_token_diff``."""
    n = min(len(ref.tokens), len(s.tokens))
    first_tok = next((i for i in range(n) if ref.tokens[i] != s.tokens[i]),
                     None if len(ref.tokens) == len(s.tokens) else n)
    upto = n if first_tok is None else first_tok
    rk, sk = ref.key()[1], s.key()[1]
    first = next((i for i in range(upto) if rk[i] != sk[i]), first_tok)
    diffs = [abs(ref.logprobs[i] - s.logprobs[i]) for i in range(min(upto, len(ref.logprobs), len(s.logprobs)))]
    return {"equal": ref.key() == s.key(), "first_diff": first, "first_token_diff": first_tok,
            "max_abs_logprob_diff": max(diffs, default=0.0)}


def summarize(trials: Sequence[Trial], samples: Sequence[Sequence[Sample]]) -> dict:
    """Count distinct outputs: overall, per mode and per trial, each trial's samples compared with
    the first sample of the first trial (``alone``). ``samples[i]``: trial i's probe outputs."""
    ref = samples[0][0]
    distinct: dict[tuple, dict] = {}
    rows, modes = [], {}
    for t, ss in zip(trials, samples):
        cmp = [compare(ref, s) for s in ss]
        firsts = [c["first_diff"] for c in cmp if c["first_diff"] is not None]
        rows.append({"name": t.name, "mode": t.mode, "batch_requests": len(t.batch),
                     "batch_sequences": sum(e.n for e in t.batch), "warm_prompts": len(t.warm), "late": t.late,
                     "samples": len(ss), "distinct": len({s.key() for s in ss}),
                     "equal_to_alone": sum(c["equal"] for c in cmp),
                     "first_diff": min(firsts) if firsts else None,
                     "max_abs_logprob_diff": max(c["max_abs_logprob_diff"] for c in cmp)})
        m = modes.setdefault(t.mode, {"trials": 0, "samples": 0, "keys": set()})
        m["trials"] += 1
        m["samples"] += len(ss)
        for s in ss:
            m["keys"].add(s.key())
            d = distinct.setdefault(s.key(), {"tokens": list(s.tokens), "logprobs": list(s.logprobs),
                                             "count": 0, "trials": []})
            d["count"] += 1
            if t.name not in d["trials"]:
                d["trials"].append(t.name)
    per_mode = {k: {"trials": v["trials"], "samples": v["samples"], "distinct": len(v["keys"])}
                for k, v in modes.items()}
    return {"total_samples": sum(len(ss) for ss in samples), "distinct_outputs": len(distinct),
            "deterministic": len(distinct) == 1, "modes": per_mode, "trials": rows,
            "outputs": sorted(distinct.values(), key=lambda d: -d["count"])}


# --------------------------------------------------------------------------------------------------
# targets
# --------------------------------------------------------------------------------------------------
class TargetError(RuntimeError):
    """The target refused or failed (a request error, an HTTP status, a flush refused)."""


class OfflineTarget:
    """The in-process ``Engine``: a trial's batch goes through one ``Engine.generate`` call."""

    def __init__(self, engine):
        self.engine = engine
        self.flush_available = True

    def tokenize(self, prompt: str, chat: bool) -> list[int]:
        """The probe's ids: ``prompt`` as one user message in the chat template (or plain text)."""
        return self.engine.encode_prompt(prompt, chat=chat)

    def tokenize_text(self, text: str) -> list[int]:
        """Plain text -> ids with the engine's tokenizer (the filler)."""
        return self.engine.tokenizer.encode(text)

    def _params(self, e: Entry):
        from idleless.engine.request import SamplingParams

        return SamplingParams(temperature=e.temperature, seed=e.seed, max_new_tokens=e.max_tokens, n=e.n,
                              ignore_eos=True, logprobs=e.probe)

    def _generate(self, entries: Sequence[Entry]) -> list[list]:
        """Outputs of ``entries`` submitted at once; each a list of its n CompletionOutputs."""
        from idleless.engine.request import RequestError

        try:
            outs = self.engine.generate([list(e.ids) for e in entries], [self._params(e) for e in entries],
                                        use_tqdm=False)
        except RequestError as e:
            raise TargetError(f"the engine refused a request: {e.message}") from e
        return [o if isinstance(o, list) else [o] for o in outs]

    def run(self, trial: Trial) -> list[Sample]:
        """Flush, warm, run the batch; the probe's outputs in batch order. Raises TargetError."""
        if not self.engine.flush_cache():
            raise TargetError("the engine refused to flush its cache (requests still running)")
        if trial.warm:
            self._generate([Entry(w, 1) for w in trial.warm])
        if not trial.late:
            groups = self._generate(trial.batch)
        else:
            groups = self._run_late(trial.batch[:-1], trial.batch[-1])
        return [_sample_of(o) for e, g in zip(trial.batch, groups) if e.probe for o in g]

    def _run_late(self, others: Sequence[Entry], probe: Entry) -> list[list]:
        """``others`` stepped by a second thread; ``probe`` submitted once one of them has a token."""
        box: dict[str, Any] = {}
        before = self.engine.stats()["generation_tokens"]

        def run_others():
            try:
                box["out"] = self._generate(others)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                box["err"] = e

        th = threading.Thread(target=run_others, name="determinism-others", daemon=True)
        th.start()
        while th.is_alive() and self.engine.stats()["generation_tokens"] == before:
            time.sleep(0.0005)
        probe_out = self._generate([probe])
        th.join()
        if "err" in box:
            raise box["err"]
        return box["out"] + probe_out


def _sample_of(o) -> Sample:
    return Sample(tuple(o.token_ids), tuple(o.logprobs or ()))


class HttpTarget:
    """A running OpenAI-compatible server: ``/tokenize``, ``/flush_cache`` and concurrent
    ``/v1/completions`` with token-id prompts."""

    def __init__(self, url: str, model: Optional[str], api_key: Optional[str], timeout: float):
        import logging

        self.url = url.rstrip("/")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per request
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.model = model or self._sync(self._detect_model())
        self.flush_available = True

    def _sync(self, coro):
        """Run ``coro`` to completion; an httpx error (no connection, a timeout) becomes TargetError."""
        import httpx

        try:
            return asyncio.run(coro)
        except httpx.HTTPError as e:
            raise TargetError(f"{self.url}: {e!r}") from e

    def _client(self):
        import httpx

        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=self.timeout)

    async def _detect_model(self) -> Optional[str]:
        async with self._client() as c:
            r = await c.get("/v1/models")
            _check(r, "GET /v1/models")
            data = r.json().get("data") or []
            return data[0]["id"] if data else None

    def _tokenize(self, body: dict) -> list[int]:
        async def go():
            async with self._client() as c:
                r = await c.post("/tokenize", json={"model": self.model, **body})
                _check(r, "POST /tokenize")
                return list(r.json()["tokens"])
        return self._sync(go())

    def tokenize(self, prompt: str, chat: bool) -> list[int]:
        """The probe's ids from the server's ``/tokenize`` (chat ``messages`` with the generation prompt)."""
        if chat:
            return self._tokenize({"messages": [{"role": "user", "content": prompt}], "add_generation_prompt": True})
        return self._tokenize({"prompt": prompt})

    def tokenize_text(self, text: str) -> list[int]:
        """Plain text -> ids from the server's ``/tokenize``, without special tokens (the filler)."""
        return self._tokenize({"prompt": text, "add_special_tokens": False})

    def _body(self, e: Entry, stream: bool = False) -> dict:
        body = {"model": self.model, "prompt": list(e.ids), "max_tokens": e.max_tokens, "temperature": e.temperature,
                "n": e.n, "ignore_eos": True}
        if e.seed is not None:
            body["seed"] = e.seed
        if e.probe:
            body["logprobs"] = 0
        if stream:
            body["stream"] = True
        return body

    async def _flush(self, c) -> None:
        if not self.flush_available:
            return
        r = await c.post("/flush_cache")
        if r.status_code == 404:
            self.flush_available = False
            _log("the server has no POST /flush_cache: trials run on whatever it has cached")
            return
        _check(r, "POST /flush_cache")

    async def _complete(self, c, e: Entry) -> list[Sample]:
        r = await c.post("/v1/completions", json=self._body(e))
        _check(r, "POST /v1/completions")
        choices = sorted(r.json()["choices"], key=lambda ch: ch.get("index", 0))
        if not e.probe:
            return []
        out = []
        for ch in choices:
            lp = ch.get("logprobs") or {}
            out.append(Sample(tuple(lp.get("tokens") or ()), tuple(lp.get("token_logprobs") or ())))
        return out

    async def _stream_other(self, c, e: Entry, first: asyncio.Event) -> list[Sample]:
        try:
            async with c.stream("POST", "/v1/completions", json=self._body(e, stream=True)) as r:
                if r.status_code != 200:
                    await r.aread()
                    _check(r, "POST /v1/completions (stream)")
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line.strip() != "data: [DONE]":
                        first.set()
        finally:
            first.set()  # never leave the probe waiting on a failed request
        return []

    async def _run(self, trial: Trial) -> list[Sample]:
        async with self._client() as c:
            await self._flush(c)
            if trial.warm:
                await asyncio.gather(*(self._complete(c, Entry(w, 1)) for w in trial.warm))
            if not trial.late:
                groups = await asyncio.gather(*(self._complete(c, e) for e in trial.batch))
            else:
                first = asyncio.Event()
                tasks = [asyncio.create_task(self._stream_other(c, e, first)) for e in trial.batch[:-1]]
                await first.wait()
                groups = [*await asyncio.gather(*tasks), await self._complete(c, trial.batch[-1])]
        return [s for g in groups for s in g]

    def run(self, trial: Trial) -> list[Sample]:
        """Flush, warm, run the batch concurrently; the probe's outputs in batch order. Raises
        TargetError (an HTTP error status) or httpx.HTTPError (no connection)."""
        return self._sync(self._run(trial))


def _check(r, what: str) -> None:
    if r.status_code != 200:
        raise TargetError(f"{what}: HTTP {r.status_code}: {r.text[:300]}")


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
def run_trials(target, prompt: str, chat: bool, max_tokens: int) -> dict:
    """Tokenize the probe and the filler with ``target``, run the 16 trials, summarize. Returns the
    result dict (``summarize``'s plus the probe's settings). Raises TargetError, ValueError."""
    probe_ids = target.tokenize(prompt, chat)
    filler_ids = target.tokenize_text(filler_text())
    trials = build_trials(probe_ids, filler_ids, max_tokens)
    samples = []
    for i, t in enumerate(trials):
        t0 = time.perf_counter()
        ss = target.run(t)
        if len(ss) != t.probe_samples:
            raise TargetError(f"trial {t.name!r}: {len(ss)} probe outputs came back, {t.probe_samples} expected")
        samples.append(ss)
        _log(f"{i + 1:2d}/{len(trials)} {t.name}: {len(ss)} sample(s) in {time.perf_counter() - t0:.1f} s")
    result = summarize(trials, samples)
    result["probe"] = {"prompt": prompt, "chat_template": chat, "prompt_tokens": len(probe_ids),
                       "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    result["cache_flushed_per_trial"] = target.flush_available
    return result


def format_report(r: dict) -> str:
    """One table per mode (a row per trial), then the distinct count and the verdict."""
    lines = [f"idleless bench determinism: {r['target']}; probe {r['probe']['prompt_tokens']} prompt tokens, "
             f"{r['probe']['max_tokens']} greedy tokens with logprobs"]
    for mode in MODES:
        rows = [t for t in r["trials"] if t["mode"] == mode]
        if not rows:
            continue
        m = r["modes"][mode]
        lines += ["", f"{mode}: {m['trials']} trials, {m['samples']} samples, {m['distinct']} distinct",
                  f"  {'trial':<42}{'batch':>6}{'samples':>8}{'same as alone':>15}  first diff"]
        for t in rows:
            diff = "-" if t["first_diff"] is None else \
                f"token {t['first_diff']} (max |dlogprob| {t['max_abs_logprob_diff']:.3g})"
            lines.append(f"  {t['name']:<42}{t['batch_sequences']:>6}{t['samples']:>8}"
                         f"{t['equal_to_alone']:>9}/{t['samples']:<5}  {diff}")
    lines += ["", f"distinct outputs: {r['distinct_outputs']} of {r['total_samples']} samples (target 1)",
              f"deterministic: {'yes' if r['deterministic'] else 'no'}"]
    if not r.get("cache_flushed_per_trial", True):
        lines.append("note: the server has no /flush_cache; trials did not start from an empty cache")
    return "\n".join(lines)


def _write(result: dict, path: str) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out)


def run(args: argparse.Namespace) -> dict:
    """Build the target from ``args`` (``--url`` or the engine flags), run, return the result
    dict that ``--output`` writes. Raises TargetError, ValueError, OSError (httpx errors included)."""
    from idleless.bench.offline import _host_info, load_avg

    result: dict[str, Any] = {
        "benchmark": "determinism",
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "idleless " + " ".join(sys.argv[1:]) if sys.argv[1:3] == ["bench", "determinism"] else None,
        "load_avg_1m_start": load_avg(),
    }
    if args.url:
        target = HttpTarget(args.url, args.model, args.api_key, args.request_timeout)
        result["target"] = f"{args.url} (model {target.model})"
    else:
        from idleless.config import config_from_args
        from idleless.engine.engine import Engine

        config = config_from_args(args)
        _log(f"loading the engine (dtype {config.dtype}, deterministic {config.enable_deterministic_inference})")
        engine = Engine(config)
        target = OfflineTarget(engine)
        dtype = str(engine.core.runner.dtype).replace("torch.", "")
        det = "on" if engine.core.runner.deterministic else "off"
        result["target"] = f"offline Engine, {dtype}, deterministic inference {det}"
        result["engine_config"] = dataclasses.asdict(config)
        result["host"] = _host_info()
    result.update(run_trials(target, args.prompt, not args.raw_prompt, args.max_tokens))
    result["load_avg_1m_end"] = load_avg()
    return result


def add_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``idleless bench determinism``: its own plus every EngineConfig field (used
    in-process; with ``--url`` only ``--model`` is read, as the model name to send)."""
    from idleless.config import add_cli_args

    parser.add_argument("--url", default=None,
                        help="a running server's root (http://host:port); default: the offline Engine in-process")
    parser.add_argument("--api-key", default=os.environ.get("IDLELESS_API_KEY"), help="with --url: the bearer key")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="with --url: seconds per HTTP request")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the probe's user message")
    parser.add_argument("--raw-prompt", action="store_true", help="send --prompt as plain text, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens of the probe (greedy, eos ignored)")
    parser.add_argument("--output", default=None, help="write the result JSON here")
    add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    """Run, print the report, write ``--output``. 0 whatever the count; 2 if the target fails."""
    if args.max_tokens < 1:
        print("error: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except (TargetError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(result))
    if args.output:
        _write(result, args.output)
        print(f"wrote {args.output}")
    return 0
