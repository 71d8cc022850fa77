import pytest

from kiln.errors import KilnError
from kiln.llm.kv_cache import CacheCapacityError, KVCacheManager
from kiln.llm.request import Request, Status
from kiln.llm.sampling import SamplingParams
from kiln.llm.scheduler import Scheduler, SchedulerConfig

VOCAB = 1000


def next_token(tokens) -> int:
    return hash(tuple(tokens)) % VOCAB


class FakeRunner:
    """Writes each new token into its KV slot (via the block table) and 'attends' by reading the
    slots of positions 0..p back: a wrong table, a lost block or a bad prefix hit changes the
    tokens read, so the output differs from ``reference``."""

    def __init__(self, num_blocks, block_size):
        self.slots = [None] * (num_blocks * block_size)
        self.bs = block_size

    def execute(self, out):
        sampled = {}
        for s in out.scheduled:
            table, req = s.block_table, s.request
            for p in range(s.start, s.start + s.num_new_tokens):
                self.slots[table[p // self.bs] * self.bs + p % self.bs] = req.token_at(p)
            if s.samples:
                end = s.start + s.num_new_tokens
                seen = [self.slots[table[p // self.bs] * self.bs + p % self.bs]
                        for p in range(end)]
                sampled[req.request_id] = next_token(seen)
        return sampled


def reference(prompt, n):
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


def run(reqs, num_blocks=64, block_size=4, budget=32, max_seqs=8, prefix=True, steps=10_000):
    kv = KVCacheManager(num_blocks, block_size, prefix)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                      max_model_len=512), kv)
    runner = FakeRunner(num_blocks, block_size)
    for r in reqs:
        sched.add_request(r)
    log = []
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        log.append(out)
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= max_seqs
        sched.update_from_output(out, runner.execute(out), now=0.0)
    assert not sched.has_unfinished()
    assert kv.num_free_blocks == num_blocks  # every block came back
    return log, kv


def make(rid, prompt, n):
    return Request(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True))


def test_every_request_gets_the_reference_tokens():
    reqs = [make(f"r{i}", range(i, i + 5 + 3 * i), 6 + i) for i in range(6)]
    run(reqs)
    for i, r in enumerate(reqs):
        assert r.output_token_ids == reference(r.prompt_token_ids, 6 + i)
        assert r.status == Status.FINISHED_LENGTH


def test_long_prompt_is_chunked_and_decodes_run_beside_it():
    short = make("short", range(3), 20)
    long = make("long", range(100, 180), 2)
    log, _ = run([short, long], budget=16)
    mixed = [o for o in log if {s.request.request_id for s in o.scheduled} == {"short", "long"}]
    assert len(mixed) >= 4  # the 80-token prompt took several steps next to the decodes
    assert all(o.num_batched_tokens <= 16 for o in log)
    assert long.output_token_ids == reference(long.prompt_token_ids, 2)
    assert short.output_token_ids == reference(short.prompt_token_ids, 20)


def test_preemption_by_recompute_keeps_outputs_exact():
    reqs = [make(f"r{i}", range(10 * i, 10 * i + 8), 16) for i in range(4)]
    log, _ = run(reqs, num_blocks=14, block_size=4, prefix=False)
    assert any(o.preempted for o in log)
    assert sum(r.num_preemptions for r in reqs) >= 1
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, 16)


def test_prefix_cache_skips_shared_blocks():
    shared = list(range(40))
    kv = KVCacheManager(64, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=512), kv)
    runner = FakeRunner(64, 4)
    first = make("first", shared + [7], 2)
    second = make("second", shared + [9, 9], 2)
    sched.add_request(first)
    while sched.has_unfinished():
        o = sched.schedule()
        sched.update_from_output(o, runner.execute(o), 0.0)
    sched.add_request(second)
    o = sched.schedule()
    assert o.scheduled[0].start == 40 and o.scheduled[0].num_new_tokens == 2
    sched.update_from_output(o, runner.execute(o), 0.0)
    while sched.has_unfinished():
        o = sched.schedule()
        sched.update_from_output(o, runner.execute(o), 0.0)
    assert second.num_cached_tokens == 40
    assert second.output_token_ids == reference(second.prompt_token_ids, 2)


def test_max_num_seqs_and_waiting_order():
    reqs = [make(f"r{i}", range(4), 3) for i in range(5)]
    log, _ = run(reqs, max_seqs=2)
    first = [s.request.request_id for s in log[0].scheduled]
    assert first == ["r0", "r1"]
    assert all(len(o.scheduled) <= 2 for o in log)


def test_stop_conditions():
    kv = KVCacheManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=64), kv)
    sched.eos_token_ids = (next_token([1, 2, 3]),)
    eos = make("eos", [1, 2, 3], 10)
    eos.params.ignore_eos = False
    stop_tok = Request("tok", [4, 5], SamplingParams(max_tokens=10,
                                                     stop_token_ids=[next_token([4, 5])]))
    runner = FakeRunner(32, 4)
    for r in (eos, stop_tok):
        sched.add_request(r)
    while sched.has_unfinished():
        o = sched.schedule()
        sched.update_from_output(o, runner.execute(o), 0.0)
    assert eos.status == Status.FINISHED_STOPPED and len(eos.output_token_ids) == 1
    assert stop_tok.status == Status.FINISHED_STOPPED and stop_tok.stop_reason == \
        stop_tok.output_token_ids[-1]


def test_bad_requests_are_refused():
    kv = KVCacheManager(4, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=64), kv)
    with pytest.raises(KilnError, match="prompt is empty"):
        sched.add_request(make("e", [], 1))
    with pytest.raises(KilnError, match="does not fit the model length 64"):
        sched.add_request(make("long", range(64), 1))
    with pytest.raises(CacheCapacityError, match="pool has 4"):
        sched.add_request(make("big", range(10), 20))
    sched.add_request(make("ok", range(3), 2))
    with pytest.raises(KilnError, match="already in flight"):
        sched.add_request(make("ok", range(3), 2))


def test_abort_frees_blocks():
    kv = KVCacheManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=64), kv)
    r = make("a", range(9), 5)
    sched.add_request(r)
    sched.schedule()
    assert kv.num_free_blocks < 16
    sched.abort("a")
    assert kv.num_free_blocks == 16 and r.status == Status.FINISHED_ABORTED
    assert not sched.has_unfinished()
