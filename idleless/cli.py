"""Command line: ``idleless generate | chat | serve | router | bench``.

Every EngineConfig field is a ``--kebab-case`` flag of generate, chat and serve."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from idleless.config import add_cli_args, config_from_args


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="max new tokens (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens up to "
                                                          "this probability mass (default: 1, all)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (default: -1, all)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top token's "
                                                          "probability (default: 0, none)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive logits (multiply negative ones) of tokens already seen (default: 1, off)")
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(args):
    from idleless.engine.request import SamplingParams
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          repetition_penalty=args.repetition_penalty, max_new_tokens=args.max_tokens,
                          seed=args.sample_seed, stop=args.stop)


def cmd_generate(args) -> int:
    from idleless.engine.engine import Engine
    from idleless.engine.request import RequestError
    engine = Engine(config_from_args(args))
    try:
        outs = engine.generate(args.prompt, _params(args), chat=args.chat, use_tqdm=len(args.prompt) > 1)
    except RequestError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    for o in outs:
        print(o.text)
        if args.verbose:
            print(f"[finish_reason={o.finish_reason} prompt_tokens={o.prompt_tokens} "
                  f"cached_tokens={o.cached_tokens} completion_tokens={o.completion_tokens}]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from idleless.engine.engine import Engine
    from idleless.engine.request import RequestError
    engine = Engine(config_from_args(args))
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("idleless chat: type a message, Ctrl-D to quit.", file=sys.stderr)

    async def reply(msgs):
        parts = []
        async for d in engine.generate_stream(msgs, _params(args)):
            print(d.text, end="", flush=True)
            parts.append(d.text)
        print()
        return "".join(parts)

    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            text = asyncio.run(reply(messages))
        except RequestError as e:
            print(f"error: {e.message}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": text})


def cmd_serve(args: argparse.Namespace) -> int:
    """``idleless serve``: run the server until it stops (a module-level function, not a lambda: ``serve
    --dp N`` hands the parsed flags to spawned replica processes, which pickles them)."""
    from idleless.server import launch
    return launch.exit_process(launch.main(args) or 0)


def build_parser() -> argparse.ArgumentParser:
    """The ``idleless`` parser with its subcommands (each sets ``func`` to its entry point)."""
    parser = argparse.ArgumentParser(prog="idleless", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions offline")
    g.add_argument("prompt", nargs="+", help="prompt text (several for a batch)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("-v", "--verbose", action="store_true",
                   help="print finish reason and token counts of each output to stderr")
    _sampling_args(g)
    add_cli_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive streaming chat")
    c.add_argument("--system", default=None, help="system prompt")
    _sampling_args(c)
    add_cli_args(c)
    c.set_defaults(func=cmd_chat)

    from idleless.server import launch
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    launch.add_args(s)
    s.set_defaults(func=cmd_serve)

    from idleless.router import launch as router_launch
    r = sub.add_parser("router", help="cache-aware router in front of engine replicas (loads no model)")
    router_launch.add_args(r)
    r.set_defaults(func=router_launch.main)

    from idleless.bench import cli as bench_cli
    b = sub.add_parser("bench", help="benchmarks")
    bench_cli.add_args(b)
    b.set_defaults(func=bench_cli.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
