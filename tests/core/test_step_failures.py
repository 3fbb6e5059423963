"""A failure inside ``step()`` aborts the requests it concerns, frees their blocks, and the engine serves on.

Validation stops bad parameters at construction and at ``add_request``; these tests break requests
*after* that (a field changed while the request runs) and break the forward itself, to check that what
is left is contained: the failing request ends with ``finish_reason="abort"`` and an ``error``, every
other request gives exactly the tokens it gives alone, and no block leaks.
"""

import pytest

from qkv import LLM, SamplingParams

GOOD = ["The quick brown fox", "Paged attention stores keys", "An eight bit cache holds"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    # batch_invariant: a sequence's tokens do not depend on what else is in the batch, so "alone" and
    # "among failing requests" can be compared exactly.
    return LLM(str(tiny_dir("llama")), dtype="float32", num_blocks=64, batch_invariant=True)


def drain(engine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_failing_requests_are_aborted_and_the_others_unaffected(llm):
    engine = llm.llm_engine
    alone = {p: llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in GOOD}
    ids = {engine.add_request(p, GREEDY): p for p in GOOD[:2]}
    bad_sampler = SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True)
    rid_sampler = engine.add_request("The lazy dog", bad_sampler)
    bad_sampler.top_k = 1.5  # breaks torch.topk for this row of the batch only
    bad_stop = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    rid_stop = engine.add_request("Calibration observes", bad_stop)
    bad_stop.stop = [1]  # breaks the stop-string search of this request only
    first = {o.request_id: o for o in engine.step() if o.finished}  # the broken ones fail at their 1st token
    assert sorted(first) == [rid_sampler, rid_stop]
    ids[engine.add_request(GOOD[2], GREEDY)] = GOOD[2]  # joins after them
    done = {**first, **drain(engine)}
    assert sorted(done) == sorted([*ids, rid_sampler, rid_stop])
    failed = done[rid_sampler].outputs[0]
    assert (failed.finish_reason, failed.token_ids) == ("abort", [])
    assert failed.error.startswith("sampling failed: TypeError: topk(): argument 'k'")
    failed = done[rid_stop].outputs[0]
    assert failed.finish_reason == "abort" and len(failed.token_ids) == 1
    assert failed.error == "TypeError: object of type 'int' has no len()"
    for rid, prompt in ids.items():
        assert done[rid].outputs[0].token_ids == alone[prompt]
        assert done[rid].outputs[0].finish_reason == "length" and done[rid].outputs[0].error is None
    engine.pool.check_no_leaks()
    assert not engine.requests


def test_a_failed_forward_aborts_its_step_only(llm, monkeypatch):
    engine = llm.llm_engine
    expected = llm.generate(GOOD, GREEDY)
    calls = {"n": 0}
    real = engine.runner.execute

    def flaky(sched, block_size):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real(sched, block_size)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    ids = [engine.add_request(p, GREEDY) for p in GOOD]
    engine.step()
    outs = engine.step()  # the forward fails: every request of the step is aborted, with the reason
    assert [o.request_id for o in outs] == ids
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert {o.outputs[0].error for o in outs} == {"the forward pass failed: RuntimeError: device lost"}
    assert not engine.has_unfinished_requests()
    engine.pool.check_no_leaks()
    again = llm.generate(GOOD, GREEDY)  # and the engine serves on
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_generate_interrupted_leaves_the_engine_clean(llm, monkeypatch):
    engine = llm.llm_engine
    real_step, calls = engine.step, {"n": 0}

    def interrupted():
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(GOOD, GREEDY)
    assert not engine.has_unfinished_requests() and not engine.requests
    engine.pool.check_no_leaks()
    monkeypatch.undo()
    assert len(llm.generate(GOOD, GREEDY)) == 3


def test_vanishing_temperature_is_greedy(llm):
    greedy = llm.generate(GOOD, GREEDY)
    tiny = llm.generate(GOOD, SamplingParams(temperature=5e-324, seed=3, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in tiny] == [o.outputs[0].token_ids for o in greedy]
