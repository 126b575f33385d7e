"""Baselines the benchmarks compare against: transformers' ``generate`` on the same weights.

    hf = HFGenerateBaseline(model_dir, dtype=torch.bfloat16, num_threads=2)
    hf.warmup()
    run = hf.run_static_batches(prompts, max_new_tokens=[64] * len(prompts), batch_size=32)
    seconds = hf.time_generate(prompt_ids, max_new_tokens=128)

The model is loaded with ``AutoModelForCausalLM`` from the same HF-style directory the engine
loads (for the bundled GGUF: ``idleless.model.loader.prepare_model_dir(None)``, the dequantized
conversion), cast to the same dtype. Prompts are token ids (no tokenizer is needed), left-padded
into static batches; decoding is greedy and never stops at eos (``min_new_tokens =
max_new_tokens``, which masks eos: the work equals the engine's ``ignore_eos``, and tokens differ
only where eos would have been the argmax): every request gets exactly ``max_new_tokens``
tokens. Times are wall-clock seconds (``time.perf_counter``).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass
class StaticBatchRun:
    """Result of ``run_static_batches``.

    wall_s: seconds for all batches; output_ids[i]: the new tokens of prompt i (its own
    max_new_tokens of them); prompt_tokens: sum of prompt lengths; padded_prompt_tokens: prompt
    positions actually run (batch size x longest prompt, summed over batches; padding included);
    generated_tokens: new-token positions actually run (batch size x the batch's max_new_tokens)."""

    wall_s: float
    output_ids: list[list[int]]
    prompt_tokens: int
    padded_prompt_tokens: int
    generated_tokens: int
    batch_size: int
    num_batches: int
    batch_wall_s: list[float] = field(default_factory=list)


def _load_causal_lm(model_dir: str, dtype: torch.dtype):
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    try:  # transformers >= 4.56 calls it ``dtype``; older versions ``torch_dtype``
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    except ValueError:
        major, minor = 5, 0
    kw = {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kw)
    return model.to(dtype).eval()


class HFGenerateBaseline:
    """transformers' ``model.generate`` on token-id prompts, greedy, eos ignored.

    model_dir: an HF-style directory (config.json + safetensors); dtype: the weights' and
    activations' dtype (the engine's resolved dtype for a like-for-like comparison);
    num_threads: torch intra-op threads (None leaves torch's setting alone)."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.bfloat16, num_threads: Optional[int] = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        t0 = time.perf_counter()
        self.model_dir = model_dir
        self.dtype = dtype
        self.model = _load_causal_lm(model_dir, dtype)
        self.load_seconds = time.perf_counter() - t0
        cfg = self.model.config
        gen = getattr(self.model, "generation_config", None)
        pad = getattr(cfg, "pad_token_id", None)
        if pad is None and gen is not None:
            pad = gen.pad_token_id
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
        self.pad_token_id = int(pad) if pad is not None else 0
        self.vocab_size = int(cfg.vocab_size)

    def _generation_config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        base = getattr(self.model, "generation_config", None)
        gc = copy.deepcopy(base) if base is not None else GenerationConfig()
        gc.do_sample = False
        gc.num_beams = 1
        gc.temperature = None
        gc.top_p = None
        gc.top_k = None
        gc.max_new_tokens = int(max_new_tokens)
        # Never stop early (ignore_eos): transformers fills an unset eos_token_id back in from the
        # model's defaults, so eos is masked out until max_new_tokens instead. Same work; a token
        # differs from the engine's ignore_eos only where eos itself would have been the argmax.
        gc.min_new_tokens = int(max_new_tokens)
        gc.max_length = None
        gc.pad_token_id = self.pad_token_id
        return gc

    @torch.inference_mode()
    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """One static batch: left-pad ``prompts`` (token ids) to the longest, greedy-generate exactly
        ``max_new_tokens`` tokens for each row; returns the new token ids per prompt."""
        if not prompts:
            return []
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if p:
                ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
                mask[i, width - len(p):] = 1
        out = self.model.generate(input_ids=ids, attention_mask=mask,
                                  generation_config=self._generation_config(max_new_tokens))
        new = out[:, width:]
        if new.shape[1] != max_new_tokens:
            raise RuntimeError(f"transformers generate returned {new.shape[1]} new tokens, expected {max_new_tokens}")
        return [row.tolist() for row in new]

    def warmup(self, prompt: Optional[Sequence[int]] = None) -> None:
        """A tiny untimed generate (two short prompts, 4 new tokens) so one-off costs leave the timings."""
        p = list(prompt or range(3, 19))[:16]
        p = [t % self.vocab_size for t in p]
        self.generate_batch([p, p[: max(1, len(p) // 2)]], 4)

    def run_static_batches(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                           batch_size: int = 32) -> StaticBatchRun:
        """Run the prompts in submission order in static batches of ``batch_size``. A batch
        generates its largest ``max_new_tokens``; each prompt keeps its own number of tokens."""
        if len(max_new_tokens) != len(prompts):
            raise ValueError("one max_new_tokens per prompt")
        outputs: list[list[int]] = []
        padded = generated = 0
        batch_times = []
        t0 = time.perf_counter()
        for s in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[s:s + batch_size]]
            n = max(max_new_tokens[s:s + batch_size])
            tb = time.perf_counter()
            new = self.generate_batch(chunk, n)
            batch_times.append(time.perf_counter() - tb)
            outputs.extend(row[:m] for row, m in zip(new, max_new_tokens[s:s + batch_size]))
            padded += len(chunk) * max(len(p) for p in chunk)
            generated += len(chunk) * n
        wall = time.perf_counter() - t0
        return StaticBatchRun(wall_s=wall, output_ids=outputs, prompt_tokens=sum(len(p) for p in prompts),
                              padded_prompt_tokens=padded, generated_tokens=generated, batch_size=batch_size,
                              num_batches=len(batch_times), batch_wall_s=batch_times)

    def time_generate(self, prompt: Sequence[int], max_new_tokens: int) -> float:
        """Seconds for one batch-1 ``generate`` of exactly ``max_new_tokens`` tokens."""
        t0 = time.perf_counter()
        self.generate_batch([list(prompt)], max_new_tokens)
        return time.perf_counter() - t0
