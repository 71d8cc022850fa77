"""Tokenizers: a Hugging Face ``tokenizer.json``, or a byte-level BPE built from GGUF metadata.

Also the chat template (Jinja, from ``tokenizer_config.json`` or ``tokenizer.chat_template``).
"""

from __future__ import annotations

import json
from pathlib import Path

from kiln.errors import ModelLoadError

# llama.cpp's `tokenizer.ggml.pre` names -> the regex its pre-tokenizer splits with (None: GPT-2's)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}"
                 r"\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE = {"smollm": "digits", "gpt2": None, "default": None, "llama-bpe": _LLAMA3_SPLIT,
        "llama3": _LLAMA3_SPLIT, "qwen2": _LLAMA3_SPLIT, "starcoder": "digits"}
_CONTROL, _USER_DEFINED = 3, 4


class Tokenizer:
    """``encode``/``decode`` over a ``tokenizers.Tokenizer`` plus the chat template."""

    def __init__(self, tok, chat_template: str | None, eos_token_ids: tuple[int, ...],
                 bos_token_id: int | None = None, add_bos: bool = False):
        self.tok = tok
        self.chat_template = chat_template
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._one: dict[tuple[int, bool], str] = {}  # decode_one's answers

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """``decode([token_id])``, remembered (streaming decodes one-token windows for every
        token of every request; at most two entries per vocabulary id)."""
        key = (token_id, skip_special_tokens)
        text = self._one.get(key)
        if text is None:
            text = self._one[key] = self.decode([token_id], skip_special_tokens)
        return text

    def token_text(self, token_id: int) -> str:
        return self.tok.id_to_token(token_id) or ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat (list of {"role", "content"})."""
        if not self.chat_template:
            raise ModelLoadError("this model's tokenizer has no chat template; use "
                                 "/v1/completions with a plain prompt instead")
        import jinja2.sandbox

        def fail(msg):
            raise ValueError(f"chat template: {msg}")

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = fail
        tmpl = env.from_string(self.chat_template)
        tok = self.tok

        def text_of(i):
            return tok.id_to_token(i) if i is not None else ""
        return tmpl.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=text_of(self.bos_token_id),
                           eos_token=text_of(self.eos_token_ids[0] if self.eos_token_ids
                                             else None))


def word_level(vocab: int) -> Tokenizer:
    """A placeholder of ``vocab`` made-up words ``t0 .. t{vocab-1}`` split on spaces (models with
    no tokenizer: random-weight benchmarks, ONNX decoders saved without one)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tok, None, ())  # no decoder: decoding joins the words with spaces


def from_gguf(md: dict) -> Tokenizer:
    """The tokenizer described by GGUF metadata (``tokenizer.ggml.*``)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported; kiln builds "
                             "byte-level BPE ('gpt2') tokenizers from GGUF only")
    tokens = md["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                 fuse_unk=False, ignore_merges=False))
    pre = md.get("tokenizer.ggml.pre", "default")
    split = _PRE.get(pre, None)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None
                                          or split == "digits")
    if split == "digits":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif split:
        from tokenizers import Regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type") or []
    special = [AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(special)
    eos = md.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(tok, md.get("tokenizer.chat_template"), () if eos is None else (eos,),
                     md.get("tokenizer.ggml.bos_token_id"),
                     bool(md.get("tokenizer.ggml.add_bos_token", False)))


def from_hf_dir(d: Path, eos_token_ids: tuple[int, ...], bos: int | None) -> Tokenizer:
    """The tokenizer saved next to a Hugging Face model (``tokenizer.json``)."""
    from tokenizers import Tokenizer as HFTokenizer

    f = d / "tokenizer.json"
    if not f.exists():
        raise ModelLoadError(f"{d} has no tokenizer.json (save the tokenizer with the model)")
    tok = HFTokenizer.from_file(str(f))
    cfg_file = d / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
    template = cfg.get("chat_template")
    eos = cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    ids = tuple(eos_token_ids)
    if eos and tok.token_to_id(eos) is not None and tok.token_to_id(eos) not in ids:
        ids = (*ids, tok.token_to_id(eos))
    return Tokenizer(tok, template, ids, bos, bool(cfg.get("add_bos_token", False)))
