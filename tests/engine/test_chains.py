"""Native chains (kiln.engine.chains) and the native attention kernel they run: the runs of
steps a CPU engine chains, their outputs against onnxruntime (BERT-style post-norm encoder
with a padding mask, GPT-2-style causal decoder with Slices), the step-by-step fallback for
inputs the program cannot take, concurrent contexts, KILN_CPU_CHAINS=0, and the attention
kernel against a float64 reference (masks, causal offsets, grouped heads, a fully masked row,
sizes off the register tile). Native programs are off here: inside a program these layers are
records of its own (kiln.engine.program_gemm, tested in test_program_gemm.py), and the chains
run where a signature gets no program."""

from __future__ import annotations

import math
import threading

import onnxruntime as ort
import pytest
import torch

import kiln
from bench.peers import max_rel_err
from kiln import native
from kiln.engine import chains
from kiln.settings import Settings
from kiln.zoo import build_onnx, sample_inputs

pytestmark = pytest.mark.skipif(not native.available, reason=native.why_not or "no kiln.native")

BERT = {"layers": 2, "hidden": 64, "heads": 2, "intermediate": 128, "vocab": 1000}
GPT2 = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 1000}


@pytest.fixture(autouse=True)
def _no_programs(monkeypatch):
    import kiln.settings

    monkeypatch.setattr(kiln.settings, "SETTINGS",
                        Settings.from_env({"KILN_CPU_PROGRAM": "0"}))


def _engine(model, cfg):
    path = str(build_onnx(model, **cfg))
    return path, kiln.Builder(kiln.BuilderConfig(device="cpu")).build(path)


def _chains(engine):
    return [st.fn for st in engine._executor.run_steps if isinstance(st.fn, chains.Chain)]


@pytest.mark.parametrize("model,cfg,batch,seq", [("bert-base", BERT, 2, 16),
                                                 ("gpt2", GPT2, 2, 12)])
def test_chained_engine_matches_onnxruntime(model, cfg, batch, seq):
    path, engine = _engine(model, cfg)
    found = _chains(engine)
    assert found, "no chain was formed"
    ops = {st.node.op.name for c in found for st in c.members}
    assert {"Attention", "FusedMatMul"} <= ops
    if model == "bert-base":  # the whole encoder is one chain: both layers' attention in it
        assert sum(st.node.op.name == "Attention" for st in found[0].members) == 2
    feeds = sample_inputs(model, batch, seq, **cfg)
    if "attention_mask" in feeds:  # padding: the mask reaches the native attention
        feeds["attention_mask"][1, seq // 2:] = 0
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = list(engine.create_context().run(feeds).values())
    assert max_rel_err(got, want) <= 1e-5
    assert all(isinstance(p, chains._Plan) for c in found for p in c.plans.values())


def test_off_switch_and_same_results(monkeypatch):
    path, engine = _engine("bert-base", BERT)
    feeds = sample_inputs("bert-base", 1, 8, **BERT)
    chained = list(engine.create_context().run(feeds).values())
    monkeypatch.setattr(chains, "SETTINGS", Settings.from_env({"KILN_CPU_CHAINS": "0"}))
    plain_engine = kiln.Builder(kiln.BuilderConfig(device="cpu")).build(path)
    assert not _chains(plain_engine)
    plain = list(plain_engine.create_context().run(feeds).values())
    assert max_rel_err(chained, plain) <= 1e-5


def test_an_input_the_program_cannot_take_runs_step_by_step():
    _, engine = _engine("bert-base", BERT)
    chain = _chains(engine)[0]
    feeds = sample_inputs("bert-base", 2, 8, **BERT)
    ctx = engine.create_context()
    want = list(ctx.run(feeds).values())
    # the same inputs, the hidden states handed over batch-interleaved (rows that do not
    # collapse to one stride): no program takes them
    seen = {}
    orig = chains.Chain.__call__

    def spy(self, call, *xs):
        if self is chain:
            xs = tuple(x.transpose(0, 1).contiguous().transpose(0, 1)
                       if isinstance(x, torch.Tensor) and x.dim() == 3 else x for x in xs)
            seen["n"] = True
        return orig(self, call, *xs)

    chains.Chain.__call__ = spy
    try:
        got = list(ctx.run(feeds).values())
    finally:
        chains.Chain.__call__ = orig
    assert seen and False in chain.plans.values()
    assert max_rel_err(got, want) <= 1e-5


def test_concurrent_contexts_get_their_own_results():
    _, engine = _engine("bert-base", BERT)
    feeds = [sample_inputs("bert-base", 1, 8, seed=s, **BERT) for s in range(4)]
    want = [list(engine.create_context().run(f).values()) for f in feeds]
    got: dict[int, list] = {}

    def work(i):
        ctx = engine.create_context()
        for _ in range(5):
            got[i] = list(ctx.run(feeds[i]).values())

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i in range(4):
        assert max_rel_err(got[i], want[i]) == 0.0


def _reference(q, k, v, bias, scale, causal):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = q.double() @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    if causal >= 0:
        i = torch.arange(q.shape[2]).reshape(-1, 1)
        s = s.masked_fill(torch.arange(k.shape[2]) > i + causal, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)  # a row with no key: zeros
    return (p @ v).float()


@pytest.mark.parametrize("b,h,hkv,sq,skv,d,causal,masked", [
    (1, 4, 4, 32, 32, 16, -1, True),
    (2, 4, 2, 37, 53, 24, -1, True),    # grouped heads, sizes off the tile
    (1, 3, 3, 5, 5, 7, 0, False),       # causal, tiny odd head size
    (2, 2, 2, 150, 170, 32, 20, True),  # more queries than one block, causal offset
    (1, 2, 1, 1, 17, 64, 16, False),    # one query (decoding) against a cache
])
def test_native_attention_against_float64(b, h, hkv, sq, skv, d, causal, masked):
    torch.manual_seed(0)
    x = torch.randn(b, sq, 3, h, d)
    q = x[:, :, 0].transpose(1, 2)  # strided views, as the chain passes them
    k = torch.randn(b, hkv, skv, d)
    v = torch.randn(b, skv, hkv, d).transpose(1, 2)
    bias = None
    if masked:
        bias = torch.zeros(b, 1, 1, skv)
        bias[0, 0, 0, -3:] = float("-inf")
    out = torch.empty(b, sq, h, d).transpose(1, 2)
    scale = 1 / math.sqrt(d)
    native.attention(q, k, v, bias, scale, causal, out)
    assert float((out - _reference(q, k, v, bias, scale, causal)).abs().max()) <= 2e-6


def test_native_attention_fully_masked_row_is_zeros_and_nan_propagates():
    q, k, v = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    bias = torch.zeros(1, 1, 3, 4)
    bias[0, 0, 1, :] = float("-inf")
    out = torch.empty(1, 1, 3, 8)
    native.attention(q, k, v, bias, 0.3, -1, out)
    assert torch.equal(out[0, 0, 1], torch.zeros(8))
    assert torch.isfinite(out).all()
    q[0, 0, 2, 0] = float("nan")
    native.attention(q, k, v, bias, 0.3, -1, out)
    assert torch.isnan(out[0, 0, 2]).all() and torch.isfinite(out[0, 0, 0]).all()


def test_native_attention_refuses_what_it_cannot_take():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attention"):
        native.attention(q, q, q, None, 1.0, -1, torch.empty(1, 2, 4, 8).transpose(2, 3))
    with pytest.raises(ValueError, match="attention"):
        native.attention(q, q, q, torch.zeros(3, 1, 1, 4), 1.0, -1, torch.empty(1, 2, 4, 8))


class _Step:
    def __init__(self, ins, outs):
        self.ins, self.outs = ins, outs


def _overlap(a, b) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1]


def test_arena_reuses_dead_values_and_never_overlaps_live_ones():
    """A layer-like chain: x -> q (GEMM) -> view of q (Slice) -> a (attention, reads the view) ->
    y (GEMM, reads a and x) -> z (LN of y) -> ... repeated; slot 0 is the external input, the
    last value escapes (own). Values that are live at once never share floats, a step's output
    never lands on its inputs, and the arena is smaller than all values put end to end."""
    V = chains._Val
    values, steps, nxt = {0: V((4, 8), None, 0, 8)}, [], 1
    x = 0
    for _ in range(4):
        q, view, a, y, z = range(nxt, nxt + 5)
        nxt += 5
        values[q] = V((4, 24), None, 0, 24)
        values[view] = V((4, 8), q, 8, 24)
        values[a] = V((4, 8), None, 0, 8)
        values[y] = V((4, 8), None, 0, 8)
        values[z] = V((4, 8), None, 0, 8)
        steps += [_Step([x, 100], [q]), _Step([q, 101, 102], [view]), _Step([q, view], [a]),
                  _Step([a, 103, 104, x], [y]), _Step([y, 105], [z])]
        x = z
    own = {x}
    offsets, end = chains._arena_offsets(steps, values, own)
    size = {s: (math.prod(values[s].shape) + 15) // 16 * 16 for s in offsets}
    assert set(offsets) == {s for s, v in values.items() if v.base is None} - own - {0}
    assert all(off % 16 == 0 for off in offsets.values())  # 64-byte starts
    root = {s: (s if v.base is None else v.base) for s, v in values.items()}
    born = {s: i for i, st in enumerate(steps) for s in st.outs}
    last = {}
    for i, st in enumerate(steps):
        for s in st.ins:
            if s in root:
                last[root[s]] = i
    span = {s: (born[s], last.get(s, born[s])) for s in offsets}
    for s in offsets:
        for t in offsets:
            live_together = s != t and span[s][0] <= span[t][1] and span[t][0] <= span[s][1]
            if live_together:  # (a step's outputs and inputs included: their spans meet)
                assert not _overlap((offsets[s], size[s]), (offsets[t], size[t])), (s, t)
    assert end < sum(size.values())  # dead values' space was reused
    assert end >= max(offsets[s] + size[s] for s in offsets)
