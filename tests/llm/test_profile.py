"""The engine's step profile (kiln.llm.profile): every step's parts recorded, outputs unchanged."""

from kiln.llm import LLM, SamplingParams
from kiln.llm.profile import PARTS, StepProfile


def _run(engine, prompts, p):
    reqs = [engine.add_request(q, p).request_id for q in prompts]
    got = {r: [] for r in reqs}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        steps += 1
    return [got[r] for r in reqs], steps


def test_profile_records_each_step_and_changes_nothing(tiny_dir):
    eng = LLM(tiny_dir, num_blocks=64, max_num_batched_tokens=24).engine
    prompts = [[5, 6, 7, 8] * 4, [100, 200], [9] * 11]
    p = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want, _ = _run(eng, prompts, p)
    eng.kv.reset_prefix_cache()
    prof = StepProfile()
    eng.set_profile(prof)
    got, steps = _run(eng, prompts, p)
    eng.set_profile(None)
    assert got == want
    assert len(prof.steps) == steps
    for s in prof.steps:
        assert all(s[k] >= 0 for k in PARTS), s
        assert s["tokens"] <= 24 and s["seqs"] >= 1
    # every prompt token and every decode token was scheduled once (no prefix hits here)
    assert sum(s["tokens"] for s in prof.steps) == sum(map(len, prompts)) + 3 * (6 - 1)
    assert sum(s["sampled"] for s in prof.steps) == 3 * 6
    summ = prof.summary()
    assert summ["steps"] == steps and summ["tokens"] == sum(s["tokens"] for s in prof.steps)
    assert abs(summ["host_s"] + summ["runner_s"] - summ["wall_s"]) < 1e-9
    assert eng.runner.profile is None
    _, more = _run(eng, prompts[:1], p)  # off again: nothing recorded
    assert len(prof.steps) == steps


def test_summary_of_a_slice():
    prof = StepProfile()
    for i in range(3):
        prof.begin()
        for part in PARTS:
            prof.mark(part)
        prof.end(tokens=10 * (i + 1))
    s = prof.summary(prof.steps[1:])
    assert s["steps"] == 2 and s["tokens"] == 50
    assert set(s["median_ms"]) == set(PARTS)
    assert StepProfile().summary() == {}
