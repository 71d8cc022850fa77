"""The CUDA runner's decode lookahead (a greedy decode step launches its successor on the device
before the engine asks): every request's tokens are the torch path's, whether the predicted step
comes (hits) or not (a request finished, stopped, arrived, or needs a new block: misses)."""

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

from kiln.llm import LLM, SamplingParams
from kiln.llm.cuda_runner import CudaModelRunner

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],  # 14: a new block at 16
           [100 + i for i in range(15)], [40] * 16, [7, 300, 22] * 10, [1000, 2000, 3000]]
MAX = [12, 20, 7, 16, 9]


def _run(eng, stop_token=None, late=True):
    """Each prompt with its max_tokens; the last arrives after 5 steps; prompt 1 (optionally)
    stops at ``stop_token``. Returns {prompt index: tokens}."""
    got, ids = {}, {}

    def add(i):
        p = SamplingParams(max_tokens=MAX[i], temperature=0, ignore_eos=True,
                           stop_token_ids=[stop_token] if stop_token is not None and i == 1
                           else [])
        ids[eng.add_request(PROMPTS[i], p).request_id] = i

    for i in range(len(PROMPTS) - 1):
        add(i)
    steps = 0
    while eng.has_unfinished() or (late and steps < 6):
        if late and steps == 5:
            add(len(PROMPTS) - 1)
        for o in eng.step():
            got.setdefault(ids[o.request_id], []).extend(o.new_token_ids)
        steps += 1
    return got


def _engine(tiny_dir, lookahead, ladder):
    llm = LLM(tiny_dir, num_blocks=64, device=DEV, dtype="float32")
    eng = llm.engine
    if DEV == "cpu":
        eng.runner = CudaModelRunner(eng.model, 64, eng.config.block_size, cuda_graphs=False,
                                     max_model_len=256, lookahead=lookahead)
        if ladder:  # padded batch sizes as on a GPU, each step run eagerly (no graph here)
            r = eng.runner
            r.sizes = [1, 2, 4, 8]
            r._capture = lambda step: r.graphs.__setitem__(step.size, step)
    else:
        eng.runner.lookahead = lookahead
    return eng


@pytest.mark.parametrize("ladder", [False, True])
def test_lookahead_keeps_every_token(tiny_dir, ladder):
    ref = _run(LLM(tiny_dir, num_blocks=64).engine)  # the CPU torch path
    stop = ref[1][4]  # prompt 1 stops at its fifth token: a miss nobody could predict
    ref_stop = _run(LLM(tiny_dir, num_blocks=64).engine, stop_token=stop)
    assert len(ref_stop[1]) < MAX[1]
    for stop_token, want in ((None, ref), (stop, ref_stop)):
        on = _engine(tiny_dir, True, ladder)
        assert _run(on, stop_token) == want
        st = on.runner.ahead_stats
        assert st["hits"] > 0 and st["misses"] > 0 and st["launched"] >= st["hits"]
        off = _engine(tiny_dir, False, ladder)
        assert _run(off, stop_token) == want
        assert off.runner.ahead_stats == {"hits": 0, "misses": 0, "launched": 0}


def test_lookahead_is_not_launched_past_the_tables_or_max_tokens(tiny_dir):
    eng = _engine(tiny_dir, True, ladder=True)
    r = eng.runner
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    eng.add_request([5] * 15, p)  # position 15 ends block 0: the next token needs block 1
    eng.step()  # prefill (mixed step): nothing launched ahead
    assert r._ahead is None
    eng.step()  # decode at position 15: position 16 is in a block not allocated yet
    assert r._ahead is None and r.ahead_stats["launched"] == 0
    eng.step()  # the third and last token: the batch changes after it
    assert r._ahead is None and not eng.has_unfinished()
    eng.add_request([5] * 3, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    assert r._ahead is not None and r.ahead_stats["launched"] == 1
    while eng.has_unfinished():
        eng.step()
    assert r.ahead_stats["hits"] == 2  # tokens 3 and 4 (no launch after the last)
    assert r.describe()["lookahead"] == {"on": True, "hits": 2, "misses": 0, "launched": 2}


def test_a_raw_decode_call_between_steps_drops_the_step_launched_ahead(tiny_dir):
    """runner._decode (as bench.llm_step calls it) refills the step buffers a step launched
    ahead sits in: that step is dropped, the engine's next step runs as usual."""
    want = _run(LLM(tiny_dir, num_blocks=64).engine, late=False)
    eng = _engine(tiny_dir, True, ladder=True)
    got, ids = {}, {}
    for i in range(len(PROMPTS) - 1):
        p = SamplingParams(max_tokens=MAX[i], temperature=0, ignore_eos=True)
        ids[eng.add_request(PROMPTS[i], p).request_id] = i
    r, raw = eng.runner, 0
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(ids[o.request_id], []).extend(o.new_token_ids)
        if r._ahead is not None and raw < 3:
            with torch.inference_mode():
                r._decode([7] * r._ahead.b, [3] * r._ahead.b, [(3, 1, [60])] * r._ahead.b)
            raw += 1
            assert r._ahead is None
    assert raw == 3 and got == want
