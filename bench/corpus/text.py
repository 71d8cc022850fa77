"""Hugging Face ``transformers`` models built from small configs with seeded random weights.

The definitions are the library's; the thin wrappers here only turn positional tensors into its
keyword arguments and its output object into a tuple of tensors, as an export needs.
"""

from __future__ import annotations

from bench.corpus.spec import Spec, ones, seeded, tokens

SEQ = 128
VOCAB = 1000
HF = ("transformers",)


def _wrap(model, arg_names: tuple[str, ...], out_keys: tuple[str, ...]):
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *args):
            out = self.model(**dict(zip(arg_names, args)))
            return tuple(out[k] for k in out_keys)

    return Wrapped().eval()


def _bert(attn: str, base: bool = False):
    def make():
        from transformers import BertConfig, BertModel

        # base: bert-base-uncased's shape (768 wide, 12 layers, 30522 tokens), the GPU figure
        cfg = (BertConfig(attn_implementation=attn) if base else
               BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4,
                          num_attention_heads=4, intermediate_size=1024,
                          attn_implementation=attn))
        return _wrap(BertModel(cfg), ("input_ids", "attention_mask", "token_type_ids"),
                     ("last_hidden_state", "pooler_output"))
    return make


def _distilbert():
    from transformers import DistilBertConfig, DistilBertModel

    # eager attention: opset 13 has no form of torch's scaled_dot_product_attention
    cfg = DistilBertConfig(vocab_size=VOCAB, dim=256, n_layers=3, n_heads=4, hidden_dim=1024,
                           attn_implementation="eager")
    return _wrap(DistilBertModel(cfg), ("input_ids", "attention_mask"), ("last_hidden_state",))


def _roberta():
    from transformers import RobertaConfig, RobertaModel

    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=1024,
                        max_position_embeddings=SEQ + 4)
    return _wrap(RobertaModel(cfg, add_pooling_layer=False), ("input_ids", "attention_mask"),
                 ("last_hidden_state",))


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=256, n_layer=4, n_head=4,
                      bos_token_id=0, eos_token_id=0)


def _gpt2():
    from transformers import GPT2LMHeadModel

    return _wrap(GPT2LMHeadModel(_gpt2_config()), ("input_ids", "attention_mask"), ("logits",))


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=512)


def _llama():
    from transformers import LlamaForCausalLM

    return _wrap(LlamaForCausalLM(_llama_config()), ("input_ids", "attention_mask"),
                 ("logits",))


def _with_past(model, n_layers: int):
    """A decode step: ``(input_ids, attention_mask, past_0_key, past_0_value, ...)`` ->
    ``(logits, present_0_key, present_0_value, ...)``, the cache as flat tensors."""
    import torch
    from transformers import DynamicCache

    class DecodeStep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, *past):
            cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1])
                                                 for i in range(n_layers)])
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             past_key_values=cache, use_cache=True)
            present = out.past_key_values
            flat = [t for layer in present.layers for t in (layer.keys, layer.values)]
            return (out.logits, *flat)

    return DecodeStep().eval()


def _gpt2_past():
    from transformers import GPT2LMHeadModel

    return _with_past(GPT2LMHeadModel(_gpt2_config()), 4)


def _llama_past():
    from transformers import LlamaForCausalLM

    return _with_past(LlamaForCausalLM(_llama_config()), 4)


def _t5_encoder():
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=VOCAB, d_model=256, d_kv=32, d_ff=1024, num_layers=4,
                   num_heads=8, feed_forward_proj="gated-gelu")
    return _wrap(T5EncoderModel(cfg), ("input_ids", "attention_mask"), ("last_hidden_state",))


def _bart_encoder():
    from transformers import BartConfig, BartModel

    cfg = BartConfig(vocab_size=VOCAB, d_model=256, encoder_layers=3, decoder_layers=1,
                     encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=1024, decoder_ffn_dim=1024, max_position_embeddings=256,
                     attn_implementation="eager")
    return _wrap(BartModel(cfg).get_encoder(), ("input_ids", "attention_mask"),
                 ("last_hidden_state",))


def _vit_hf():
    from transformers import ViTConfig, ViTModel

    cfg = ViTConfig(hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                    intermediate_size=768, image_size=224, patch_size=16)
    return _wrap(ViTModel(cfg, add_pooling_layer=False), ("pixel_values",),
                 ("last_hidden_state",))


def _whisper_encoder():
    from transformers import WhisperConfig, WhisperModel

    cfg = WhisperConfig(vocab_size=VOCAB, d_model=192, encoder_layers=2, decoder_layers=1,
                        encoder_attention_heads=3, decoder_attention_heads=3,
                        encoder_ffn_dim=768, decoder_ffn_dim=768, num_mel_bins=80,
                        max_source_positions=750, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1)
    return _wrap(WhisperModel(cfg).get_encoder(), ("input_features",), ("last_hidden_state",))


def _seq_axes(*names):
    return {n: {0: "batch", 1: "seq"} for n in names}


def _bert_inputs():
    return [tokens("input_ids", SEQ, VOCAB), ones("attention_mask", [1, SEQ]),
            tokens("token_type_ids", SEQ, 2)]


def _ids_mask():
    return [tokens("input_ids", SEQ, VOCAB), ones("attention_mask", [1, SEQ])]


def _past_inputs(heads: int, head_dim: int, past: int = 32, layers: int = 4):
    from bench.corpus.manifest import InputSpec

    kv = [InputSpec(f"past_{i}_{kind}", [1, heads, past, head_dim])
          for i in range(layers) for kind in ("key", "value")]
    return [tokens("input_ids", 1, VOCAB), ones("attention_mask", [1, past + 1]), *kv]


def _past_axes(layers: int = 4):
    axes = {"input_ids": {0: "batch"}, "attention_mask": {0: "batch", 1: "total"}}
    for i in range(layers):
        for kind in ("key", "value"):
            axes[f"past_{i}_{kind}"] = {0: "batch", 2: "past"}
    return axes


def _past_outputs(layers: int = 4):
    return ["logits"] + [f"present_{i}_{kind}" for i in range(layers) for kind in ("key", "value")]


def specs() -> list[Spec]:
    bert_axes = _seq_axes("input_ids", "attention_mask", "token_type_ids")
    mask_axes = _seq_axes("input_ids", "attention_mask")
    bert_out = ["last_hidden_state", "pooler_output"]
    common = dict(requires=HF)
    return [
        Spec("hf_bert_sdpa_op17", "encoder", "transformers BertModel (sdpa attention)",
             "torchscript", _bert_inputs(), bert_out, 17, make=seeded(_bert("sdpa")),
             dynamic=bert_axes, **common),
        Spec("hf_bert_base_sdpa_op17", "encoder",
             "transformers BertModel, bert-base shape (sdpa attention)", "torchscript",
             _bert_inputs(), bert_out, 17, make=seeded(_bert("sdpa", base=True)),
             dynamic=bert_axes, **common),
        Spec("hf_bert_eager_op13", "encoder", "transformers BertModel (eager attention)",
             "torchscript", _bert_inputs(), bert_out, 13, make=seeded(_bert("eager")),
             dynamic=bert_axes, **common),
        Spec("hf_bert_dynamo_op18", "encoder", "transformers BertModel (sdpa attention)",
             "dynamo", _bert_inputs(), bert_out, 18, make=seeded(_bert("sdpa")),
             requires=("transformers", "onnxscript")),
        Spec("hf_distilbert_op13", "encoder", "transformers DistilBertModel (eager attention)",
             "torchscript", _ids_mask(), ["last_hidden_state"], 13, make=seeded(_distilbert),
             dynamic=mask_axes, **common),
        Spec("hf_roberta_op17", "encoder", "transformers RobertaModel", "torchscript",
             _ids_mask(), ["last_hidden_state"], 17, make=seeded(_roberta),
             dynamic=mask_axes, **common),
        Spec("hf_gpt2_op17", "decoder", "transformers GPT2LMHeadModel (no cache)",
             "torchscript", _ids_mask(), ["logits"], 17, make=seeded(_gpt2),
             dynamic=mask_axes, **common),
        Spec("hf_gpt2_past_op17", "decoder", "transformers GPT2LMHeadModel (decode step, "
             "past_key_values in and out)", "torchscript", _past_inputs(4, 64),
             _past_outputs(), 17, make=seeded(_gpt2_past), dynamic=_past_axes(), **common),
        Spec("hf_llama_op17", "decoder", "transformers LlamaForCausalLM (GQA, RoPE, RMSNorm)",
             "torchscript", _ids_mask(), ["logits"], 17, make=seeded(_llama),
             dynamic=mask_axes, **common),
        Spec("hf_llama_past_op17", "decoder", "transformers LlamaForCausalLM (decode step, "
             "past_key_values in and out)", "torchscript", _past_inputs(4, 32),
             _past_outputs(), 17, make=seeded(_llama_past), dynamic=_past_axes(), **common),
        Spec("hf_llama_dynamo_op18", "decoder", "transformers LlamaForCausalLM", "dynamo",
             _ids_mask(), ["logits"], 18, make=seeded(_llama),
             requires=("transformers", "onnxscript")),
        Spec("hf_t5_encoder_op17", "seq2seq-encoder", "transformers T5EncoderModel",
             "torchscript", _ids_mask(), ["last_hidden_state"], 17, make=seeded(_t5_encoder),
             dynamic=mask_axes, **common),
        Spec("hf_bart_encoder_op13", "seq2seq-encoder",
             "transformers BartModel encoder (eager attention)", "torchscript", _ids_mask(),
             ["last_hidden_state"], 13, make=seeded(_bart_encoder),
             dynamic=mask_axes, **common),
        Spec("hf_vit_op17", "vision-transformer", "transformers ViTModel", "torchscript",
             [_pixels()], ["last_hidden_state"], 17, make=seeded(_vit_hf),
             dynamic={"pixel_values": {0: "batch"}}, **common),
        Spec("hf_whisper_encoder_op17", "audio-encoder", "transformers WhisperModel encoder",
             "torchscript", [_mel()], ["last_hidden_state"], 17,
             make=seeded(_whisper_encoder), dynamic={"input_features": {0: "batch"}}, **common),
    ]


def _pixels():
    from bench.corpus.spec import image

    return image("pixel_values")


def _mel():
    from bench.corpus.manifest import InputSpec

    return InputSpec("input_features", [1, 80, 1500])
