"""What constraints cost: ``python -m idleless.structured.bench [--model DIR] [--threads N]``.

Prints, for the bundled SmolLM2 (float32) unless ``--model`` is given: grammar compile time (first
compile and a cache hit) per constraint kind; the mask fill time per generated token (xgrammar's
``fill_next_token_bitmask`` over a JSON-schema output); and output tokens/s of JSON-schema requests
against free ones at batch 1 and batch 32 (offline ``EngineCore``, greedy, 48 new tokens at most per
request; the constrained ones end when their JSON does). Wall-clock seconds from ``time.perf_counter``.
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                          "maxItems": 4}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}


def _rate(core, reqs) -> tuple[int, float]:
    """(output tokens, seconds) to run ``reqs`` to the end on ``core``."""
    for r in reqs:
        core.add_request(r)
    n = 0
    t0 = time.perf_counter()
    while core.has_work():
        n += sum(len(o.new_token_ids) for o in core.step())
    return n, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    import xgrammar as xgr

    from idleless.config import EngineConfig
    from idleless.engine.core import EngineCore
    from idleless.engine.request import Request, SamplingParams
    from idleless.model.loader import prepare_model_dir
    from idleless.structured import StructuredOutput
    from idleless.structured.grammar import GrammarCache
    from idleless.text.tokenizer import Tokenizer

    model = prepare_model_dir(args.model)
    tok = Tokenizer.load(model)
    core = EngineCore(EngineConfig(model=model, dtype="float32", kv_cache_memory="512MiB", num_threads=args.threads))
    V = core.runner.model_config.vocab_size
    cache = GrammarCache(model, V)
    cache.get(StructuredOutput("json_object")).result()  # loads the tokenizer info once
    specs = {"json_schema": StructuredOutput.of_json_schema(SCHEMA), "regex": StructuredOutput("regex", r"[a-z]{3,8}-\d{4}"),
             "choice": StructuredOutput.of_choice(["alpha", "beta", "gamma"]),
             "ebnf": StructuredOutput("ebnf", 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"')}
    print("compile (ms): kind, first, cached")
    for kind, spec in specs.items():
        t0 = time.perf_counter()
        cache.get(spec).result()
        t1 = time.perf_counter()
        cache.get(spec).result()
        print(f"  {kind:12s} {1e3 * (t1 - t0):8.2f} {1e3 * (time.perf_counter() - t1):8.4f}")

    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    free = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_new_tokens=48, structured_output=specs["json_schema"])
    probe_ids = []  # one constrained output (it also warms the engine's own grammar cache up)
    core.add_request(Request("probe", prompt, constrained))
    while core.has_work():
        for o in core.step():
            probe_ids += o.new_token_ids
    matcher = xgr.GrammarMatcher(cache.get(specs["json_schema"]).result())
    bitmask = xgr.allocate_token_bitmask(1, V)
    t0 = time.perf_counter()
    for t in probe_ids[:-1]:
        matcher.fill_next_token_bitmask(bitmask)
        matcher.accept_token(t)
    per = (time.perf_counter() - t0) / max(1, len(probe_ids) - 1)
    print(f"mask fill + accept per token: {1e6 * per:.1f} us over {len(probe_ids) - 1} tokens of a JSON-schema output")

    print("output tokens/s: batch, free, json_schema, ratio")
    for batch in (1, 32):
        rates = []
        for params in (free, constrained):
            core.flush_cache()
            n, s = _rate(core, [Request(f"b{batch}-{i}-{params is free}", prompt + [i % 7 + 100], params)
                                for i in range(batch)])
            rates.append(n / s)
        print(f"  {batch:3d} {rates[0]:8.1f} {rates[1]:8.1f} {rates[1] / rates[0]:6.2f}")
    print(json.dumps({"example_output": tok.decode(probe_ids)}))


if __name__ == "__main__":
    main()
