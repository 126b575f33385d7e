"""Our forward pass (ModelRunner over the KV pool) against transformers' on tiny random models.

Llama, Qwen2 (q/k/v bias) and Mistral, tied and untied, Llama 3 and linear rope scaling, MQA/MHA and a
head_dim that is not hidden/heads, written as safetensors by ``make_tiny_model``. Each model runs a
mixed batch sequence through ``ModelRunner.forward`` with hand-built ``ForwardBatch``es: requests with
different prefix lengths (KV already in the pool from an earlier step), different numbers of new
tokens per request in one batch, a prefix shared with another request through its slots, a long
extend next to short ones (several attention groups), then decode steps. We ask for the logits of
every new row and compare each with transformers' full-sequence forward at that position. Then the
engine core runs greedy generation (chunked prefill, token budget, continuous batching) and its
tokens must be transformers' greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TEST_THREADS, make_tiny_model
from hf_ref import check_greedy, hf_logits, load_hf

from idleless.config import EngineConfig
from idleless.engine.core import EngineCore
from idleless.engine.request import Request, SamplingParams
from idleless.model import cpu_kernels
from idleless.model.attention import DecodeGroup
from idleless.model.linear import AmxLinearMethod, Linear, OneDnnLinearMethod, PlainLinearMethod, can_prepack
from idleless.model.runner import ForwardBatch, ModelRunner

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          # with head_dim 16 and theta 1e4 the wavelengths span 6..2e4 tokens: an original context of
          # 64 puts some frequencies in each of the three llama3 bands (kept, smoothed, divided)
          "original_max_position_embeddings": 64}

ARCHS = [
    pytest.param("llama", False, {}, id="llama"),
    pytest.param("llama", True, {}, id="llama-tied"),
    pytest.param("qwen2", False, {}, id="qwen2"),
    pytest.param("qwen2", True, {}, id="qwen2-tied"),
    pytest.param("mistral", False, {}, id="mistral"),
    pytest.param("mistral", True, {}, id="mistral-tied"),
    pytest.param("llama", False, {"rope_scaling": LLAMA3}, id="llama3-rope"),
    pytest.param("llama", True, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, id="linear-rope"),
    pytest.param("llama", False, {"head_dim": 32, "num_key_value_heads": 1}, id="mqa-head_dim32"),
    pytest.param("qwen2", False, {"num_key_value_heads": 4, "num_hidden_layers": 3}, id="qwen2-mha-3layers"),
    # the eager PyTorch path (no fused CPU kernels), which every other case replaces where it can
    pytest.param("llama", False, {"eager": True}, id="llama-eager"),
    pytest.param("qwen2", True, {"eager": True}, id="qwen2-tied-eager"),
]

# Tolerance (float32 on both sides): the two implementations do the same math in a different order
# (fused q/k/v and gate/up matmuls, SDPA vs eager softmax, gathered K/V), so they differ by float32
# rounding only: measured max |diff| <= 6e-7 relative to the largest |logit| over these models and
# sequences up to 300 tokens. We allow 2e-5 relative to the largest |logit| of the sequence (30x
# headroom, so other BLAS builds and thread counts pass too). Any real bug (a position off by one, a wrong mask, rope or bias) moves logits by O(1):
# e.g. ignoring Mistral's sliding window changes them by ~3.0 on a scale of ~4.
REL_TOL = 2e-5


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = float(ref.abs().max())
    err = float((ours - ref).abs().max())
    assert err <= REL_TOL * scale, f"{what}: max |ours - transformers| = {err:.3g} (logit scale {scale:.3g})"


def _runner(path: str, **kw) -> ModelRunner:
    return ModelRunner(EngineConfig(model=path, dtype="float32", kv_cache_memory="2MiB", num_threads=TEST_THREADS, **kw))


class MixedBatchDriver:
    """Feeds requests' tokens through ModelRunner.forward in hand-built mixed batches.

    Slots come from the runner's pool after the pool's free list has been shuffled, so slot tables
    are scattered; ``share(dst, src, n)`` makes request dst start with src's first n tokens and
    slots (KV read through another request's slots, as after a radix cache hit)."""

    def __init__(self, runner: ModelRunner, seqs: dict[str, list[int]], seed: int = 0, scatter: bool = True):
        self.runner = runner
        self.pool = runner.pool
        self.seqs = seqs
        self.slots = {r: torch.empty(0, dtype=torch.int64) for r in seqs}
        self.done = {r: 0 for r in seqs}
        self.logits: dict[str, dict[int, torch.Tensor]] = {r: {} for r in seqs}
        # scatter the free list: take every slot, give them back in random order
        n = self.pool.num_free_slots
        all_slots = self.pool.alloc(0, 0, n)
        g = torch.Generator().manual_seed(seed)
        self.pool.free(all_slots[torch.randperm(n, generator=g)] if scatter else all_slots.sort().values)

    def share(self, dst: str, src: str, n: int) -> None:
        assert self.seqs[dst][:n] == self.seqs[src][:n] and self.done[src] >= n and self.done[dst] == 0
        self.slots[dst] = self.slots[src][:n].clone()
        self.done[dst] = n

    def step(self, plan: dict[str, int]) -> None:
        ids, pos, locs, ext, pre, tables = [], [], [], [], [], []
        order = []
        for r, n in plan.items():
            start = self.done[r]
            assert start + n <= len(self.seqs[r])
            new = self.pool.alloc(len(self.slots[r]), 0, n)
            assert new is not None
            self.slots[r] = torch.cat([self.slots[r], new])
            ids += self.seqs[r][start:start + n]
            pos += range(start, start + n)
            locs.append(new)
            ext.append(n)
            pre.append(start)
            tables.append(self.slots[r])
            order += [(r, p) for p in range(start, start + n)]
        T = len(ids)
        batch = ForwardBatch(torch.tensor(ids), torch.tensor(pos), torch.cat(locs), ext, pre, tables,
                             torch.arange(T))  # the logits of every new row
        out = self.runner.forward(batch)
        assert out.shape == (T, self.runner.model_config.vocab_size) and out.dtype == torch.float32
        for row, (r, p) in enumerate(order):
            self.logits[r][p] = out[row]
        for r, n in plan.items():
            self.done[r] += n


@pytest.mark.parametrize("arch,tie,overrides", ARCHS)
def test_forward_matches_transformers_in_mixed_batches(tmp_path, arch, tie, overrides):
    overrides = dict(overrides)
    eager = overrides.pop("eager", False)
    path = make_tiny_model(tmp_path, arch=arch, tie=tie, **overrides)
    runner = _runner(path, disable_cpu_kernels=eager)
    assert (runner.kernels is None) == (eager or cpu_kernels.load(torch.float32) is None)
    if "rope_scaling" in overrides:
        assert runner.model_config.rope_scaling["rope_type"] == overrides["rope_scaling"]["rope_type"]
    hf = load_hf(path)
    g = torch.Generator().manual_seed(1)
    V = runner.model_config.vocab_size

    def rand(n):
        return torch.randint(3, V, (n,), generator=g).tolist()

    seqs = {"a": rand(30), "b": rand(12), "c": rand(300), "d": rand(6), "e": rand(20)}
    seqs["f"] = seqs["a"][:10] + rand(9)  # shares a's first 10 tokens
    drv = MixedBatchDriver(runner, seqs)
    drv.step({"a": 10, "b": 1, "c": 150})  # prefills: partial, a single token, a long one
    drv.share("f", "a", 10)  # f starts with a's KV
    drv.step({"a": 1, "b": 5, "c": 150, "d": 6, "e": 12, "f": 4})  # decode + extends on prefixes + new
    drv.step({"a": 15, "b": 1, "e": 1, "f": 1})
    for _ in range(4):  # decode steps: one new token each
        drv.step({r: 1 for r in seqs if drv.done[r] < len(seqs[r])})
    for r, s in seqs.items():
        ref = hf_logits(hf, s[: drv.done[r]])
        positions = sorted(drv.logits[r])
        assert positions == list(range(10 if r == "f" else 0, drv.done[r]))
        ours = torch.stack([drv.logits[r][p] for p in positions])
        assert_logits_close(ours, ref[positions], f"{arch} request {r}")


@pytest.mark.parametrize("eager", [False, True], ids=["kernels", "eager"])
@pytest.mark.parametrize("scatter", [True, False], ids=["gathered-keys", "pool-view-keys"])
def test_cascade_segments_match_transformers(tmp_path, scatter, eager):
    """Shared-prefix (cascade) attention: seven requests hold the same 40-token prefix through the same
    slots, and two pairs of them a further 20 tokens each (nested segments); then mixed extends and
    decode steps. Each request's logits must be transformers' full-sequence logits. The two documents
    run as one padded kernel call; with scattered slots the system prompt's keys are gathered, with a
    fresh (ordered) pool they are read as a view. With the fused CPU kernels, decode rows attend their
    tails in the decode kernel and the segments are merged in by the merge kernel."""
    path = make_tiny_model(tmp_path)
    runner = _runner(path, disable_cpu_kernels=eager)
    hf = load_hf(path)
    g = torch.Generator().manual_seed(7)

    def rand(n):
        return torch.randint(3, 256, (n,), generator=g).tolist()

    system, doc1, doc2 = rand(40), rand(20), rand(20)
    seqs = {"s": system + doc1 + rand(3), "t": system + doc1 + rand(5), "u": system + doc2 + rand(4),
            "v": system + doc2 + rand(6), "w": system + rand(7), "x": system + rand(2),
            "y": system + rand(70)}  # a long extend over the shared prefix: a segment too, then a masked tail
    drv = MixedBatchDriver(runner, seqs, scatter=scatter)
    metas = []
    prepare = runner.backend.prepare
    runner.backend.prepare = lambda *a: metas.append(prepare(*a)) or metas[-1]
    drv.step({"s": 60})  # system prompt + doc1 in one piece
    drv.step({"u": 60})
    for r in "tvwxy":
        drv.share(r, "s" if r in "t" else "u" if r == "v" else "s", 60 if r in "tv" else 40)
    drv.step({"s": 1, "t": 3, "u": 2, "v": 4, "w": 5, "x": 1, "y": 70})  # extends on shared prefixes + decode
    while any(drv.done[r] < len(seqs[r]) for r in seqs):  # decode to the end
        drv.step({r: 1 for r in seqs if drv.done[r] < len(seqs[r])})
    assert metas[0].tails[0].causal  # a lone prefill runs in the kernel's causal mode
    segs = [s for m in metas[2:] for s in m.segments]
    assert segs, "the shared prefixes were not run as segments"
    # the long extend's 70 rows read the system prompt in its segment (with the other requests' rows)
    assert any(s.out_rows.numel() >= 70 + 5 for s in metas[2].segments)
    # the system prompt (all seven requests) runs alone; the two documents (disjoint rows) in one padded call
    assert any(s.q_index.shape[0] == 2 and s.mask is not None for s in segs)
    assert all((s.kv_index is None) == (not scatter and s.q_index.shape[0] == 1) for s in segs)
    decode_groups = [t for m in metas for t in m.tails if isinstance(t, DecodeGroup)]
    assert bool(decode_groups) == (runner.kernels is not None)
    assert any(m.segments for m in metas if any(isinstance(t, DecodeGroup) for t in m.tails)) or eager
    for r, seq in seqs.items():
        ref = hf_logits(hf, seq[: drv.done[r]])
        positions = sorted(drv.logits[r])
        ours = torch.stack([drv.logits[r][p] for p in positions])
        assert_logits_close(ours, ref[positions], f"request {r}")


def test_bfloat16_forward_is_close_to_float32(tmp_path):
    """bfloat16 weights and KV (float32 norms and rope tables): same argmax on nearly every row and
    logits within bf16 accuracy. Loose by nature (8 mantissa bits): a sanity check of the dtype path."""
    path = make_tiny_model(tmp_path)
    hf = load_hf(path)
    runner = ModelRunner(EngineConfig(model=path, dtype="bfloat16", kv_cache_memory="2MiB", num_threads=TEST_THREADS))
    g = torch.Generator().manual_seed(3)
    seqs = {"a": torch.randint(3, 256, (40,), generator=g).tolist(), "b": torch.randint(3, 256, (25,), generator=g).tolist()}
    drv = MixedBatchDriver(runner, seqs)
    drv.step({"a": 20, "b": 25})
    drv.step({"a": 20})
    ref = hf_logits(hf, seqs["a"])
    ours = torch.stack([drv.logits["a"][p] for p in range(40)])
    assert float((ours - ref).abs().max()) < 0.1 * float(ref.abs().max())
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not can_prepack(torch.bfloat16), reason="no oneDNN bfloat16 packing here")
@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen2", False)], ids=["llama-tied", "qwen2-bias"])
def test_prepacked_weights_give_the_plain_linear_logits(tmp_path, arch, tie):
    """bf16 with packed weights (the default on CPU: oneDNN's layout, and on AMX CPUs also amx_linear's
    for batches of up to 64 rows) vs F.linear on the same weights: the packed product is the same bf16
    GEMM in another memory layout, so the logits of a 98-row extend batch (oneDNN) and an 8-row one
    (AMX where present) agree to bf16 rounding; a wrong layout or a dropped bias (qwen2) or an untied
    head that read the embedding would move them by O(1)."""
    path = make_tiny_model(tmp_path, arch=arch, tie=tie)
    cfg = dict(model=path, dtype="bfloat16", kv_cache_memory="2MiB", num_threads=TEST_THREADS,
               enable_deterministic_inference=False)  # the non-invariant methods (bf16's default is invariant)
    packed, plain = ModelRunner(EngineConfig(**cfg)), ModelRunner(EngineConfig(disable_weight_prepack=True, **cfg))
    assert packed.prepacked_bytes > 0 and plain.prepacked_bytes == 0
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.method is packed.linear_method and m.packed is not None for m in linears)
    amx = packed.kernels is not None and packed.kernels.has_amx
    assert isinstance(packed.linear_method, AmxLinearMethod if amx else OneDnnLinearMethod)
    if amx:  # every tiny-model dimension is a multiple of 32: every linear has its tile copy
        assert all(m.amx is not None for m in linears)
    assert all(isinstance(m.method, PlainLinearMethod) for m in plain.model.modules() if isinstance(m, Linear))
    g = torch.Generator().manual_seed(5)
    seqs = {"a": torch.randint(3, 256, (97,), generator=g).tolist(), "b": torch.randint(3, 256, (9,), generator=g).tolist()}
    out = {}
    for name, runner in (("packed", packed), ("plain", plain)):
        drv = MixedBatchDriver(runner, seqs)
        drv.step({"a": 90, "b": 8})
        drv.step({"a": 7, "b": 1})
        out[name] = torch.stack([drv.logits[r][p] for r in "ab" for p in range(len(seqs[r]))])
    scale = float(out["plain"].abs().max())
    assert float((out["packed"] - out["plain"]).abs().max()) <= 0.02 * scale


@pytest.mark.skipif(cpu_kernels.load(torch.bfloat16) is None, reason="no C compiler for the CPU kernels")
def test_bfloat16_kernels_give_the_eager_logits(tmp_path):
    """bfloat16 with the fused CPU kernels vs the eager PyTorch path on the same weights (head_dim 32,
    so decode attention takes the AVX512-BF16 path where the CPU has it). Three requests, two sharing
    a 24-token prefix (a cascade segment merged into decode tails), prefills then decode steps: the
    kernels round where the eager ops round, so the logits agree to bf16 accuracy; a rope position
    off by one, a lost residual add or a K/V row written to a wrong slot moves them by O(1)."""
    path = make_tiny_model(tmp_path, head_dim=32, num_attention_heads=4, num_key_value_heads=2)
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 256, (24,), generator=g).tolist()
    seqs = {"a": shared + torch.randint(3, 256, (9,), generator=g).tolist(),
            "b": shared + torch.randint(3, 256, (7,), generator=g).tolist(),
            "c": torch.randint(3, 256, (30,), generator=g).tolist()}
    out = {}
    for name, eager in (("kernels", False), ("eager", True)):
        runner = ModelRunner(EngineConfig(model=path, dtype="bfloat16", kv_cache_memory="2MiB",
                                          num_threads=TEST_THREADS, disable_cpu_kernels=eager))
        assert (runner.kernels is None) == eager
        drv = MixedBatchDriver(runner, seqs)
        drv.step({"a": 26, "c": 25})
        drv.share("b", "a", 24)
        drv.step({"a": 1, "b": 1, "c": 1})
        for _ in range(4):
            drv.step({"a": 1, "b": 1, "c": 1})
        out[name] = torch.stack([drv.logits[r][p] for r in "abc" for p in sorted(drv.logits[r])])
    scale = float(out["eager"].abs().max())
    assert float((out["kernels"] - out["eager"]).abs().max()) <= 0.03 * scale
    assert (out["kernels"].argmax(-1) == out["eager"].argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(not getattr(cpu_kernels.load(torch.bfloat16), "has_amx", False), reason="no AMX tiles on this CPU")
def test_ragged_amx_attention_gives_the_flash_logits(tmp_path):
    """bfloat16 with AMX: shared segments and multi-token tails run in the ragged kernel, straight from
    the pool, against the same runner with that kernel off (padded tails and segments in PyTorch's
    flash kernel, merged by the merge kernel). Both round probabilities to bfloat16, so the logits of
    prefills, extends over a shared prefix (a system prompt for all, a document for two pairs) and
    decode steps agree to bfloat16 accuracy; a lost causal limit or a segment merged twice moves them
    by O(1)."""
    path = make_tiny_model(tmp_path, hidden_size=96, head_dim=64, num_attention_heads=6, num_key_value_heads=2)
    g = torch.Generator().manual_seed(13)

    def rand(n):
        return torch.randint(3, 256, (n,), generator=g).tolist()

    system, doc1, doc2 = rand(40), rand(20), rand(20)
    seqs = {"s": system + doc1 + rand(3), "t": system + doc1 + rand(5), "u": system + doc2 + rand(4),
            "v": system + doc2 + rand(6), "w": system + rand(37)}
    out, kinds = {}, {}
    for name in ("ragged", "flash"):
        runner = ModelRunner(EngineConfig(model=path, dtype="bfloat16", kv_cache_memory="2MiB",
                                          num_threads=TEST_THREADS))
        if name == "flash":  # route what the ragged kernel takes to padded flash instead
            runner.backend.extend_backend = runner.backend.segment_backend = runner.backend.flash
        metas = []
        prepare = runner.backend.prepare
        runner.backend.prepare = lambda *a: metas.append(prepare(*a)) or metas[-1]
        drv = MixedBatchDriver(runner, seqs)
        drv.step({"s": 60})
        drv.step({"u": 60})
        for r in "tvw":
            drv.share(r, "s" if r == "t" else "u" if r == "v" else "s", 60 if r in "tv" else 40)
        drv.step({"s": 1, "t": 3, "u": 2, "v": 4, "w": 37})
        while any(drv.done[r] < len(seqs[r]) for r in seqs):
            drv.step({r: 1 for r in seqs if drv.done[r] < len(seqs[r])})
        out[name] = torch.stack([drv.logits[r][p] for r in seqs for p in sorted(drv.logits[r])])
        kinds[name] = {type(g).__name__ for m in metas for g in m.tails + m.segments}
    assert "RaggedGroup" in kinds["ragged"] and "RaggedGroup" not in kinds["flash"]
    scale = float(out["flash"].abs().max())
    assert float((out["ragged"] - out["flash"]).abs().max()) <= 0.02 * scale
    assert (out["ragged"].argmax(-1) == out["flash"].argmax(-1)).float().mean() >= 0.95


def test_mistral_sliding_window(tmp_path):
    path = make_tiny_model(tmp_path, arch="mistral", sliding_window=8)
    runner = _runner(path)
    hf = load_hf(path)
    seq = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    drv = MixedBatchDriver(runner, {"a": seq})
    drv.step({"a": 16})
    drv.step({"a": 1})
    ours = torch.stack([drv.logits["a"][p] for p in range(17)])
    assert_logits_close(ours, hf_logits(hf, seq[:17]), "mistral sliding_window=8")


# ------------------------------------------------------------------ engine core: greedy tokens


@pytest.mark.parametrize("arch,tie,overrides", [ARCHS[0], ARCHS[3], ARCHS[4], ARCHS[6]])
def test_engine_core_greedy_equals_transformers(tmp_path, arch, tie, overrides):
    """Requests arriving over several steps, prompts longer than the prefill chunk (16) and the step
    budget (40), so prefill chunks, extends and decodes share batches; every request's greedy tokens
    are transformers' greedy tokens."""
    path = make_tiny_model(tmp_path, arch=arch, tie=tie, **overrides)
    core = EngineCore(EngineConfig(model=path, dtype="float32", kv_cache_memory="2MiB", num_threads=TEST_THREADS,
                                   chunked_prefill_size=16, max_prefill_tokens=40))
    hf = load_hf(path)
    g = torch.Generator().manual_seed(5)
    lens = [1, 3, 17, 45, 8, 70, 2, 33]
    max_new = [12, 1, 20, 9, 25, 6, 16, 11]
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]
    outs = {str(i): [] for i in range(len(prompts))}
    finish = {}
    pending = list(range(len(prompts)))
    step = 0
    while pending or core.has_work():
        if pending and step % 2 == 0:  # two new requests every other step
            for i in pending[:2]:
                core.add_request(Request(str(i), prompts[i], SamplingParams(temperature=0, max_new_tokens=max_new[i],
                                                                           ignore_eos=True)))
            pending = pending[2:]
        for o in core.step():
            outs[o.rid] += o.new_token_ids
            if o.finished:
                finish[o.rid] = o.finish_reason
        step += 1
        assert step < 500
    for i, p in enumerate(prompts):
        ours = outs[str(i)]
        assert len(ours) == max_new[i] and finish[str(i)] == "length"
        check_greedy(hf, p, ours, what=f"{arch} request {i}")
    kv = core.scheduler.kv_usage()
    assert kv["free"] + kv["cached"] == kv["total"] and kv["in_use"] == 0


@pytest.mark.parametrize("eager", [False, True], ids=["kernels", "eager"])
def test_position_past_the_context_is_an_error_not_a_stray_read(tmp_path, eager):
    """The rope kernel indexes its table without checks, so the model checks positions once per
    forward: a position at the context length raises IndexError on both paths (the engine refuses such
    requests earlier; this guards the model itself)."""
    path = make_tiny_model(tmp_path)
    runner = _runner(path, context_length=64, disable_cpu_kernels=eager)
    slots = runner.pool.alloc(0, 0, 2)
    batch = ForwardBatch(torch.tensor([5, 6]), torch.tensor([63, 64]), slots, [2], [0], [slots], torch.tensor([1]))
    with pytest.raises(IndexError):
        runner.forward(batch)
    ok = ForwardBatch(torch.tensor([5, 6]), torch.tensor([62, 63]), slots, [2], [0], [slots], torch.tensor([1]))
    assert runner.forward(ok).shape == (1, runner.model_config.vocab_size)


def test_a_deleted_engine_is_freed_when_the_next_runner_loads(tmp_path):
    """ModelRunner freezes the garbage collector's view after load; an engine core deleted afterwards
    (it holds reference cycles) must still be freed, at the latest when the next runner loads (a bench
    that built engines one after another kept them all: 20 GB)."""
    import gc
    import weakref

    from idleless.engine.core import EngineCore

    path = make_tiny_model(tmp_path)
    cfg = EngineConfig(model=path, dtype="float32", kv_cache_memory="2MiB", num_threads=TEST_THREADS)
    first = EngineCore(cfg, runner=ModelRunner(cfg))
    gone = weakref.ref(first.runner.pool)
    del first
    second = _runner(path)
    gc.collect()
    assert gone() is None, "the first engine's KV pool is still alive after a second runner loaded"
    del second
