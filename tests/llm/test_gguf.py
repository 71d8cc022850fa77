import struct

import numpy as np
import pytest
import torch

from kiln.errors import ModelLoadError
from kiln.llm import gguf
from kiln.llm.loader import load_weights, permute_qk, unpermute_qk
from tests.llm.conftest import SMOLLM2, needs_smollm2
from tests.llm.helpers import TINY, gguf_from_state_dict, tiny_state_dict, write_gguf


def _q4_1_reference(raw: bytes) -> np.ndarray:
    # block by block, weight by weight, straight from the format's definition
    out = []
    for b in range(len(raw) // 20):
        blk = raw[b * 20:(b + 1) * 20]
        d, m = np.frombuffer(blk[:4], "<f2").astype(np.float32)
        lo = [d * (x & 0xF) + m for x in blk[4:]]
        hi = [d * (x >> 4) + m for x in blk[4:]]
        out += lo + hi
    return np.array(out, np.float32)


def _q8_0_reference(raw: bytes) -> np.ndarray:
    out = []
    for b in range(len(raw) // 34):
        blk = raw[b * 34:(b + 1) * 34]
        d = np.frombuffer(blk[:2], "<f2").astype(np.float32)[0]
        out += [d * q for q in np.frombuffer(blk[2:], np.int8)]
    return np.array(out, np.float32)


def test_dequantize_q4_1_matches_format():
    w = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
    raw = gguf.quantize_q4_1(w)
    got = gguf.dequantize(np.frombuffer(raw, np.uint8), gguf.Q4_1)
    np.testing.assert_allclose(got, _q4_1_reference(raw), rtol=1e-6, atol=1e-6)
    assert np.abs(got - w.reshape(-1)).max() < (w.max() - w.min()) / 15  # within one step


def test_dequantize_q8_0_matches_format():
    w = np.random.default_rng(1).normal(size=(3, 96)).astype(np.float32)
    raw = gguf.quantize_q8_0(w)
    got = gguf.dequantize(np.frombuffer(raw, np.uint8), gguf.Q8_0)
    np.testing.assert_allclose(got, _q8_0_reference(raw), rtol=1e-6)
    assert np.abs(got - w.reshape(-1)).max() < np.abs(w).max() / 100


def test_dequantize_q4_0_and_float_types():
    raw = bytes(np.array([0.5], "<f2").view(np.uint8)) + bytes(range(16))
    got = gguf.dequantize(np.frombuffer(raw, np.uint8), gguf.Q4_0)
    want = [0.5 * ((x & 0xF) - 8) for x in range(16)] + [0.5 * ((x >> 4) - 8) for x in range(16)]
    np.testing.assert_allclose(got, want)
    x = np.array([1.5, -2.25, 3.0], np.float32)
    f16 = np.frombuffer(x.astype("<f2").tobytes(), np.uint8)
    np.testing.assert_array_equal(gguf.dequantize(f16, gguf.F16), x)
    bf16 = np.frombuffer((x.view(np.uint32) >> 16).astype("<u2").tobytes(), np.uint8)
    np.testing.assert_array_equal(gguf.dequantize(bf16, gguf.BF16), x)


def test_unpermute_undoes_llama_cpp_permute():
    w = np.arange(8 * 16 * 5, dtype=np.float32).reshape(8 * 16, 5)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, 8), 8), w)
    assert not np.array_equal(permute_qk(w, 8), w)


def test_permuted_rows_give_interleaved_rope():
    # llama.cpp applies RoPE to (2i, 2i+1) pairs; HF to (i, i + d/2): on the permuted weights the
    # first must equal the second on the originals, which is what the permutation is for.
    rng = np.random.default_rng(2)
    d, heads = 8, 2
    w, x = rng.normal(size=(heads * d, 6)), rng.normal(size=6)
    ang = 0.7 * 10000 ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(ang), np.sin(ang)
    hf = (w @ x).reshape(heads, d)
    a, b = hf[:, : d // 2], hf[:, d // 2:]
    hf_rot = np.concatenate([a * c - b * s, b * c + a * s], 1)
    g = (permute_qk(w, heads) @ x).reshape(heads, d // 2, 2)
    g_rot = np.stack([g[..., 0] * c - g[..., 1] * s, g[..., 1] * c + g[..., 0] * s], -1)
    np.testing.assert_allclose(unpermute_qk(g_rot.reshape(-1, 1), heads).reshape(heads, d),
                               hf_rot, atol=1e-12)


def test_gguf_loads_like_the_hf_weights(tmp_path, smollm2_metadata):
    sd = tiny_state_dict(TINY)
    tok_md = {k: v for k, v in smollm2_metadata.items() if k.startswith("tokenizer.")}
    gguf_from_state_dict(tmp_path / "t.gguf", TINY, sd, tok_md, quant="q8_0")
    cfg, got = load_weights(tmp_path / "t.gguf")
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (4, 2, 16, True)
    for k, v in sd.items():
        tol = 1e-6 if v.ndim == 1 else float(v.abs().max()) / 100
        assert torch.allclose(got[k], v, atol=tol), k


def test_unsupported_tensor_type_is_named(tmp_path):
    write_gguf(tmp_path / "q6k.gguf", {"general.architecture": "llama"},
               {"token_embd.weight": (14, b"\0" * 210, (1, 256))})
    f = gguf.GGUFFile(tmp_path / "q6k.gguf")
    with pytest.raises(ModelLoadError, match="token_embd.weight.*Q6_K"):
        f.dequantize("token_embd.weight")


def test_bad_files_are_refused(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGML" + b"\0" * 20)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        gguf.GGUFFile(tmp_path / "x.gguf")
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    with pytest.raises(ModelLoadError, match="version 9"):
        gguf.GGUFFile(tmp_path / "v9.gguf")
    write_gguf(tmp_path / "ok.gguf", {"general.architecture": "llama", "a": "b" * 50}, {})
    whole = (tmp_path / "ok.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:40])
    with pytest.raises(ModelLoadError, match="truncated"):
        gguf.GGUFFile(tmp_path / "cut.gguf")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_weights(tmp_path / "missing.gguf")


@needs_smollm2
def test_smollm2_metadata_and_types():
    f = gguf.GGUFFile(SMOLLM2)
    assert f.metadata["general.architecture"] == "llama"
    assert f.metadata["llama.block_count"] == 30
    types = {t.type_name for t in f.tensors.values()}
    assert types <= {"Q4_1", "Q8_0", "F32"} and "Q4_1" in types
    w = f.dequantize("blk.0.attn_q.weight")
    assert w.shape == (576, 576) and np.isfinite(w).all()
