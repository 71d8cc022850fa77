import pytest
import torch

from kiln.errors import ModelLoadError
from kiln.llm.config import ModelConfig, rope_inv_freq
from tests.llm.helpers import TINY

SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_rope_scaling_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = {**TINY, "rope_scaling": dict(scaling), "max_position_embeddings": 512}
    ours, our_factor = rope_inv_freq(ModelConfig.from_hf(hf))
    ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](LlamaConfig(**hf), "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-7)
    assert our_factor == pytest.approx(ref_factor)


def test_default_rope_and_unknown_scaling():
    inv, f = rope_inv_freq(ModelConfig.from_hf(TINY))
    torch.testing.assert_close(inv, 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
    assert f == 1.0
    with pytest.raises(ModelLoadError, match="rope_scaling type 'weird'"):
        rope_inv_freq(ModelConfig.from_hf({**TINY, "rope_scaling": {"rope_type": "weird"}}))


def test_config_errors_name_the_problem():
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel is not supported"):
        ModelConfig.from_hf({**TINY, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ModelLoadError, match="do not divide"):
        ModelConfig.from_hf({**TINY, "num_key_value_heads": 3})


def test_gguf_metadata_config(smollm2_metadata):
    c = ModelConfig.from_gguf(smollm2_metadata, has_output=False)
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (30, 576, 9, 3, 64)
    assert c.tie_embeddings and c.rope_theta == 100000.0 and c.eos_token_ids == (2,)
