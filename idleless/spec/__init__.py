"""idleless.spec: speculative decoding. Proposers attach to the scheduler (``Proposer``); the verify
step is an ordinary extend and acceptance happens in ``Scheduler.commit``.

``make_proposer(config, runner)`` builds what ``--speculative-algorithm`` names: ``ngram``
(``ngram.NgramProposer``: prompt lookup + a suffix index over recent outputs) or ``draft``
(``draft.DraftModelProposer``: a smaller model with its own KV pool and radix cache, or the target
itself at ``--speculative-draft-weight-dtype`` int4/int8/fp8, the self-draft), wrapped in
``adaptive.AdaptiveProposer`` (per-request draft length from an acceptance EMA, and speculation
switched off for a step when a cost model measured in process CPU time says plain decoding is faster;
``prime.prime`` measures its step costs' shape at start-up)."""

from __future__ import annotations

from idleless.spec.proposer import Proposer


def make_proposer(config, runner) -> Proposer:
    """The proposer ``config.speculative_algorithm`` names (the base ``Proposer`` when None).
    ``runner``: the target's ModelRunner (``model_config``, ``context_length``, ``dtype``). Raises
    ValueError for a bad configuration (a draft model with another vocabulary, a draft longer than
    the context)."""
    algo = config.speculative_algorithm
    if algo is None:
        return Proposer()
    if config.speculative_num_draft_tokens >= runner.context_length:
        raise ValueError(f"speculative_num_draft_tokens ({config.speculative_num_draft_tokens}) must be below "
                         f"the context length ({runner.context_length})")
    if algo == "ngram":
        from idleless.spec.ngram import NgramProposer
        inner = NgramProposer(config.speculative_ngram_min_match_window_size,
                              config.speculative_ngram_max_match_window_size)
    else:
        from idleless.spec.draft import DraftModelProposer
        inner = DraftModelProposer(config, runner)
    import time

    import torch

    from idleless.spec.adaptive import AdaptiveProposer
    # costs in process CPU time (adaptive.AdaptiveProposer: wall time on a shared machine measures the load)
    from idleless.spec.prime import prime
    ctl = AdaptiveProposer(inner, config.speculative_num_draft_tokens,
                           adaptive=not config.speculative_disable_adaptive, clock=time.process_time,
                           clock_threads=torch.get_num_threads())
    prime(ctl, runner)  # start-up step costs: verifies and draft steps judged before any is tried
    return ctl
