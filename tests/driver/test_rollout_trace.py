"""Which rollout samples a step traces, and how they read: whole groups, in rollout order, decoded; a multi-turn one
turn by turn, as MLflow keeps it."""
import json
from pathlib import Path

import torch

from rlmegatron.driver.rollout_data import Rollout, build_batch, scored, traced_samples
from rlmegatron.data import Sample
from rlmegatron.rewards import RewardResult
from rlmegatron.rollout.agent_loop import AgentLoop, AgentSettings
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, SamplingSpec
from rlmegatron.tracking import Tracker, TrackingSetup, resolve_tracking_uri
from tests.agent.chat_tokenizers import bpe_chat_tokenizer, byte_tokens
from tests.agent.scripted import ScriptedEngine

SCRIPTED = Path(__file__).parents[1] / "agent" / "scripted.py"


class SpecialTokenTokenizer:
    """Ids below 3 are special tokens, shown as <s> unless skipped; id i >= 3 is the letter chr(94 + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if i < 3 and skip_special_tokens else "<s>" if i < 3 else chr(94 + i) for i in ids)


def rollout() -> Rollout:
    """Three prompts (groups 7, 5, 9 in rollout order), two responses each; scores 0.5 * row."""
    prompts = [Sample(index=i, prompt=[], prompt_ids=[1, 3 + i], data_source="s", ground_truth=i) for i in range(3)]
    uids, rows, results = [7, 7, 5, 5, 9, 9], [0, 0, 1, 1, 2, 2], []
    for row, prompt in enumerate(rows):
        results.append(GenerationResult(request_index=prompt, sample_index=row % 2,
                                        output_token_ids=(3 + row, 2), output_token_logprobs=(-0.1, -0.2),
                                        finish_reason="stop"))
    scores = 0.5 * torch.arange(6, dtype=torch.float32)
    return Rollout([prompts[p] for p in rows], uids, results, batch=None, scores=scores, rewards=scores - 1)


def test_the_first_groups_in_rollout_order_with_every_response_decoded():
    samples = traced_samples(rollout(), SpecialTokenTokenizer(), prompts=2)
    assert [(s["sample_id"], s["sample"]) for s in samples] == [("s#0", 0), ("s#0", 1), ("s#1", 0), ("s#1", 1)]
    assert [s["prompt"] for s in samples] == ["<s>a", "<s>a", "<s>b", "<s>b"]  # the template's tokens kept
    assert [s["response"] for s in samples] == ["a", "b", "c", "d"]  # EOS (a special token) skipped
    assert [s["score"] for s in samples] == [0.0, 0.5, 1.0, 1.5]
    assert [s["reward"] for s in samples] == [-1.0, -0.5, 0.0, 0.5]
    assert [s["ground_truth"] for s in samples] == ["0", "0", "1", "1"]
    assert {s["response_length"] for s in samples} == {2}


def test_no_limit_traces_every_group():
    samples = traced_samples(rollout(), SpecialTokenTokenizer(), prompts=None)
    assert [s["sample_id"] for s in samples] == ["s#0", "s#0", "s#1", "s#1", "s#2", "s#2"]


def test_a_multi_turn_trace_in_mlflow_reads_turn_by_turn_with_the_tool_call_its_answer_and_the_reward(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    tokenizer = bpe_chat_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    calling = '<tool_call>{"name": "add", "arguments": {"x": 1, "y": 2}}</tool_call>'
    turns = [byte_tokens(tokenizer, calling) + [eos], byte_tokens(tokenizer, "It is 3.") + [eos]]
    settings = AgentSettings(max_turns=4, max_tool_response_length=64, tool_call_format="hermes",
                             tools=((f"{SCRIPTED}:Add", {"reward": 0.25}),), tool_timeout_s=5.0, tokenizer_path="-")
    prompt = tokenizer.encode("<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    results = AgentLoop(settings, tokenizer).generate(ScriptedEngine(turns, eos),
                                                      [GenerationRequest(tuple(prompt), SamplingSpec(max_new_tokens=300))])
    sample = Sample(index=4, prompt=[], prompt_ids=prompt, data_source="sum", ground_truth=3)
    rollout = scored([sample], [0], results, build_batch([prompt], results, 300),
                     RewardResult(scores=[1.0], rewards=[0.5], metrics={}, extra=[{}]))

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the run directory's own store, under tmp_path
    tracker = Tracker(TrackingSetup(["mlflow"], tmp_path, "p", "e"))
    tracker.start(0)
    tracker.log_rollout_samples(traced_samples(rollout, tokenizer, prompts=1), step=3, backend="mlflow")
    tracker.finish()

    client = MlflowClient(tracking_uri=resolve_tracking_uri(tracker.setup))
    run_id = tracker.backends[0].backend.run_id
    text = Path(client.download_artifacts(run_id, "rollout_samples/step_000003.txt")).read_text()
    length = len(results[0].output_token_ids)
    assert text.splitlines() == [
        "══ step 3: rollout samples ══",
        "── prompt sum#4 (ground truth: 3) ──",
        "<|im_start|>user", "1+2?<|im_end|>", "<|im_start|>assistant", "",
        f"── response 0: score 1, reward 0.75, {length} tokens, 2 turns, 1 tool calls (0 failed) ──",
        "[turn 1: model]",
        calling + "<|im_end|>",
        "[turn 1: tool answers]",
        "", "<|im_start|>tool", "3<|im_end|>", "<|im_start|>assistant", "",  # the template around the answer
        "[turn 2: model]",
        "It is 3.<|im_end|>",
    ]
    table = json.loads(Path(client.download_artifacts(run_id, "rollout_samples/step_000003.json")).read_text())
    (row,) = [dict(zip(table["columns"], data)) for data in table["data"]]
    assert (row["step"], row["reward"], row["score"], row["turns"], row["tool_calls"]) == (3, 0.75, 1.0, 2, 1)
    assert calling in row["response"] and "tool\n3<|im_end|>" in row["response"]
