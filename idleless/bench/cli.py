"""``idleless bench <subcommand>``: benchmarks.

    idleless bench offline --workload ../shared/workloads/shared_prefix.json [--compare] [--decode-batch1]
    idleless bench determinism --dtype bfloat16 --enable-deterministic-inference [--url http://host:port]
    idleless bench spec [--workload W ...] [--algorithms ngram,draft] [--batch1-requests N] [--output result.json]
    idleless bench make-copy-workload --output benchmarks/workloads/copy_heavy.json
    idleless bench precision | router | pd | rl-update   (issues 14, 17, 18, 16)
    idleless bench compare-serving --vllm-venv DIR | stream-cost   (issue 15)

Subcommands register here: each module has ``add_args(parser)`` and ``main(args) -> int``.
"""

from __future__ import annotations

import argparse


def add_args(parser: argparse.ArgumentParser) -> None:
    """Add the bench subcommands to the ``idleless bench`` parser."""
    from idleless.bench import offline

    sub = parser.add_subparsers(dest="bench_command", metavar="{offline,serving,compare,plot,determinism,policies,chunked-prefill,eviction,spec,make-copy-workload,"
                                "precision,router,pd,rl-update,compare-serving,stream-cost}", required=True)
    o = sub.add_parser("offline", help="offline throughput on a workload file (Engine in-process)",
                       description=offline.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    offline.add_args(o)
    o.set_defaults(bench_main=offline.main)
    from idleless.bench import scheduling  # issue 4: policies, chunked-prefill, eviction
    scheduling.register(sub)
    from idleless.bench import compare, plot, serving  # issue 5: serving client, baselines side by side, plots
    from idleless.bench import determinism  # issue 11: one prompt under 16 batch compositions
    from idleless.bench import copy_workload, spec  # issue 13: speculative decoding on vs off
    from idleless.bench import pd, precision  # issues 14 and 18
    from idleless.bench import router as router_bench  # issue 17
    from idleless.rl import bench as rl_bench  # issue 16
    for name, mod, helptext in (("serving", serving, "load an OpenAI-compatible server over HTTP (TTFT, TPOT, ITL, goodput, busy fraction)"),
                                ("compare", compare, "one workload through Idleless, radix off, transformers, llama.cpp, vLLM"),
                                ("plot", plot, "PNG of a run from an engine trace file and/or a serving result"),
                                ("determinism", determinism, "distinct outputs of one greedy prompt under 16 batch compositions (target 1)"),
                                ("spec", spec, "speculative decoding off vs each algorithm: batch-1 decode tok/s, workload wall time, acceptance"),
                                ("make-copy-workload", copy_workload, "build the copy-heavy workload JSON from Python's standard library"),
                                ("precision", precision, "every weight/activation/KV precision against the float model: KL, perplexity, speed, bytes"),
                                ("router", router_bench, "routing policies side by side over engine replicas: hits vs the oracle, throughput, TTFT"),
                                ("pd", pd, "colocated vs prefill/decode disaggregation through HTTP: TTFT, ITL, goodput, KV transfer rate"),
                                ("rl-update", rl_bench, "weight pushes into a live server: disk, shared-memory tensors, gloo broadcast")):
        p = sub.add_parser(name, help=helptext, description=mod.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_args(p)
        p.set_defaults(bench_main=mod.main)
    from idleless.bench import compare_serving  # issue 15: Idleless vs vLLM-CPU through HTTP, one server at a time
    p = sub.add_parser("compare-serving", help="idleless serve and vLLM-CPU's server side by side: bench serving and guidellm at each concurrency",
                       description=compare_serving.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    compare_serving.add_args(p)
    p.set_defaults(bench_main=compare_serving.main)
    from idleless.bench import stream_cost  # issue 15 item 4: a streamed token's cost, engine core to client
    p = sub.add_parser("stream-cost", help="CPU per streamed token by stage (serialise, ZMQ, detokenize, SSE, HTTP) "
                       "at N concurrent streams, over a replay engine core", description=stream_cost.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    stream_cost.add_args(p)
    p.set_defaults(bench_main=stream_cost.main)


def main(args: argparse.Namespace) -> int:
    """Run the chosen bench subcommand; returns its exit code."""
    return args.bench_main(args)
