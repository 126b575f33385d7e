"""Shared test helpers: tiny random HF models and the converted bundled SmolLM2.

    make_tiny_model(tmp_dir, arch="llama", tie=False, **overrides) -> str   # plain function
    tiny_model_dir            (fixture) make_tiny_model(tmp_path) : a tiny random Llama dir
    smollm2_dir               (session fixture) prepare_model_dir(None) in a session tmp cache
    server, http              (module fixtures) the session's shared server and an httpx client on it

Import the function with ``from conftest import make_tiny_model`` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings as hypothesis_settings

# Property tests draw the same examples on every run, so a red CI reproduces on any machine;
# IDLELESS_FUZZ_RANDOM=1 draws fresh ones (a longer hunt: raise IDLELESS_FUZZ_EXAMPLES too).
hypothesis_settings.register_profile("idleless", derandomize=os.environ.get("IDLELESS_FUZZ_RANDOM", "") in ("", "0"))
hypothesis_settings.load_profile("idleless")

_ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

TINY_DEFAULTS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per KV head
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def make_tiny_model(tmp_dir, arch: str = "llama", tie: bool = False, **overrides) -> str:
    """Write a tiny random HF model directory (config.json + safetensors, no tokenizer) and return its path.

    The directory is a new subfolder of ``tmp_dir`` (``tiny-<arch>[-tied][-N]``), so several models can
    share one tmp_dir. Defaults: TINY_DEFAULTS (vocab 256, hidden 64, 2 layers, 4 heads, 2 KV heads,
    head_dim 16, intermediate 128, bos 1, eos 2). ``arch``: "llama" | "qwen2" | "mistral".

    ``overrides``: any transformers config field (hidden_size, num_hidden_layers, head_dim,
    rope_scaling, attention_bias, ...), plus these, not config fields:
        seed (int, default 0): torch seed for the weights;
        dtype (torch.dtype, default float32): dtype the weights are saved in;
        max_shard_size (str|int, default None): e.g. "200KB" to write a sharded checkpoint + index.

    Weights are well-conditioned rather than transformers' 0.02-std init, so greedy tokens are not
    near-ties: linears ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights 1 + N(0, 0.1^2), biases
    N(0, 0.1^2) (Qwen2's q/k/v biases are random, not zero, so loading them is tested).
    Reload the reference with ``AutoModelForCausalLM.from_pretrained(path)``.
    """
    import transformers

    if arch not in _ARCH_CONFIGS:
        raise ValueError(f"arch must be one of {sorted(_ARCH_CONFIGS)}, got {arch!r}")
    seed = overrides.pop("seed", 0)
    dtype = overrides.pop("dtype", torch.float32)
    max_shard_size = overrides.pop("max_shard_size", None)
    config_cls, model_cls = (getattr(transformers, n) for n in _ARCH_CONFIGS[arch])
    kwargs = {**TINY_DEFAULTS, "tie_word_embeddings": tie, **overrides}
    config = config_cls(**kwargs)

    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    model = model.to(dtype).eval()

    base = os.path.join(str(tmp_dir), f"tiny-{arch}{'-tied' if tie else ''}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    return path


@pytest.fixture
def tiny_model_dir(tmp_path) -> str:
    """A tiny random Llama (untied, GQA) model directory; see make_tiny_model."""
    return make_tiny_model(tmp_path)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    """The bundled SmolLM2-135M-Instruct GGUF converted to an HF-style dir, once per test session.

    Sets IDLELESS_CACHE_DIR to a session tmp directory for the rest of the session (so processes the
    tests start find the same cache), restoring it afterwards.
    """
    from idleless.model.loader import prepare_model_dir

    mp = pytest.MonkeyPatch()
    mp.setenv("IDLELESS_CACHE_DIR", str(tmp_path_factory.mktemp("idleless-cache")))
    try:
        yield prepare_model_dir(None)
    finally:
        mp.undo()


# Torch threads for the engines the tests build. 1 by default: on a small shared machine (2 cores, other
# jobs running) more threads than free cores make every matmul wait on descheduled threads (benchmarks/
# README.md, "Threads on a loaded machine"). Set IDLELESS_TEST_THREADS=0 for all cores on an idle machine.
TEST_THREADS = int(os.environ.get("IDLELESS_TEST_THREADS", "1"))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_dir):
    """ONE offline Engine on the bundled SmolLM2-135M-Instruct in float32, shared by the engine tests.

    KV pool: 160 MiB (~3600 tokens). A test that counts cache hits calls ``flush_cache()`` first; every
    test leaves it idle (nothing running or waiting) and with the radix cache on.
    """
    from idleless.engine.engine import Engine

    return Engine(model=smollm2_dir, dtype="float32", kv_cache_memory="160MiB", num_threads=TEST_THREADS)


@pytest.fixture(scope="module")
def server(smollm2_dir, pytestconfig):
    """The session's shared float32 server (``server_harness.shared_server`` with MAIN_ARGS and its API
    key), for the server test modules; a module that needs another server defines its own ``server``."""
    from server_harness import shared_server

    return shared_server(pytestconfig)


@pytest.fixture(scope="module")
def http(server):
    """An httpx client on ``server`` with its API key."""
    import httpx

    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c:
        yield c
