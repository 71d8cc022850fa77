import numpy as np
import pytest
import torch

from kiln.errors import KilnError
from kiln.llm.request import Request
from kiln.llm.sampling import Sampler, SamplingParams, apply_penalties, filter_logits

NEG = -np.inf


def ref_filter(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The documented semantics, written out with numpy sorts and loops."""
    x = np.asarray(logits, np.float64) / temperature
    keep = np.ones(len(x), bool)
    if top_k > 0:
        kth = np.sort(x)[::-1][top_k - 1]
        keep &= x >= kth
    x = np.where(keep, x, NEG)
    if top_p < 1.0:
        p = np.exp(x - x.max())
        p /= p.sum()
        order = np.argsort(-x, kind="stable")
        mass, allowed = 0.0, set()
        for i in order:
            if mass >= top_p and allowed:
                break
            allowed.add(i)
            mass += p[i]
        x = np.array([v if i in allowed else NEG for i, v in enumerate(x)])
    if min_p > 0:
        p = np.exp(x - x.max())
        p /= p.sum()
        x = np.where(p >= min_p * p.max(), x, NEG)
    return x


def ref_penalties(logits, prompt, output, rep=1.0, freq=0.0, pres=0.0):
    x = np.array(logits, np.float64)
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    for t in set(output):
        c = output.count(t)
        x[t] -= freq * c + pres
    return x


@pytest.mark.parametrize("kw", [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2),
                                dict(top_k=8, top_p=0.9, min_p=0.05, temperature=0.7),
                                dict(temperature=2.0, top_p=0.3)])
def test_filters_match_reference(kw):
    rng = np.random.default_rng(0)
    for _ in range(5):
        logits = rng.normal(size=50) * 3
        got = filter_logits(torch.tensor(logits, dtype=torch.float64), SamplingParams(**kw))
        want = ref_filter(logits, **kw)
        np.testing.assert_array_equal(np.isinf(got.numpy()), np.isinf(want))
        fin = ~np.isinf(want)
        np.testing.assert_allclose(got.numpy()[fin], want[fin], rtol=1e-12)


def test_penalties_match_reference():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=30)
    prompt, output = [1, 2, 3, 3], [3, 4, 4, 4, 7]
    p = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25)
    got = apply_penalties(torch.tensor(logits), p, prompt, output)
    np.testing.assert_allclose(got.numpy(), ref_penalties(logits, prompt, output, 1.3, 0.4, 0.25))


def _req(rid, params, prompt=(1, 2), output=()):
    return Request(rid, list(prompt), params, output_token_ids=list(output))


def test_greedy_is_argmax_and_penalty_changes_it():
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    s = Sampler()
    assert s.sample(logits, [_req("a", SamplingParams(temperature=0))]) == [1]
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert s.sample(logits, [_req("b", p, prompt=[1])]) == [2]


def test_seed_repeats_and_top_k_1_is_greedy():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(0))
    draws = []
    for _ in range(2):
        s = Sampler()
        r = _req("x", SamplingParams(temperature=1.0, seed=123))
        draws.append([s.sample(logits, [r])[0] for _ in range(20)])
    assert draws[0] == draws[1] and len(set(draws[0])) > 1
    r = _req("k", SamplingParams(temperature=1.5, top_k=1))
    assert Sampler().sample(logits, [r]) == [int(logits.argmax())]


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    s = Sampler()
    r = _req("d", p)
    n = 4000
    counts = np.bincount([s.sample(logits, [r])[0] for _ in range(n)], minlength=6)
    want = ref_filter(logits[0].numpy(), temperature=0.8, top_p=0.9)
    prob = np.exp(want - want.max())
    prob /= prob.sum()
    assert counts[np.isinf(want)].sum() == 0
    np.testing.assert_allclose(counts / n, prob, atol=0.03)


def test_bad_params_name_the_field():
    with pytest.raises(KilnError, match="top_p=1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(KilnError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    with pytest.raises(KilnError, match="temperature"):
        SamplingParams(temperature=-1)


ROW_PARAMS = [dict(temperature=0.7, top_k=5), dict(temperature=1.0), dict(top_p=0.6),
              dict(min_p=0.2, temperature=1.3), dict(top_k=8, top_p=0.9, min_p=0.05,
                                                      temperature=0.7),
              dict(top_k=1000), dict(temperature=2.0, top_p=0.3)]


def test_filter_rows_is_filter_logits_row_by_row():
    from kiln.llm.sampling import filter_rows

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(len(ROW_PARAMS), 50, generator=g) * 3
    logits[0, :6] = 4.0  # ties at the k-th value
    params = [SamplingParams(**kw) for kw in ROW_PARAMS]
    got = filter_rows(logits, params)
    for i, p in enumerate(params):
        want = filter_logits(logits[i], p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, ROW_PARAMS[i])
        keep = ~torch.isinf(want)
        torch.testing.assert_close(got[i][keep], want[keep])


def test_a_mixed_batch_samples_each_row_as_alone():
    """Greedy, penalized and drawn rows in one call: each row's token is the one it gets
    alone (seeded draws come from the request's own generator)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 80, generator=g) * 2
    mk = [lambda: _req("g", SamplingParams(temperature=0)),
          lambda: _req("p", SamplingParams(temperature=0, repetition_penalty=3.0), prompt=[
              int(logits[1].argmax())]),
          lambda: _req("d", SamplingParams(temperature=0.9, top_p=0.8, seed=11)),
          lambda: _req("e", SamplingParams(temperature=1.2, top_k=10, seed=12,
                                           frequency_penalty=0.5), output=[3, 3, 5])]
    sb, sa = Sampler(), [Sampler() for _ in mk]
    rb, ra = [m() for m in mk], [m() for m in mk]
    for _ in range(3):  # a few steps: each request's generator advances alike
        batch = sb.sample(logits, rb)
        alone = [sa[i].sample(logits[i:i + 1], [ra[i]])[0] for i in range(len(mk))]
        assert batch == alone
    assert batch[0] == int(logits[0].argmax()) and batch[1] != int(logits[1].argmax())
