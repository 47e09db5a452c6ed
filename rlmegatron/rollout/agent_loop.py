"""The agent loop: each sample is a trajectory of model turns and tool answers, built from token ids turn by turn.

A model turn is the engine's tokens as sampled (with their log-probs); if it calls tools, their answers are rendered
with the chat template (the end of the assistant turn the model did not write itself, the tool messages, the next
assistant turn's opening) and that text is tokenized once and appended. Nothing is ever re-tokenized, so the trained
tokens are exactly the ones the policy produced, whatever the tokenizer would make of the decoded text. The response
mask is 1 on the model's tokens and 0 on the rendered ones, and the log-probs are the engine's on the model's tokens.

A trajectory ends on a turn without tool calls (its final answer), after `max_turns` model turns, or when the token
budget (`rollout.max_new_tokens`, the whole response) is spent. Two drivers run the same trajectories: engines that
serve concurrent single samples (SGLang: `generate_one`) run every trajectory on its own, turn after turn, many in
flight at once; the others (the local engine) generate one batch per turn over every trajectory still running.
"""
from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

import torch

from rlmegatron.agent.parsers import ToolCall, tool_call_parser
from rlmegatron.agent.tools import ToolContext, ToolOutcome, build_tools, call_tool, tool_lifecycle
from rlmegatron.rollout.engine import AgentRecord, GenerationRequest, GenerationResult, RolloutEngine, SamplingSpec
from rlmegatron.tracking.progress import Progress, report


@dataclass(frozen=True)
class AgentSettings:
    """`rollout.multi_turn`, as the engines' side reads it."""

    max_turns: int
    max_tool_response_length: int
    """Tokens of one tool's answer; a longer one is cut, and says so."""
    tool_call_format: str
    tools: tuple[tuple[str, Mapping[str, Any]], ...]
    """(built-in name or path/to/tools.py:ClassName, keyword arguments of the class)."""
    tool_timeout_s: float
    tokenizer_path: str
    trust_remote_code: bool = False


@runtime_checkable
class ConcurrentEngine(Protocol):
    """An engine that serves single samples from many threads at once (SGLang's HTTP client)."""

    max_concurrency: int

    def generate_one(self, request_index: int, sample_index: int, request: GenerationRequest) -> GenerationResult: ...


class ToolTurns:
    """Renders tool answers with the tokenizer's chat template, as the text that follows a model turn."""

    _MARK = "\x00rlm-content\x00"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self._MARK}]

    def text(self, answers: Sequence[tuple[str, str]], model_ended_with: str) -> str:
        """The text after a model turn that ended with `model_ended_with` (its last token's text): what the template
        writes after the assistant's content (ChatML: the rest of "<|im_end|>\n"), the tool messages (name,
        content) and the opening of the model's next turn. Only what follows the content is taken, so a template
        that renders the assistant's own header differently once it is not the last message (Qwen3 drops an empty
        think block) still appends consistently."""
        messages = self._base + [{"role": "tool", "name": name, "content": content} for name, content in answers]
        full = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if full.count(self._MARK) != 1:
            raise ValueError("the chat template does not render an assistant message's content as it is, so tool "
                             "answers cannot be appended after the model's turn; use a template that does")
        after = full[full.index(self._MARK) + len(self._MARK):]
        return after[len(model_ended_with):] if model_ended_with and after.startswith(model_ended_with) else after

    def tokens(self, answers: Sequence[tuple[str, str]], model_ended_with: str) -> list[int]:
        return self.tokenizer.encode(self.text(answers, model_ended_with), add_special_tokens=False)


class Trajectory:
    """One sample's response, turn by turn: `tokens`, with `mask` 1 where the model wrote them and `logprobs`
    (0 on the rendered tokens)."""

    def __init__(self, loop: AgentLoop, request_index: int, sample_index: int, request: GenerationRequest) -> None:
        self.loop, self.request_index, self.sample_index = loop, request_index, sample_index
        self.prompt, self.sampling = request.prompt_token_ids, request.sampling
        self.images = request.images  # the prompt's, sent with every turn (tools answer with text only)
        self.return_routed_experts = request.return_routed_experts
        self.routed: list[torch.Tensor] = []
        """Routing replay: each token's experts as the engine first ran it, in order: the prompt's and each model
        turn's from that turn's call, a turn's last token and the tool answer after it from the next turn's prefill
        (rollout_data.build_batch frees the tool answers' rows)."""
        self.routed_rows = 0
        self.context = ToolContext(f"{request_index}/{sample_index}", request.tool_context or {})
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.calls: list[ToolCall] = []
        self.finish: Optional[str] = None
        self.weight_version: Optional[str] = None
        self.turns = self.answer_start = 0
        self.tool_calls = self.tool_errors = self.tool_timeouts = self.tool_setup_errors = 0
        self.tool_reward = 0.0
        self.tool_metrics: dict[str, float] = {}
        self.speculative = (0, 0, 0)
        """Speculative decoding's counts over the model turns (GenerationResult's spec_ fields, in their order)."""
        self.created: list[Any] = []
        self.unavailable: dict[str, ToolOutcome] = {}
        """Tools whose `create` failed, by name: what each call to them answers."""

    async def create_tools(self) -> None:
        """Each tool's `create`, for this trajectory: one that fails leaves its tool unavailable here, the others
        serve as usual."""
        for name, tool in self.loop.tools.items():
            failed = await tool_lifecycle(tool, "create", self.context, self.loop.settings.tool_timeout_s)
            if failed is None:
                self.created.append(tool)
            else:
                self.unavailable[name] = failed
                self.tool_setup_errors += 1

    async def release_tools(self) -> None:
        """`release` of every tool this trajectory created, each whatever the others do."""
        for tool in self.created:
            failed = await tool_lifecycle(tool, "release", self.context, self.loop.settings.tool_timeout_s)
            self.tool_setup_errors += failed is not None

    @property
    def budget(self) -> int:
        return self.sampling.max_new_tokens - len(self.tokens)

    def next_request(self) -> GenerationRequest:
        seed = self.sampling.seed
        if seed is not None:
            # Per sample and turn, so a trajectory samples the same whichever engine or batch serves it.
            seed = ((seed * 1_000_003 + self.sample_index) * 1_009 + self.turns) % (2 ** 31)
        sampling = dataclasses.replace(self.sampling, n=1, max_new_tokens=self.budget, seed=seed)
        return GenerationRequest(self.prompt + tuple(self.tokens), sampling,
                                 return_routed_experts=self.return_routed_experts, images=self.images)

    def add_model_turn(self, result: GenerationResult) -> None:
        if self.return_routed_experts:
            self._add_routing(result)
        self.answer_start = len(self.tokens)
        self.tokens += result.output_token_ids
        self.mask += [1] * len(result.output_token_ids)
        self.logprobs += result.output_token_logprobs
        self.weight_version = result.weight_version
        self.turns += 1
        self.speculative = tuple(total + count for total, count in zip(self.speculative, (
            result.spec_verify_ct, result.spec_num_correct_drafts, result.spec_num_proposed_drafts)))
        text = self.loop.tokenizer.decode(result.output_token_ids, skip_special_tokens=False)
        self.calls = self.loop.parser.parse(text) if result.finish_reason == "stop" else []
        if result.finish_reason != "stop" or self.budget <= 0:
            self.finish = "length" if result.finish_reason != "abort" else "abort"
        elif not self.calls:
            self.finish = "stop"  # a final answer
        elif self.turns >= self.loop.settings.max_turns:
            self.finish, self.calls = "stop", []

    def _add_routing(self, result: GenerationResult) -> None:
        """The rows of this turn's record past those earlier turns gave: an earlier turn's are the same tokens run
        again (a prefill of the conversation so far), which the first run routed."""
        # This turn's prompt is the conversation so far.
        record = result.checked_routing(len(self.prompt) + len(self.tokens), f"turn {self.turns + 1} of request "
                                        f"{self.request_index} (sample {self.sample_index})")
        self.routed.append(record[self.routed_rows :])
        self.routed_rows = record.shape[0]

    def routed_experts(self) -> torch.Tensor | None:
        """[prompt + response - 1, MoE layers, k]: a tool answer the budget cut at the end, which no turn ran, routes
        freely (-1)."""
        if not self.routed:
            return None
        unrun = len(self.prompt) + len(self.tokens) - 1 - self.routed_rows
        free = torch.full((unrun, *self.routed[0].shape[1:]), -1, dtype=self.routed[0].dtype)
        return torch.cat([*self.routed, free])

    async def answer_calls(self) -> None:
        """Runs this turn's tool calls one after another (a stateful tool sees them in order) and appends their
        answers, tokenized once; a trajectory whose budget they overrun ends there."""
        answers = []
        for call in self.calls:
            outcome = self.unavailable.get(call.name) or await self.loop.run(call, self.context)
            self.tool_calls += 1
            self.tool_errors += outcome.error
            self.tool_timeouts += outcome.timed_out
            self.tool_reward += outcome.reward
            for name, value in outcome.metrics.items():
                self.tool_metrics[name] = self.tool_metrics.get(name, 0.0) + float(value)
            answers.append((call.name or "error", self.loop.clip(outcome.text)))
        self.calls = []
        ended_with = self.loop.tokenizer.decode(self.tokens[-1:], skip_special_tokens=False)
        rendered = self.loop.turns.tokens(answers, ended_with)
        if len(rendered) >= self.budget:
            # No room for another model token: what fits is kept (the mask says it is not the model's).
            rendered, self.finish = rendered[: self.budget], "length"
        self.tokens += rendered
        self.mask += [0] * len(rendered)
        self.logprobs += [0.0] * len(rendered)

    def result(self) -> GenerationResult:
        return GenerationResult(
            request_index=self.request_index,
            sample_index=self.sample_index,
            output_token_ids=tuple(self.tokens),
            output_token_logprobs=tuple(self.logprobs),
            finish_reason=self.finish or "length",
            weight_version=self.weight_version,
            response_mask=tuple(self.mask),
            routed_experts=self.routed_experts(),
            spec_verify_ct=self.speculative[0],
            spec_num_correct_drafts=self.speculative[1],
            spec_num_proposed_drafts=self.speculative[2],
            agent=AgentRecord(turns=self.turns, tool_calls=self.tool_calls, tool_errors=self.tool_errors,
                              tool_timeouts=self.tool_timeouts, tool_setup_errors=self.tool_setup_errors,
                              tool_reward=self.tool_reward,
                              answer_start=self.answer_start, tool_metrics=dict(self.tool_metrics)),
        )


class AgentLoop:
    """Runs multi-turn requests on an engine: `generate(engine, requests)` returns what `engine.generate` would,
    one result per sample, ordered by (request_index, sample_index), each a whole trajectory."""

    def __init__(self, settings: AgentSettings, tokenizer: Any = None) -> None:
        if tokenizer is None:
            from transformers import AutoTokenizer  # lazy: transformers only where an engine runs

            tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_path,
                                                      trust_remote_code=settings.trust_remote_code)
        self.settings, self.tokenizer = settings, tokenizer
        self.tools = build_tools(settings.tools)
        self.parser = tool_call_parser(settings.tool_call_format)
        self.turns = ToolTurns(tokenizer)

    def generate(self, engine: RolloutEngine, requests: Sequence[GenerationRequest],
                 progress: Progress = None) -> list[GenerationResult]:
        trajectories = [Trajectory(self, index, sample, request) for index, request in enumerate(requests)
                        for sample in range(request.sampling.n)]
        driver = self._concurrently if isinstance(engine, ConcurrentEngine) else self._batched
        asyncio.run(self._around_tools(driver(engine, trajectories, progress), trajectories))
        return [trajectory.result() for trajectory in trajectories]

    async def _around_tools(self, run, trajectories: list[Trajectory]) -> None:
        """Each tool's per-trajectory `create` before the first turn and, for each one created, `release` after the
        last, whatever happens; neither failing stops the step (`Trajectory.create_tools`)."""
        await asyncio.gather(*(t.create_tools() for t in trajectories))
        try:
            await run
        finally:
            await asyncio.gather(*(t.release_tools() for t in trajectories))

    async def _batched(self, engine: RolloutEngine, trajectories: list[Trajectory], progress: Progress) -> None:
        running = trajectories
        while running:
            results = sorted(engine.generate([t.next_request() for t in running]), key=lambda r: r.request_index)
            for trajectory, result in zip(running, results):
                trajectory.add_model_turn(result)
            await asyncio.gather(*(t.answer_calls() for t in running if t.calls))
            report(progress, sum(t.finish is not None for t in running))
            running = [t for t in running if t.finish is None]

    async def _concurrently(self, engine: ConcurrentEngine, trajectories: list[Trajectory],
                            progress: Progress) -> None:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=max(1, min(engine.max_concurrency, len(trajectories)))) as pool:

            async def run(trajectory: Trajectory) -> None:
                while trajectory.finish is None:
                    result = await loop.run_in_executor(pool, engine.generate_one, trajectory.request_index,
                                                        0, trajectory.next_request())
                    trajectory.add_model_turn(result)
                    if trajectory.calls:
                        await trajectory.answer_calls()
                report(progress)

            await asyncio.gather(*(run(t) for t in trajectories))

    async def run(self, call: ToolCall, context: ToolContext) -> ToolOutcome:
        if call.error is not None:
            return ToolOutcome(f"Error: {call.error}", error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutcome(f"Error: there is no tool {call.name!r}; the tools are {', '.join(self.tools)}",
                               error=True)
        return await call_tool(tool, call.arguments, context, self.settings.tool_timeout_s)

    def clip(self, text: str) -> str:
        limit = self.settings.max_tool_response_length
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= limit:
            return text
        return self.tokenizer.decode(ids[:limit], skip_special_tokens=False) + "...(truncated)"
