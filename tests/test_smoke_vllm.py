"""The test ground works: TP=2 serves what TP=1 serves.

Every family generating greedily (8 finite tokens) is checked by the bit-exact matrix, and the
`vllm` console script by every `VllmServer` test (it runs `.venv/bin/vllm serve`)."""

from __future__ import annotations

import pytest

from harness.tiny_models import PROMPTS
from harness.vllm_engine import start_llm

pytestmark = [pytest.mark.engine, pytest.mark.heavy]
MAX_TOKENS = 8


def greedy(llm) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
    results = []
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = out.outputs[0]
        chosen = [lp[tok].logprob for tok, lp in zip(completion.token_ids, completion.logprobs)]
        results.append((list(completion.token_ids), chosen))
    return results


def test_tp2_matches_tp1(tiny_model_factory):
    model = tiny_model_factory("llama")
    with start_llm(model, tp=1) as llm:
        tp1 = greedy(llm)
    with start_llm(model, tp=2) as llm:
        tp2 = greedy(llm)
    assert [t for t, _ in tp2] == [t for t, _ in tp1]
    for (_, lp1), (_, lp2) in zip(tp1, tp2):
        assert lp2 == pytest.approx(lp1, abs=0.1)
