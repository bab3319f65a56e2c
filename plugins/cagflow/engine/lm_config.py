"""What the int8 engine reads from a model's configuration: its shapes (``LMConfig``), RoPE tables, whether the
engine can run it, and the recipe name it will run it with (part of every snapshot key)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .kernels import MKL_STRICT_ERROR, amx_ready, native_kernels

RECIPE_VERSION = "fastlm-v1"  # bump when the numerics change: snapshots of another recipe are not reusable
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
Q4K_SUFFIX = "/q4k"  # a recipe whose weights are partly the GGUF's Q4_K blocks (``q4k``)


@dataclass(frozen=True)
class LMConfig:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    max_positions: int
    tie_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        """Snapshot size per prefix token (K and V, all layers, bf16)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def supports(hf_config) -> bool:
    """Whether this engine can run a model with this (transformers) configuration."""
    try:
        config_from_hf(hf_config)
    except ValueError:
        return False
    return True


def shapes_fit_native(config: LMConfig) -> bool:
    return config.head_dim in (64, 128) and config.hidden % 16 == 0 and config.intermediate % 16 == 0


def recipe_for(hf_config, prefill_block: int = 512, q4k: bool = False) -> str:
    """The recipe ``FastLM`` will use for this model on this machine, without loading weights (compiles the
    kernels when they are not built yet): it is part of the model fingerprint, so every snapshot key. ``q4k``:
    the model's GGUF Q4_K blocks are wanted, which the native backend alone computes with."""
    config = config_from_hf(hf_config)
    if shapes_fit_native(config) and native_kernels() is not None:
        return recipe_name("native", native_matmul(config), prefill_block, q4k)
    return recipe_name("torch", torch_matmul(), prefill_block)


def shapes_fit_amx(config: LMConfig) -> bool:
    """AMX tile products take the inputs 32 at a time."""
    return config.hidden % 32 == 0 and config.intermediate % 32 == 0 and (config.heads * config.head_dim) % 32 == 0


def native_matmul(config: LMConfig) -> str:
    """The native backend's matmul for this model here: ``amx`` (AMX tiles for blocks of ``AMX_MIN_WIDTH``
    tokens a row or more, mm_int8 for narrower ones) where the CPU, the OS and the shapes allow it, else
    ``native`` (mm_int8 for every block)."""
    return "amx" if shapes_fit_amx(config) and amx_ready() else "native"


def torch_matmul() -> str:
    return "int8pack" if MKL_STRICT_ERROR else "f32"


def recipe_name(backend: str, matmul: str, prefill_block: int, q4k: bool = False) -> str:
    return f"{RECIPE_VERSION}/{backend}/{matmul}/block{prefill_block}" + (Q4K_SUFFIX if q4k else "")


def config_from_hf(hf) -> LMConfig:
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"fastlm supports {SUPPORTED_MODEL_TYPES}, not {hf.model_type!r}")
    layer_types = getattr(hf, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types) or getattr(hf, "use_sliding_window", False):
        raise ValueError("fastlm needs full attention in every layer (no sliding window)")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported activation {hf.hidden_act!r}")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    eos = getattr(hf, "eos_token_id", None)
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return LMConfig(hf.model_type, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads,
                    hf.num_key_value_heads, head_dim, hf.intermediate_size, hf.vocab_size, float(hf.rms_norm_eps),
                    hf.max_position_embeddings, bool(getattr(hf, "tie_word_embeddings", False)), eos)


def rope_tables(hf, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, head_dim] fp32, computed by the model family's own rotary class (so rope_theta,
    rope scaling types and attention scaling follow transformers)."""
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("dynamic", "longrope"):
        raise ValueError(f"rope type {kind!r} depends on the sequence length; not supported")
    module = importlib.import_module(f"transformers.models.{hf.model_type}.modeling_{hf.model_type}")
    cls = next(getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding"))
    rotary = cls(hf)
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(x, torch.arange(positions)[None])
    return cos[0].float().contiguous(), sin[0].float().contiguous()


def folder_config(folder: Path) -> tuple[LMConfig, tuple[torch.Tensor, torch.Tensor]]:
    """An HF folder's configuration (EOS ids from generation_config.json included) and RoPE tables."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(folder))
    config = config_from_hf(hf)
    gen = folder / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        config = LMConfig(**{**config.__dict__, "eos_token_ids": tuple(sorted(set(config.eos_token_ids) | set(eos)))})
    return config, rope_tables(hf, config.max_positions)
