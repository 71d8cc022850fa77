"""Tiny Llama models built from code (seeded), a GGUF writer, and a fake model runner."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from kiln.llm.gguf import quantize_q4_1, quantize_q8_0
from kiln.llm.loader import permute_qk

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
            eos_token_id=2)


def tiny_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]

    def r(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale
    sd = {"model.embed_tokens.weight": r(v, h, scale=0.5), "model.norm.weight": 1 + r(h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd.update({p + "input_layernorm.weight": 1 + r(h),
                   p + "post_attention_layernorm.weight": 1 + r(h),
                   p + "self_attn.q_proj.weight": r(q, h, scale=0.3),
                   p + "self_attn.k_proj.weight": r(kv, h, scale=0.3),
                   p + "self_attn.v_proj.weight": r(kv, h), p + "self_attn.o_proj.weight": r(h, q),
                   p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h),
                   p + "mlp.down_proj.weight": r(h, i)})
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = r(v, h, scale=0.5)
    return sd


def write_hf_dir(d: Path, cfg: dict, sd: dict, tokenizer=None) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": tokenizer.chat_template, "eos_token": "<|im_end|>"}))
    return d


# --- a GGUF writer (the format as documented in kiln/llm/gguf.py) --------------------------------

def _s(x: str) -> bytes:
    b = x.encode()
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<Iq", 11, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _s(v)
    if isinstance(v, list):
        if v and isinstance(v[0], str):
            return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_s(x) for x in v)
        return struct.pack("<IIQ", 9, 5, len(v)) + np.asarray(v, "<i4").tobytes()
    raise TypeError(v)


def write_gguf(path: Path, metadata: dict, tensors: dict[str, tuple[int, bytes, tuple]]):
    """``tensors``: name -> (ggml type, raw bytes, numpy shape)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    head += b"".join(_s(k) + _value(v) for k, v in metadata.items())
    offset, infos, blobs = 0, b"", []
    for name, (gtype, raw, shape) in tensors.items():
        dims = tuple(reversed(shape))
        infos += _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        infos += struct.pack("<IQ", gtype, offset)
        pad = (-len(raw)) % 32
        blobs.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    body = head + infos
    body += b"\0" * ((-len(body)) % 32)
    path.write_bytes(body + b"".join(blobs))


def gguf_from_state_dict(path: Path, cfg: dict, sd: dict, tok_md: dict, quant: str = "q8_0"):
    """A llama GGUF of ``sd``: Q/K permuted as llama.cpp does, 2-D weights quantized."""
    md = {"general.architecture": "llama", "general.alignment": 32,
          "llama.block_count": cfg["num_hidden_layers"],
          "llama.context_length": cfg["max_position_embeddings"],
          "llama.embedding_length": cfg["hidden_size"],
          "llama.feed_forward_length": cfg["intermediate_size"],
          "llama.attention.head_count": cfg["num_attention_heads"],
          "llama.attention.head_count_kv": cfg["num_key_value_heads"],
          "llama.rope.freq_base": cfg["rope_theta"],
          "llama.attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
          "llama.rope.dimension_count": cfg["head_dim"], **tok_md}
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    tensors = {}
    for k, v in sd.items():
        w = v.numpy().astype(np.float32)
        if k in names:
            gname = names[k]
        else:
            n, rest = k.split(".", 3)[2], k.split(".", 3)[3]
            gname = f"blk.{n}.{layer[rest]}"
        if gname.endswith("attn_q.weight"):
            w = permute_qk(w, cfg["num_attention_heads"])
        if gname.endswith("attn_k.weight"):
            w = permute_qk(w, cfg["num_key_value_heads"])
        if w.ndim == 1:
            tensors[gname] = (0, w.tobytes(), w.shape)
        elif quant == "q4_1":
            tensors[gname] = (3, quantize_q4_1(w), w.shape)
        else:
            tensors[gname] = (8, quantize_q8_0(w), w.shape)
    write_gguf(path, md, tensors)
