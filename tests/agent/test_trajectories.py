"""Trajectories are built from token ids turn by turn: the model's tokens as sampled, the tool answers rendered with
the chat template and tokenized once; the response mask and the log-probs cover exactly the model's tokens."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from rlmegatron.rollout.agent_loop import AgentLoop, AgentSettings, ToolTurns
from rlmegatron.driver.rollout_data import agent_metrics, batch_metrics, build_batch, reward_inputs, scored, token_level
from rlmegatron.data import Sample
from rlmegatron.rewards import RewardResult
from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
from tests.agent.chat_tokenizers import bpe_chat_tokenizer, byte_tokens
from tests.agent.scripted import ScriptedEngine

HERE = Path(__file__).parent
TOOLS = ((f"{HERE / 'scripted.py'}:Lookup", {"reward": 0.25}), (f"{HERE / 'scripted.py'}:Add", {}))


def settings(**changes) -> AgentSettings:
    return AgentSettings(**{"max_turns": 5, "max_tool_response_length": 64, "tool_call_format": "hermes",
                            "tools": TOOLS, "tool_timeout_s": 5.0, "tokenizer_path": "unused", **changes})


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def test_a_conversation_with_several_tool_calls_is_the_sampled_tokens_and_the_rendered_answers():
    tokenizer = bpe_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The policy's own tokenization (byte by byte), not the tokenizer's: the trained tokens must be these.
    turns = [byte_tokens(tokenizer, call("lookup", '{"key": "a"}') + call("lookup", '{"key": "b"}')) + [eos],
             byte_tokens(tokenizer, "Sum:" + call("add", '{"x": 3, "y": 4}')) + [eos],
             byte_tokens(tokenizer, "The answer is 7.") + [eos]]
    engine = ScriptedEngine(turns, eos)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "a+b?"}], tokenize=False,
                                                            add_generation_prompt=True), add_special_tokens=False)
    request = GenerationRequest(tuple(prompt), SamplingSpec(max_new_tokens=400, seed=3), {"table": {"a": 3, "b": 4}})
    loop = AgentLoop(settings(), tokenizer)
    (result,) = loop.generate(engine, [request])

    # The answers, rendered by the template after the model's own <|im_end|>, then the next assistant turn.
    answers = ["\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n",
               "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"]
    rendered = [tokenizer.encode(text, add_special_tokens=False) for text in answers]
    expected = turns[0] + rendered[0] + turns[1] + rendered[1] + turns[2]
    assert list(result.output_token_ids) == expected
    assert list(result.response_mask) == ([1] * len(turns[0]) + [0] * len(rendered[0]) + [1] * len(turns[1])
                                          + [0] * len(rendered[1]) + [1] * len(turns[2]))
    model_logprobs = [-0.01 * (i + 1) for i in range(sum(map(len, turns)))]
    assert [lp for lp, m in zip(result.output_token_logprobs, result.response_mask) if m] == model_logprobs
    assert all(lp == 0 for lp, m in zip(result.output_token_logprobs, result.response_mask) if not m)
    # Each turn's request was the prompt and every token so far, exactly; its budget what was left of 400.
    so_far = [0, len(turns[0]) + len(rendered[0]), len(expected) - len(turns[2])]
    assert [list(r.prompt_token_ids) for r in engine.requests] == [prompt + expected[:n] for n in so_far]
    assert [r.sampling.max_new_tokens for r in engine.requests] == [400 - n for n in so_far]
    # Re-tokenizing the decoded conversation gives other tokens: training on it would not train these.
    text = tokenizer.decode(result.output_token_ids)
    assert tokenizer.encode(text, add_special_tokens=False) != expected
    assert result.finish_reason == "stop"
    record = result.agent
    assert (record.turns, record.tool_calls, record.tool_errors, record.tool_reward) == (3, 3, 0, 0.5)
    assert dict(record.tool_metrics) == {"lookup/calls": 2.0}
    assert type(loop.tools["lookup"]).released == ["0/0:2"]  # created and released once for the trajectory

    # The batch trains exactly the model's tokens; the reward reads the final answer and lands on its last token.
    sample = Sample(0, [], prompt, "lookup", "7")
    batch = build_batch([prompt], [result], 420)
    width = len(prompt)
    assert batch.input_ids[0, width:width + len(expected)].tolist() == expected
    assert batch.response_mask[0, : len(expected)].tolist() == list(result.response_mask)
    assert batch.response_mask[0, len(expected):].sum() == 0
    assert batch.rollout_log_probs[0, : len(expected)].tolist() == list(
        torch.tensor(result.output_token_logprobs).tolist())
    (reward_input,) = reward_inputs([sample], [result], tokenizer)
    assert reward_input.solution_str == "The answer is 7."
    rollout = scored([sample], [0], [result], batch, RewardResult(scores=[1.0], rewards=[1.0], metrics={}, extra=[{}]))
    assert rollout.rewards.tolist() == [1.5]  # plus the two lookups' reward deltas
    tokens = token_level(rollout.rewards, batch.response_mask)
    assert tokens[0].nonzero().flatten().tolist() == [len(expected) - 1]
    metrics = batch_metrics(rollout, 420)
    assert metrics["response_length/mean"] == len(expected) and metrics["prompt_length/mean"] == len(prompt)
    assert (metrics["agent/turns/mean"], metrics["agent/tool_calls/mean"], metrics["agent/tool_errors/sum"]) == (3, 3, 0)
    assert metrics["agent/tokens_per_turn/mean"] == sum(map(len, turns)) / 3
    assert (metrics["agent/tool_reward/mean"], metrics["agent/lookup/calls/mean"]) == (0.5, 2.0)


def test_the_token_budget_ends_a_trajectory_inside_a_tool_answer_whose_last_model_token_takes_the_reward():
    tokenizer = bpe_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = byte_tokens(tokenizer, call("lookup", '{"key": "a"}')) + [eos]
    engine = ScriptedEngine([first, [eos]], eos)
    request = GenerationRequest((1, 5), SamplingSpec(max_new_tokens=len(first) + 3), {"table": {"a": "x" * 50}})
    (result,) = AgentLoop(settings(), tokenizer).generate(engine, [request])
    assert len(result.output_token_ids) == len(first) + 3 and result.finish_reason == "length"
    assert list(result.response_mask) == [1] * len(first) + [0] * 3
    assert token_level(torch.ones(1), torch.tensor([result.response_mask], dtype=torch.float32))[0].nonzero().item() == len(first) - 1


def test_max_turns_ends_a_trajectory_that_keeps_calling_and_a_long_answer_is_cut():
    tokenizer = bpe_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    again = byte_tokens(tokenizer, call("lookup", '{"key": "a"}')) + [eos]
    request = GenerationRequest((1, 5), SamplingSpec(max_new_tokens=2000), {"table": {"a": "value " * 40}})
    for max_turns, limit in ((2, 8), (3, 64)):
        (result,) = AgentLoop(settings(max_turns=max_turns, max_tool_response_length=limit), tokenizer).generate(
            ScriptedEngine([again] * 5, eos), [request])
        assert (result.agent.turns, result.agent.tool_calls) == (max_turns, max_turns - 1)
        answer = tokenizer.decode([t for t, m in zip(result.output_token_ids, result.response_mask) if not m])
        if limit == 8:
            assert "...(truncated)" in answer and answer.count("value") < 8
        else:
            assert "...(truncated)" not in answer and answer.count("value") == 40 * (max_turns - 1)


def test_a_malformed_or_unknown_call_and_a_tool_error_are_answers_the_model_reads():
    tokenizer = bpe_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = [byte_tokens(tokenizer, '<tool_call>{"name": oops</tool_call>' + call("search", "{}")
                         + call("lookup", '{"key": "zz"}')) + [eos], byte_tokens(tokenizer, "done") + [eos]]
    request = GenerationRequest((1, 5), SamplingSpec(max_new_tokens=2000), {"table": {"a": 1}})
    (result,) = AgentLoop(settings(), tokenizer).generate(ScriptedEngine(turns, eos), [request])
    answers = tokenizer.decode([t for t, m in zip(result.output_token_ids, result.response_mask) if not m])
    assert "Error: the tool call is not valid JSON" in answers
    assert "Error: there is no tool 'search'; the tools are lookup, add" in answers
    assert "Error: KeyError: 'zz'" in answers
    assert (result.agent.tool_calls, result.agent.tool_errors, result.agent.turns) == (3, 3, 2)


def test_tool_answers_follow_the_turn_where_the_template_renders_the_last_assistant_message_its_own_way():
    tokenizer = bpe_chat_tokenizer()
    # As Qwen3's template: the last assistant message gets an empty think block, an earlier one does not.
    qwen3_like = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                  "{% if message['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
                  "{% if message['role'] == 'tool' %}<tool_response>\n{{ message['content'] }}\n</tool_response>"
                  "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    turns = ToolTurns(tokenizer)
    tokenizer.chat_template, original = qwen3_like, tokenizer.chat_template
    try:
        text = turns.text([("lookup", "3")], model_ended_with="<|im_end|>")
    finally:
        tokenizer.chat_template = original
    assert text == "\n<|im_start|>tool\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_tool_whose_create_or_release_fails_answers_with_the_error_and_the_step_goes_on():
    tokenizer = bpe_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = [byte_tokens(tokenizer, call("fragile", "{}") + call("add", '{"x": 1, "y": 2}')) + [eos],
             byte_tokens(tokenizer, "done") + [eos]]
    failures = [{"create": "raise"}, {"create": "hang"}, {"release": "raise"}, {"release": "hang"}, {}]
    # ScriptedEngine tells the trajectories apart by their prompts' first token.
    requests = [GenerationRequest((10 + i, 5), SamplingSpec(max_new_tokens=2000), failure)
                for i, failure in enumerate(failures)]
    loop = AgentLoop(settings(tools=((f"{HERE / 'scripted.py'}:Fragile", {}), (f"{HERE / 'scripted.py'}:Add", {})),
                              tool_timeout_s=0.3), tokenizer)
    start = time.perf_counter()
    results = loop.generate(ScriptedEngine(turns, eos), requests)
    assert time.perf_counter() - start < 10  # the hanging create and release were cut at the timeout

    answers = [tokenizer.decode([t for t, m in zip(r.output_token_ids, r.response_mask) if not m]) for r in results]
    assert "Error: the tool fragile could not start: RuntimeError: create broke" in answers[0]
    assert "Error: the tool fragile did not start within 0.3 s" in answers[1]
    for index in (2, 3, 4):
        assert f"ready {index}/0" in answers[index]
    assert all("\n3<|im_end|>" in answer for answer in answers)  # the other tool served every trajectory
    assert [r.finish_reason for r in results] == ["stop"] * 5 and all(r.agent.turns == 2 for r in results)
    assert [r.agent.tool_errors for r in results] == [1, 1, 0, 0, 0]
    assert [r.agent.tool_timeouts for r in results] == [0, 1, 0, 0, 0]
    assert [r.agent.tool_setup_errors for r in results] == [1, 1, 1, 1, 0]
    # Released once for every trajectory it was created for, and only those.
    assert sorted(loop.tools["fragile"].released) == ["2/0", "3/0", "4/0"]
    assert agent_metrics(results)["agent/tool_setup_errors/sum"] == 4


def test_a_failing_release_still_runs_when_the_engine_fails_mid_trajectory():
    tokenizer = bpe_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    loop = AgentLoop(settings(tools=((f"{HERE / 'scripted.py'}:Fragile", {}),)), tokenizer)
    requests = [GenerationRequest((10 + i, 5), SamplingSpec(max_new_tokens=2000), {"release": "raise"})
                for i in range(2)]
    with pytest.raises(IndexError):  # the script runs out of turns: the engine's error is the step's
        loop.generate(ScriptedEngine([], eos), requests)
    assert sorted(loop.tools["fragile"].released) == ["0/0", "1/0"]


def test_a_trajectory_sums_its_model_turns_speculative_counts():
    """With rollout.speculative each model turn comes with its verifications and drafts; the trajectory carries their
    sums, which the step's rollout/spec_* metrics read."""
    import dataclasses

    from rlmegatron.driver.rollout_data import speculative_metrics

    class Drafting(ScriptedEngine):
        """Each turn as a drafting engine reports it: 2 verifications, 3 of 4 drafts kept."""

        def generate(self, requests, progress=None):
            return [dataclasses.replace(r, spec_verify_ct=2, spec_num_correct_drafts=3, spec_num_proposed_drafts=4)
                    for r in super().generate(requests, progress)]

    tokenizer = bpe_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = [byte_tokens(tokenizer, call("lookup", '{"key": "a"}')) + [eos], byte_tokens(tokenizer, "It is 3.") + [eos]]
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "a?"}], tokenize=False,
                                                            add_generation_prompt=True), add_special_tokens=False)
    request = GenerationRequest(tuple(prompt), SamplingSpec(max_new_tokens=400), {"table": {"a": 3}})
    (result,) = AgentLoop(settings(), tokenizer).generate(Drafting(turns, eos), [request])
    assert result.agent.turns == 2
    assert (result.spec_verify_ct, result.spec_num_correct_drafts, result.spec_num_proposed_drafts) == (4, 6, 8)
    assert speculative_metrics([result]) == {"rollout/spec_accept_rate": 0.75, "rollout/spec_accepted_tokens_mean": 1.5}
