"""Model shapes and the runtime section of the node config.

``ModelConfig`` holds the LLaMA-family hyper-parameters (the fields of a HF
``config.json`` we use); ``DUMMY_CONFIGS`` names random-weight shapes from
``tiny`` (unit tests) to ``llama3-70b-scaled`` (LLaMA3-70B's proportions at
toy size). ``RuntimeConfig`` is the ``[model]`` section a node is started with.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvstore.layout import DTYPE_BYTES, PageLayout
from model.precision import AUTO, native_dtype

# Byte-level tokenizer vocabulary (model/tokenizer.py): 256 bytes + 8 specials.
BYTE_VOCAB_SIZE = 264


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None, or llama3-style: {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"}.
    rope_scaling: dict | None = None
    tie_embeddings: bool = False
    attention_bias: bool = False  # Qwen2-style bias on q/k/v projections
    max_position: int = 8192

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_eps and rope_theta must be positive")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"rope_scaling type {kind!r} unsupported (llama3 or default)")
            if kind == "llama3":
                for key in ("factor", "low_freq_factor", "high_freq_factor",
                            "original_max_position_embeddings"):
                    if key not in self.rope_scaling:
                        raise ValueError(f"rope_scaling lacks {key!r}")

    @property
    def gqa(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        q = self.num_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        per_layer = attn + 3 * h * self.intermediate_size + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.num_layers * per_layer + embed + h

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """From a HF LLaMA/Qwen2/Mistral ``config.json`` dict."""
        if hf.get("hidden_act", "silu") != "silu" or hf.get("mlp_bias", False):
            raise ValueError("only SwiGLU MLPs without bias (hidden_act silu) are supported")
        if hf.get("model_type", "llama") != "qwen2" and hf.get("attention_bias", False):
            # LLaMA's attention_bias also biases o_proj, which we do not model.
            raise ValueError("attention_bias is supported for Qwen2-style q/k/v bias only")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        # transformers >= 5 writes "rope_parameters" (theta inside); older
        # versions "rope_theta" + "rope_scaling".
        scaling = hf.get("rope_parameters") or hf.get("rope_scaling")
        theta = (scaling or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
            if scaling.get("rope_type", scaling.get("type")) in ("default", None):
                scaling = None
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"], num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate_size=hf["intermediate_size"], rms_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", hf.get("model_type") == "qwen2")),
            max_position=hf.get("max_position_embeddings", 8192),
        )


def _dummy(**kw: Any) -> ModelConfig:
    return ModelConfig(vocab_size=BYTE_VOCAB_SIZE, **kw)


DUMMY_CONFIGS: dict[str, ModelConfig] = {
    # Unit tests: a few ms per call.
    "tiny": _dummy(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=160, max_position=4096),
    # The default: an 8k-token uncached prefill takes a few seconds on 2 CPU
    # cores (see docs/model.md for the measured figures); GQA 4.
    "dummy": _dummy(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64,
                    intermediate_size=1408, rope_theta=500000.0, max_position=32768),
    # LLaMA3-70B's proportions (GQA 8, d_ff = 3.5 d, theta 5e5, llama3 RoPE
    # scaling as in 3.1) scaled down from d=8192, 80 layers, 64 heads.
    "llama3-70b-scaled": _dummy(
        hidden_size=1024, num_layers=10, num_heads=16, num_kv_heads=2, head_dim=64,
        intermediate_size=3584, rope_theta=500000.0, max_position=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


@dataclass
class RuntimeConfig:
    """The model a node serves and how it runs it: the ``[model]`` section of a node's config."""

    # "dummy", another name in DUMMY_CONFIGS, or a local HF checkpoint directory.
    model: str = "dummy"
    # Torch device: cpu, cuda[:N], mps or xpu.
    device: str = "cpu"
    # Weight and KV dtype: float32, bfloat16, float16, or "auto": bfloat16
    # where the device computes it natively (a CPU with AVX512-BF16 or AMX
    # whose bf16 products, plain or in fixed row tiles, give a row the same
    # bits whatever rows are beside it, probed at start; a CUDA device with
    # bf16), float32 elsewhere (model/precision.py, model/linear.py).  Every
    # node of a cluster must use the same.
    dtype: str = "auto"
    # Tokens per prefill chunk (the paper chunks above ~1000).
    prefill_chunk: int = 1024
    # Seed of the dummy weights: every node of a cluster must use the same.
    seed: int = 0
    # Torch intra-op threads of this process; 0 leaves torch's default.
    torch_threads: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be a dummy config name or a checkpoint directory")
        if self.dtype != AUTO and self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be {AUTO} or one of {sorted(DTYPE_BYTES)}, "
                             f"got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith(("cuda", "mps", "xpu"))):
            raise ValueError(f"device must be cpu, cuda[:N], mps or xpu, got {self.device!r}")
        if self.prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be positive, got {self.prefill_chunk}")
        if self.torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {self.torch_threads}")
        if self.dtype == AUTO:   # resolved once: everything downstream sees a real dtype
            self.dtype = native_dtype(self.device)

    @property
    def is_dummy(self) -> bool:
        return self.model in DUMMY_CONFIGS

    @classmethod
    def from_dict(cls, d: dict) -> "RuntimeConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config field(s): {sorted(unknown)}")
        return cls(**d)


def load_model_config(model: str) -> ModelConfig:
    """The ModelConfig of a dummy name or of a checkpoint directory."""
    if model in DUMMY_CONFIGS:
        return DUMMY_CONFIGS[model]
    path = Path(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model {model!r} is neither a dummy config "
                         f"({', '.join(DUMMY_CONFIGS)}) nor a directory with config.json")
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def page_layout(config: ModelConfig, block_size: int, dtype: str = "float32") -> PageLayout:
    """The KV page layout (kvstore/layout.py) this model needs."""
    return PageLayout(num_layers=config.num_layers, block_size=block_size,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)


def stage_layers(num_layers: int, stages: int, stage: int) -> tuple[int, int]:
    """Contiguous, near-equal layer range [first, end) of one pipeline stage."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    first = stage * base + min(stage, extra)
    return first, first + base + (1 if stage < extra else 0)
