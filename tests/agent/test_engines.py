"""The agent loop on both engines: the local engine generates one batch per turn, SGLang serves every trajectory
turn by turn with many in flight (token ids in, token ids out); the engines' log-probs are the model's on exactly
the model's tokens, through the trainer's micro-batches, packed or not."""
from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlmegatron.agent.parsers import PARSERS
from rlmegatron.driver.rollout_data import build_batch
from rlmegatron.data.tokenizer import build_char_tokenizer
from rlmegatron.rollout.agent_loop import AgentLoop, AgentSettings
from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
from rlmegatron.rollout.local import LocalEngine
from rlmegatron.rollout.sglang.engine import SGLangEngine
from rlmegatron.rollout.sglang.server import ServerSpec
from rlmegatron.runtime.distributed import free_port
from rlmegatron.rank.roles import batch as micro_batches
from rlmegatron.rank.roles.batch import build_micro_batch, token_budget_micro_batches
from tests.agent.scripted import EveryTurn

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_SGLANG = REPO_ROOT / "tests" / "rollout" / "fake_sglang"
ECHO = (f"{Path(__file__).parent / 'scripted.py'}:Echo", {})


@pytest.fixture(scope="module", autouse=True)
def every_turn_calls():
    PARSERS["every_turn"] = EveryTurn
    yield
    del PARSERS["every_turn"]


def settings(max_turns: int) -> AgentSettings:
    return AgentSettings(max_turns=max_turns, max_tool_response_length=16, tool_call_format="every_turn",
                         tools=(ECHO,), tool_timeout_s=5.0, tokenizer_path="unused")


def requests(tokenizer, n: int, max_new_tokens: int) -> list[GenerationRequest]:
    # A third of the vocabulary ends a turn, so a random model's turns are short and the conversation goes on.
    stops = tuple(range(5, len(tokenizer), 3))
    return [GenerationRequest(tuple(tokenizer.encode(f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n")),
                              SamplingSpec(n=n, max_new_tokens=max_new_tokens, stop_token_ids=stops, seed=11 + i))
            for i in range(3)]


def per_position_log_probs(model, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens[p + 1] | tokens[: p + 1]) for each position p of one unpadded sequence."""
    with torch.no_grad():
        logits = model(input_ids=tokens.unsqueeze(0)).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, tokens[1:].unsqueeze(-1)).squeeze(-1)


def test_the_local_engine_runs_a_batch_per_turn_and_its_log_probs_are_the_models_on_the_model_tokens(monkeypatch):
    # Packing's THD parameters need Megatron's groups; only the token layout is under test here.
    monkeypatch.setattr(micro_batches, "_thd_params", lambda boundaries, max_seqlen: None)
    tokenizer = build_char_tokenizer()
    config = AutoConfig.from_pretrained(REPO_ROOT / "configs" / "quickstart" / "model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    engine = LocalEngine(model, pad_token_id=0, eos_token_ids=[tokenizer.eos_token_id])
    batches = []
    generate = engine.generate
    engine.generate = lambda reqs, progress=None: batches.append(len(reqs)) or generate(reqs, progress)
    prompts = requests(tokenizer, n=2, max_new_tokens=48)
    results = AgentLoop(settings(max_turns=4), tokenizer).generate(engine, prompts)

    turns = [r.agent.turns for r in results]
    # One batch per turn over the trajectories still running: all six first, then fewer as they end.
    assert batches == [sum(t > k for t in turns) for k in range(max(turns))] and batches[0] == 6
    assert max(turns) > 1 and any(0 in r.response_mask for r in results)
    engine.generate = generate
    again = AgentLoop(settings(max_turns=4), tokenizer).generate(engine, prompts)
    assert [r.output_token_ids for r in again] == [r.output_token_ids for r in results]  # seeded per sample, turn

    # The trainer's view: micro-batches cut by a token budget, padded or packed, give back on the response grid the
    # model's log-probs exactly where the mask is 1; the rollout log-probs there are the engine's, 0 elsewhere.
    batch = build_batch([list(prompts[r.request_index].prompt_token_ids) for r in results], results, 48)
    mask = batch.response_mask.bool()
    lengths = batch.sequence_lengths().tolist()
    for pack in (False, True):
        for rows in token_budget_micro_batches(list(range(len(results))), lengths, max_token_len=100):
            micro = build_micro_batch(batch, rows, pack)
            sequences = [batch.input_ids[row, batch.attention_mask[row].bool()] for row in rows]
            if pack:
                per_position = torch.cat([torch.cat([per_position_log_probs(model, s), torch.zeros(1)])
                                          for s in sequences]).unsqueeze(0)
            else:
                per_position = torch.zeros(micro.input_ids.shape)
                for n, tokens in enumerate(sequences):
                    per_position[n, : len(tokens) - 1] = per_position_log_probs(model, tokens)
            grid = micro.to_response_grid(per_position)
            torch.testing.assert_close(grid[mask[rows]], batch.rollout_log_probs[rows][mask[rows]],
                                       atol=2e-5, rtol=0)
    assert batch.rollout_log_probs[~mask].abs().sum() == 0


def test_sglang_serves_every_trajectory_turn_by_turn_token_ids_in_and_out_many_in_flight(tmp_path):
    tokenizer = build_char_tokenizer()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": len(tokenizer)}))
    spec = ServerSpec(model_path=str(model_dir), port=free_port(), python=sys.executable, load_format="dummy",
                      extra_args={"fake-record": str(tmp_path / "calls.jsonl"), "fake-marker": str(tmp_path / "died")},
                      env={"PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(REPO_ROOT)])})
    engine = SGLangEngine(spec, str(tmp_path), bucket_bytes=1024, startup_timeout_s=30, request_timeout_s=30,
                          max_concurrency=32)
    try:
        prompts = requests(tokenizer, n=8, max_new_tokens=40)
        results = AgentLoop(settings(max_turns=3), tokenizer).generate(engine, prompts)
    finally:
        engine.shutdown()
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    generates = [c for c in calls if c["path"] == "/generate"]
    assert len(results) == 24 and len(generates) == sum(r.agent.turns for r in results)
    # Trajectories run side by side (up to 32 at once), not one after another: a loaded machine starts fewer of the
    # client's threads together (CI once saw 7), a serial client never more than 1.
    assert max(c["in_flight"] for c in generates) >= 4
    served = defaultdict(list)  # the n samples of a prompt share their first turn's input
    for c in generates:
        served[tuple(c["input_ids"])].append(c["output_ids"])
    for result in results:
        prompt = prompts[result.request_index].prompt_token_ids
        tokens, mask = result.output_token_ids, result.response_mask
        # Each model turn is the server's answer to exactly the prompt and every token before it.
        starts = [k for k in range(len(mask)) if mask[k] and (k == 0 or not mask[k - 1])]
        assert len(starts) == result.agent.turns
        for start in starts:
            end = next((k for k in range(start, len(mask)) if not mask[k]), len(mask))
            assert list(tokens[start:end]) in served[prompt + tokens[:start]]


def test_multi_turn_trajectories_carry_each_tokens_routing_as_the_whole_conversation_routes_it():
    """Routing replay (actor.moe.routing_replay=r3) on multi-turn rollouts: each prompt and model token carries the
    experts the engine gave it when it first ran it (a turn's last token in the next turn's prefill), which in fp32
    are those a forward of the whole conversation chooses; tool answers and the last model token route freely (-1)."""
    tokenizer = build_char_tokenizer()
    config = AutoConfig.from_pretrained(REPO_ROOT / "configs" / "quickstart" / "moe_model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    engine = LocalEngine(model, pad_token_id=0, eos_token_ids=[tokenizer.eos_token_id])
    prompts = [dataclasses.replace(request, return_routed_experts=True)
               for request in requests(tokenizer, n=2, max_new_tokens=80)]
    results = AgentLoop(settings(max_turns=4), tokenizer).generate(engine, prompts)
    assert max(r.agent.turns for r in results) > 2 and any(r.finish_reason == "length" for r in results)

    batch = build_batch([list(prompts[r.request_index].prompt_token_ids) for r in results], results, 80)
    routed, layers = batch.routed_experts, config.num_hidden_layers
    for row, result in enumerate(results):
        cells = batch.attention_mask[row].bool()
        tokens = batch.input_ids[row, cells]
        chosen = []
        hooks = [router.register_forward_hook(lambda module, args, output: chosen.append(output[-1]))
                 for router in engine.routers]
        with torch.no_grad():
            model(input_ids=tokens.unsqueeze(0))
        for hook in hooks:
            hook.remove()
        whole = torch.stack(chosen, dim=1).sort(dim=-1).values  # [tokens, layers, k]
        record = routed[row, cells]
        prompt = len(prompts[result.request_index].prompt_token_ids)
        ran = torch.tensor([1] * prompt + list(result.response_mask)).bool()
        # The last model token is never fed back, whether the trajectory ends there or in a tool answer after it.
        ran[prompt + max(k for k, m in enumerate(result.response_mask) if m):] = False
        assert torch.equal(record[ran].sort(dim=-1).values.long(), whole[ran].long()), row
        assert (record[~ran] == -1).all() and record.shape[1] == layers
        assert (routed[row, ~cells] == -1).all()


def test_a_turn_answered_without_routing_names_its_request_sample_and_turn():
    tokenizer = build_char_tokenizer()
    config = AutoConfig.from_pretrained(REPO_ROOT / "configs" / "quickstart" / "moe_model")
    torch.manual_seed(0)
    engine = LocalEngine(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval(), pad_token_id=0)
    generate = engine.generate

    def forgets_on_the_second_turn(reqs, progress=None):
        results = generate(reqs, progress)
        second = len(reqs[0].prompt_token_ids) > len(prompts[0].prompt_token_ids)
        return [dataclasses.replace(r, routed_experts=None) for r in results] if second else results

    engine.generate = forgets_on_the_second_turn
    prompts = [dataclasses.replace(request, return_routed_experts=True)
               for request in requests(tokenizer, n=1, max_new_tokens=40)[:1]]
    with pytest.raises(ValueError, match=r"turn 2 of request 0 \(sample 0\) has routing for none, not the \d+ tokens"):
        AgentLoop(settings(max_turns=4), tokenizer).generate(engine, prompts)
