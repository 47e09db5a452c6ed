"""Test doubles for the agent loop: an engine that plays scripted turns, and tools with known answers."""
from __future__ import annotations

import asyncio
from typing import Sequence

from rlmegatron.agent.parsers import ToolCall, ToolCallParser
from rlmegatron.rollout.engine import GenerationRequest, GenerationResult, RolloutEngine


class ScriptedEngine(RolloutEngine):
    """Answers the k-th request of each prompt with `turns[k]` (token ids; log-probs -0.01 * (position + 1) across
    the whole response, so every model token has its own). Records every request."""

    def __init__(self, turns: Sequence[Sequence[int]], eos: int) -> None:
        self.turns, self.eos = [list(t) for t in turns], eos
        self.requests: list[GenerationRequest] = []
        self.batches: list[int] = []
        self.served: dict[int, int] = {}

    def generate(self, requests, progress=None):
        self.batches.append(len(requests))
        results = []
        for index, request in enumerate(requests):
            self.requests.append(request)
            prompt = request.prompt_token_ids
            key = prompt[0]
            turn = self.served.get(key, 0)
            self.served[key] = turn + 1
            tokens = self.turns[turn][: request.sampling.max_new_tokens]
            start = sum(len(t) for t in self.turns[:turn])
            results.append(GenerationResult(
                index, 0, tuple(tokens), tuple(-0.01 * (start + i + 1) for i in range(len(tokens))),
                "stop" if tokens[-1] == self.eos or tokens[-1] in request.sampling.stop_token_ids else "length"))
        return results

    def update_weights(self, named_tensors, version):
        raise NotImplementedError

    def release_memory(self, tags=()):
        raise NotImplementedError

    def resume_memory(self, tags=()):
        raise NotImplementedError

    def health(self):
        return True

    def shutdown(self):
        pass


class Lookup:
    """A table per prompt (its extra_info["table"]); counts its calls per trajectory in create/release."""

    schema = {"type": "function", "function": {
        "name": "lookup", "description": "The value stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}
    released: list[str] = []

    def __init__(self, reward: float = 0.0) -> None:
        self.reward = reward

    async def create(self, context):
        context.state["lookups"] = 0

    async def execute(self, args, context):
        context.state["lookups"] += 1
        return str(context.extra_info["table"][args["key"]]), self.reward, {"lookup/calls": 1}

    async def release(self, context):
        Lookup.released.append(f"{context.trajectory_id}:{context.state['lookups']}")


class Add:
    schema = {"type": "function", "function": {
        "name": "add", "description": "x + y",
        "parameters": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}}}

    def __init__(self, reward: float = 0.0) -> None:
        self.reward = reward

    async def execute(self, args, context):
        return str(args["x"] + args["y"]), self.reward, {}


class Echo:
    """Answers every call with the same short text."""

    schema = {"type": "function", "function": {"name": "echo", "parameters": {}}}

    async def execute(self, args, context):
        return "ok", 0.0, {}


class EveryTurn(ToolCallParser):
    """A call to `echo` in every turn the model ends itself: makes a random model hold a conversation."""

    def parse(self, text):
        return [ToolCall("echo", {"said": text})]


class Fragile:
    """Fails where its prompt's extra_info says ({"create" or "release": "raise" or "hang"}); answers each call with
    what `create` set up, and records whose state it released."""

    schema = {"type": "function", "function": {"name": "fragile", "parameters": {}}}

    def __init__(self) -> None:
        self.released: list[str] = []

    async def create(self, context):
        await self._fail(context, "create")
        context.state["fragile"] = f"ready {context.trajectory_id}"

    async def execute(self, args, context):
        return context.state["fragile"], 0.0, {}

    async def release(self, context):
        self.released.append(context.trajectory_id)
        await self._fail(context, "release")

    @staticmethod
    async def _fail(context, stage):
        mode = context.extra_info.get(stage)
        if mode == "raise":
            raise RuntimeError(f"{stage} broke")
        if mode == "hang":
            await asyncio.sleep(60)
