"""GPT-2 / Llama-style ONNX decoders with past_key_values (the corpus exports: transformers,
random weights) through kiln's ONNX frontend in the LLM runtime, against onnxruntime greedy."""

from pathlib import Path

import numpy as np
import pytest

from kiln.errors import ModelLoadError
from kiln.llm import LLM, SamplingParams

CORPUS = Path.home() / ".cache" / "kiln" / "corpus"
PROMPTS = [[5, 17, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9], [999]]
N = 10


@pytest.fixture(scope="module", params=["hf_gpt2_past_op17", "hf_llama_past_op17"])
def decoder(request, tmp_path_factory):
    path = CORPUS / f"{request.param}.onnx"
    if not path.exists():  # export it as the corpus does (transformers, seeded weights)
        pytest.importorskip("transformers")
        from bench.corpus.export import export_torch
        from bench.corpus.registry import get

        path = tmp_path_factory.mktemp("onnx") / f"{request.param}.onnx"
        export_torch(get(request.param), path)
    return path


def ort_greedy(path: Path, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    past_names = [i.name for i in sess.get_inputs() if i.name.startswith("past")]
    shape = sess.get_inputs()[2].shape
    past = {p: np.zeros((1, shape[1], 0, shape[3]), np.float32) for p in past_names}
    toks, out, logits = list(prompt), [], []
    for i in range(len(prompt) + n - 1):
        feeds = {"input_ids": np.array([[toks[i]]], np.int64),
                 "attention_mask": np.ones((1, i + 1), np.int64), **past}
        res = dict(zip(names, sess.run(None, feeds)))
        past = {p: res[p.replace("past", "present")] for p in past_names}
        if i >= len(prompt) - 1:
            logits.append(res["logits"][0, -1])
            out.append(int(logits[-1].argmax()))
            toks.append(out[-1])
    return out, logits


def test_onnx_decoder_greedy_equals_onnxruntime(decoder):
    llm = LLM(decoder, num_blocks=64)
    p = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    batch = llm.generate(PROMPTS, p)  # three requests in flight together
    for prompt, o in zip(PROMPTS, batch):
        ref, _ = ort_greedy(decoder, prompt, N)
        assert o.outputs[0].token_ids == ref, prompt
        assert o.outputs[0].text.split() == [f"t{t}" for t in ref]  # the placeholder words
    alone = llm.generate([PROMPTS[1]], p)[0]
    assert alone.outputs[0].token_ids == batch[1].outputs[0].token_ids


def test_onnx_decoder_logits_match_onnxruntime(decoder):
    from kiln.llm.onnx_decoder import OnnxDecoder

    m = OnnxDecoder(decoder)
    ctx = m.engine.create_context()
    ref_tokens, ref_logits = ort_greedy(decoder, PROMPTS[0], 4)
    past, toks = m.empty_past(), PROMPTS[0] + ref_tokens
    for i in range(len(toks) - 1):
        logits, past = m.run(ctx, [toks[i]], past, i)
        if i >= len(PROMPTS[0]) - 1:
            np.testing.assert_allclose(logits, ref_logits[i - len(PROMPTS[0]) + 1],
                                       rtol=1e-4, atol=1e-4)


def test_onnx_without_past_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    path = tmp_path / "plain.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    with pytest.raises(ModelLoadError, match="past_key_values"):
        LLM(path, num_blocks=8)
