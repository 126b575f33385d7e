"""Per-request sampling and stopping settings: a plain parameter record shared by the frontend,
the engine core and the sampler (which must not depend on engine state)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from idleless.errors import RequestError

if TYPE_CHECKING:
    from idleless.structured.spec import StructuredOutput

MAX_LOGPROBS = 20  # alternatives per position (top_logprobs, prompt_logprobs): vLLM's default max_logprobs
LOGIT_BIAS_MAX = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings.

    temperature: 0 means greedy (argmax). top_k <= 0 (or -1) disables top-k; top_p = 1 and
    min_p = 0 disable nucleus and min-p truncation. Penalties follow OpenAI (frequency/presence,
    over generated tokens, additive on logits) and HF (repetition, over prompt + generated tokens,
    divides positive logits / multiplies negative ones; CTRL paper, arXiv 1909.05858).
    max_new_tokens: None means "up to the context length"; 0 prefills the prompt (its KV computed and cached) and generates nothing. seed: a per-request torch.Generator
    so that the same seed gives the same tokens whatever else is in the batch.
    stop: stop strings (checked by the frontend on text); stop_token_ids: checked by the engine.
    logprobs: return the sampled token's logprob; top_logprobs: also the k most likely tokens.
    prompt_logprobs (vLLM's): None = off; k >= 0 returns, for every prompt token from position
    ``prompt_logprobs_start`` on (SGLang's ``logprob_start_len``), its logprob given the tokens before
    it, its rank and the k most likely tokens there; position 0 has none (its entry is None).
    Logprobs are the model's raw log-softmax (before penalties/temperature/truncation). At most
    MAX_LOGPROBS alternatives per position (vLLM's default cap).
    logit_bias (OpenAI's): token id -> a bias in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] added to that token's
    logit before penalties, temperature and truncation (-100 in effect bans a token, +100 in effect forces
    it); None or {} for none. It changes the choice, not the reported logprobs (raw, as above).
    structured_output: a constraint on the output (JSON schema, regex, choice, EBNF grammar;
    ``idleless.structured``) the sampler enforces with a token mask; None for none.
    Like logit_bias it changes the choice, not the reported logprobs.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: Optional[int] = None
    prompt_logprobs_start: int = 0
    n: int = 1
    logit_bias: Optional[dict[int, float]] = None
    structured_output: Optional["StructuredOutput"] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 are greedy (vLLM's _SAMPLING_EPS): dividing by them overflows."""
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise RequestError (with ``param``) on any out-of-range value; NaN is out of range."""

        def bad(param: str, why: str):
            raise RequestError(f"{param} {why}", param=param, code="invalid_value")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                     "presence_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                bad(name, f"must be a finite number, got {v!r}")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.top_k is None or (self.top_k < 1 and self.top_k not in (0, -1)):
            bad("top_k", "must be -1 or 0 (disabled) or >= 1")
        if not 0.01 <= self.repetition_penalty <= 100:
            bad("repetition_penalty", "must be in [0.01, 100]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            bad("max_new_tokens", "must be >= 0")
        if self.min_new_tokens < 0:
            bad("min_new_tokens", "must be >= 0")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            bad("min_new_tokens", "must be <= max_new_tokens")
        if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            bad("top_logprobs", f"must be in [0, {MAX_LOGPROBS}]")
        pl = self.prompt_logprobs
        if pl is not None and (not isinstance(pl, int) or isinstance(pl, bool) or not 0 <= pl <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"must be null (off) or an integer in [0, {MAX_LOGPROBS}], got {pl!r}")
        s = self.prompt_logprobs_start
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            bad("prompt_logprobs_start", f"must be an integer >= 0, got {s!r}")
        if self.n < 1:
            bad("n", "must be >= 1")
        self._validate_logit_bias(vocab_size, bad)
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    bad("stop_token_ids", f"contains {t}, outside the vocabulary [0, {vocab_size})")

    def _validate_logit_bias(self, vocab_size: int | None, bad) -> None:
        """logit_bias: a dict of int token ids (in [0, vocab_size) when it is known) to finite numbers
        in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX]; ``bad(param, why)`` raises."""
        lb = self.logit_bias
        if lb is None:
            return
        if not isinstance(lb, dict):
            bad("logit_bias", f"must be an object of token id -> bias, got {type(lb).__name__}")
        for t, b in lb.items():
            if not isinstance(t, int) or isinstance(t, bool):
                bad("logit_bias", f"keys must be token ids, got {t!r}")
            if vocab_size is not None and not 0 <= t < vocab_size:
                bad("logit_bias", f"contains token id {t}, outside the vocabulary [0, {vocab_size})")
            if not isinstance(b, (int, float)) or isinstance(b, bool) or not math.isfinite(b) \
                    or not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX:
                bad("logit_bias", f"values must be numbers in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], got {b!r} "
                    f"for token {t}")
