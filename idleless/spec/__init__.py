"""idleless.spec: speculative decoding. Proposers attach to the scheduler (``Proposer``); the verify
step is an ordinary extend and acceptance happens in ``Scheduler.commit``."""
