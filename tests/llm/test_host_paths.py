"""The engine's host fast paths give what the plain code gave: token slices, block tables kept
as ids beside the blocks, remembered one-token decodes."""

import random

from kiln.llm.kv_cache import KVCacheManager
from kiln.llm.request import Request
from kiln.llm.sampling import SamplingParams
from kiln.llm.scheduler import Scheduler, SchedulerConfig
from tests.llm.test_scheduler import FakeRunner, make, reference


def test_request_tokens_are_slices_of_prompt_plus_output():
    r = Request("r", [10, 11, 12, 13], SamplingParams())
    r.output_token_ids += [20, 21, 22]
    seq = r.prompt_token_ids + r.output_token_ids
    for a in range(len(seq) + 1):
        for b in range(a, len(seq) + 2):
            assert r.tokens(a, b) == seq[a:b], (a, b)
        if a < len(seq):
            assert r.token_at(a) == seq[a]


def _check_tables(kv: KVCacheManager):
    assert kv.table_ids.keys() <= kv.tables.keys()
    for rid, blocks in kv.tables.items():
        assert kv.block_table(rid) == [b.id for b in blocks], rid


def test_block_tables_match_the_blocks_through_prefix_hits_and_preemption():
    rng = random.Random(0)
    shared = list(range(24))
    reqs = [make(f"r{i}", (shared if i % 2 else []) + [rng.randrange(100) for _ in
                                                         range(3 + 2 * i)], 10 + i % 4)
            for i in range(10)]
    kv = KVCacheManager(30, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=20,
                                      max_model_len=256), kv)
    runner = FakeRunner(30, 4)
    for r in reqs:
        sched.add_request(r)
    preempted = 0
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += len(out.preempted)
        _check_tables(kv)
        for s in out.scheduled:  # the step's table is its own copy, as it was
            assert s.block_table == kv.block_table(s.request.request_id)
            assert s.block_table is not kv.table_ids.get(s.request.request_id)
        sched.update_from_output(out, runner.execute(out), now=0.0)
        _check_tables(kv)
    assert preempted and kv.hits  # both paths were taken
    assert not kv.tables and not kv.table_ids
    for r in reqs:
        assert r.output_token_ids == reference(r.prompt_token_ids, r.params.max_tokens)


def test_decode_one_is_decode_of_one_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = [0, 1, 2, 17, 28, 1000, 5000, 30000, 49151]
    for skip in (True, False):
        for i in ids + ids:  # the second time from the memo
            assert tok.decode_one(i, skip) == tok.decode([i], skip)
