"""Model weights: random ("dummy", from a fixed seed) or a HF checkpoint.

Weights of a layer range ``[first_layer, end_layer)`` can be loaded alone
(embeddings only on the stage holding layer 0, final norm and lm_head only on
the stage holding the last layer): the seam for Chunked Pipeline Parallelism,
where each prefill node of a group holds a contiguous range of layers.

Projections are stored fused (q|k|v and gate|up) so one matmul does each;
layouts are HF's ``[out_features, in_features]`` for ``F.linear``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from model.config import ModelConfig, RuntimeConfig, load_model_config

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] if attention_bias
    o: torch.Tensor  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class ModelWeights:
    config: ModelConfig
    first_layer: int
    end_layer: int
    layers: list[LayerWeights]  # layers[i] is global layer first_layer + i
    embed: torch.Tensor | None  # [vocab, hidden], on the first stage only
    norm: torch.Tensor | None  # [hidden], on the last stage only
    lm_head: torch.Tensor | None  # [vocab, hidden] (the embedding itself when tied)

    @property
    def is_first_stage(self) -> bool:
        return self.first_layer == 0

    @property
    def is_last_stage(self) -> bool:
        return self.end_layer == self.config.num_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].qkv.dtype

    @property
    def dtype_name(self) -> str:
        """The dtype as the config names it (a key of TORCH_DTYPES)."""
        return next(n for n, t in TORCH_DTYPES.items() if t == self.dtype)

    @property
    def device(self) -> torch.device:
        return self.layers[0].qkv.device


def _layer_range(config: ModelConfig, first_layer: int, end_layer: int | None) -> tuple[int, int]:
    end = config.num_layers if end_layer is None else end_layer
    if not 0 <= first_layer < end <= config.num_layers:
        raise ValueError(f"layer range [{first_layer}, {end}) not within [0, {config.num_layers})")
    return first_layer, end


def _tensor_seed(seed: int, name: str) -> int:
    # One generator per named tensor, seeded from (seed, name) with a stable
    # hash (never Python's hash()): every process, and every pipeline stage
    # loading only its layers, gets bit-identical weights.
    return int.from_bytes(hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest(),
                          "little") & ((1 << 63) - 1)


def _randn(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_tensor_seed(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def dummy_weights(config: ModelConfig, seed: int = 0, dtype: str = "float32", device: str = "cpu",
                  first_layer: int = 0, end_layer: int | None = None) -> ModelWeights:
    """Random weights with fan-in scaling, so activations stay O(1) at any size."""
    first, end = _layer_range(config, first_layer, end_layer)
    c = config
    h, q, kv, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, \
        c.intermediate_size
    tdt = TORCH_DTYPES[dtype]

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=tdt).contiguous()

    layers = []
    for i in range(first, end):
        p = f"layers.{i}."
        layers.append(LayerWeights(
            attn_norm=put(torch.ones(h)),
            qkv=put(_randn(seed, p + "qkv", (q + 2 * kv, h), h ** -0.5)),
            qkv_bias=put(_randn(seed, p + "qkv_bias", (q + 2 * kv,), 0.1))
            if c.attention_bias else None,
            o=put(_randn(seed, p + "o", (h, q), q ** -0.5)),
            mlp_norm=put(torch.ones(h)),
            gate_up=put(_randn(seed, p + "gate_up", (2 * ff, h), h ** -0.5)),
            down=put(_randn(seed, p + "down", (h, ff), ff ** -0.5)),
        ))
    need_embed = first == 0 or (end == c.num_layers and c.tie_embeddings)
    embed = put(_randn(seed, "embed", (c.vocab_size, h), 1.0)) if need_embed else None
    norm = lm_head = None
    if end == c.num_layers:
        norm = put(torch.ones(h))
        # Logit std ~3: peaked enough that greedy choices are far from ties.
        lm_head = embed if c.tie_embeddings else \
            put(_randn(seed, "lm_head", (c.vocab_size, h), 3 * h ** -0.5))
    return ModelWeights(c, first, end, layers, embed if first == 0 else None, norm, lm_head)


class _SafetensorsDir:
    """Tensor name -> file over every *.safetensors file of a checkpoint."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {path}")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        return self._where[name].get_tensor(name)


def load_checkpoint(path: str | Path, dtype: str = "float32", device: str = "cpu",
                    first_layer: int = 0, end_layer: int | None = None) -> ModelWeights:
    """Load a local HF LLaMA-family checkpoint (config.json + *.safetensors)."""
    path = Path(path)
    config = load_model_config(str(path))
    first, end = _layer_range(config, first_layer, end_layer)
    st = _SafetensorsDir(path)
    tdt = TORCH_DTYPES[dtype]

    def get(name: str) -> torch.Tensor:
        return st.get(name).to(device=device, dtype=tdt).contiguous()

    layers = []
    for i in range(first, end):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if config.attention_bias:
            bias = torch.cat([get(a + f"{x}_proj.bias") for x in "qkv"])
        layers.append(LayerWeights(
            attn_norm=get(p + "input_layernorm.weight"),
            qkv=torch.cat([get(a + f"{x}_proj.weight") for x in "qkv"]),
            qkv_bias=bias,
            o=get(a + "o_proj.weight"),
            mlp_norm=get(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
            down=get(p + "mlp.down_proj.weight"),
        ))
    last = end == config.num_layers
    embed = get("model.embed_tokens.weight") if first == 0 else None
    norm = get("model.norm.weight") if last else None
    lm_head = None
    if last:
        if config.tie_embeddings or not st.has("lm_head.weight"):
            lm_head = embed if embed is not None else get("model.embed_tokens.weight")
        else:
            lm_head = get("lm_head.weight")
    return ModelWeights(config, first, end, layers, embed, norm, lm_head)


def load_weights(runtime: RuntimeConfig, first_layer: int = 0,
                 end_layer: int | None = None) -> ModelWeights:
    """The weights a node's ``[model]`` config names (dummy or checkpoint)."""
    if runtime.is_dummy:
        return dummy_weights(load_model_config(runtime.model), runtime.seed, runtime.dtype,
                             runtime.device, first_layer, end_layer)
    return load_checkpoint(runtime.model, runtime.dtype, runtime.device, first_layer, end_layer)
