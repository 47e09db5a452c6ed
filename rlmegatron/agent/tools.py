"""Tools a policy calls during a rollout: the plug-in protocol, loading and checking plug-ins, and calling one safely.

A tool is a class (`path/to/tools.py:ClassName`, or a built-in name such as `python`) built once per engine as
`Class(**config)`. It declares itself in the OpenAI function schema and answers calls asynchronously:

    class Lookup:
        schema = {"type": "function", "function": {"name": "lookup", "description": "...",
                  "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}
        async def execute(self, args, context): return text, reward_delta, metrics
        async def create(self, context): ...    # optional: per-trajectory state, in context.state
        async def release(self, context): ...   # optional

`context.extra_info` is the prompt row's extra_info (per-prompt data for a tool, verl's tools_kwargs), so a tool can
answer each prompt differently. A call that raises or runs past its timeout does not stop the step: the model sees an
error message as the tool's answer, and the trajectory's metrics count it. Nor does a `create` that raises or
times out: every call of that trajectory to the tool answers with that error (`release` runs only for the tools
created); a `release` that fails is counted in the trajectory's metrics (agent/tool_setup_errors).
Each call (`execute`, `create`, `release`) runs on an event loop of its own in a thread of its own (reused by later
calls once it has ended), so a tool that blocks (`time.sleep`, a slow C call inside `async def execute`) is cut at the
timeout like one that awaits, and the other trajectories go on meanwhile. A call that awaits is cancelled at the
timeout; one that blocks cannot be, and keeps its thread until the call returns. So asyncio objects a tool keeps
between calls (a lock, a queue) must not be bound to one event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Awaitable, Mapping, Sequence

from rlmegatron.errors import UserError
from rlmegatron.plugins import call_problem, load_plugin, loaded_or_problem


class ToolError(UserError, ValueError):
    """A tool plug-in that cannot serve: the message names it and the fix."""


@dataclass
class ToolContext:
    """One trajectory, as its tools see it."""

    trajectory_id: str
    extra_info: Mapping[str, Any]
    state: dict[str, Any] = field(default_factory=dict)
    """Free for the tools' own per-trajectory state (set up in `create`)."""


@dataclass(frozen=True)
class ToolOutcome:
    text: str
    reward: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)
    error: bool = False
    timed_out: bool = False


def builtin_tools() -> dict[str, type]:
    from rlmegatron.agent.python_tool import PythonTool  # lazy: the sandbox's runner text is only needed when used

    return {"python": PythonTool}


def tool_class(reference: str) -> type:
    builtin = builtin_tools()
    return builtin[reference] if reference in builtin else load_plugin(reference)


def tool_name(tool: Any) -> str:
    return tool.schema["function"]["name"]


def tool_problem(reference: str, config: Mapping[str, Any]) -> str | None:
    """Why the tool `reference` cannot be built with `config` or called as the agent loop calls it; None if it can.
    Builds nothing and calls nothing."""
    if reference not in builtin_tools() and ":" not in reference:
        return (f"is neither a built-in tool ({', '.join(sorted(builtin_tools()))}) nor a plug-in "
                "path/to/tools.py:ClassName")
    cls, problem = loaded_or_problem(tool_class, reference)
    if problem:
        return problem
    if not inspect.isclass(cls):
        return f"is a {type(cls).__name__}, not a class; a tool is a class with `schema` and `async def execute`"
    schema_problem = _schema_problem(getattr(cls, "schema", None))
    if schema_problem:
        return schema_problem
    problem = call_problem(cls, [], config.keys())
    if problem:
        return f"{problem} (rollout.multi_turn.tools[].config holds its keyword arguments)"
    for method, required in (("execute", True), ("create", False), ("release", False)):
        function = getattr(cls, method, None)
        if function is None and not required:
            continue
        if function is None or not inspect.iscoroutinefunction(function):
            return f"needs `async def {method}(self, {'args, ' if method == 'execute' else ''}context)`"
        arguments = ["self", "args", "context"] if method == "execute" else ["self", "context"]
        problem = call_problem(function, arguments)
        if problem:
            return f"{method} {problem}"
    return None


def _schema_problem(schema: Any) -> str | None:
    function = schema.get("function") if isinstance(schema, Mapping) else None
    if (not isinstance(schema, Mapping) or schema.get("type") != "function" or not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str) or not function["name"]
            or not isinstance(function.get("parameters", {}), Mapping)):
        return ('needs a class attribute `schema` in the OpenAI function format: {"type": "function", "function": '
                '{"name": ..., "description": ..., "parameters": {JSON schema}}}')
    return None


def build_tools(entries: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """The tools of `rollout.multi_turn.tools` (reference, config), by their schema names."""
    tools: dict[str, Any] = {}
    for reference, config in entries:
        problem = tool_problem(reference, config)
        if problem:
            raise ToolError(f"rollout.multi_turn.tools: {reference}: {problem}")
        tool = tool_class(reference)(**config)
        if tool_name(tool) in tools:
            raise ToolError(f"rollout.multi_turn.tools: two tools are named {tool_name(tool)!r}; give each its own "
                            "schema name")
        tools[tool_name(tool)] = tool
    return tools


class _ToolLoops:
    """Event loops, each in a daemon thread of its own, that run one tool call at a time. A loop goes back to the idle
    ones only once its call has ended, so a call that blocks keeps its thread and later calls get others; reusing
    them spares each call a new thread and a new event loop, which were much of a multi-turn step's generation on CPU
    (benchmarks/RESULTS.md, "Tool calls on reused event loops")."""

    def __init__(self) -> None:
        self._idle: list[asyncio.AbstractEventLoop] = []
        self._lock = threading.Lock()
        # A forked child has none of these threads: their loops would take calls and never run them.
        os.register_at_fork(after_in_child=self._idle.clear)

    def take(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            while self._idle:
                loop = self._idle.pop()
                if loop.is_running():  # its thread is alive
                    return loop
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="rlm-tool-call", daemon=True).start()
        return loop

    def give_back(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            self._idle.append(loop)


_LOOPS = _ToolLoops()


async def _outcome(call: Awaitable[Any]) -> tuple[Any, BaseException | None]:
    # Every exception but cancellation comes back as a value: one that escaped the task (SystemExit) would stop the
    # loop, and with it the thread later calls are given.
    try:
        return await call, None
    except asyncio.CancelledError:
        raise
    except BaseException as error:  # noqa: BLE001 - handed to the caller's loop
        return None, error


async def _apart(call: Awaitable[Any]) -> Any:
    """What `call` returns, awaited on an event loop of its own in a daemon thread of its own: a call that blocks
    its loop stalls only that thread, and the caller's timeout still fires. Cancelled (the caller's timeout), it
    cancels the call where the call awaits; a blocked call keeps its thread until the call returns."""
    caller = asyncio.get_running_loop()
    answer = caller.create_future()
    pool = _LOOPS  # the loop goes back where it came from
    loop = pool.take()
    running: dict[str, asyncio.Task] = {}
    cancelled = threading.Event()

    def settle(value: Any, error: BaseException | None) -> None:
        if not answer.done():
            answer.set_result(value) if error is None else answer.set_exception(error)

    def ended(task: asyncio.Task) -> None:  # in the call's thread, once the call has really ended
        if inspect.iscoroutine(call):
            call.close()  # never awaited if cancelled before it started; a no-op once it has run
        pool.give_back(loop)
        outcome = (None, asyncio.CancelledError()) if task.cancelled() else task.result()
        with contextlib.suppress(RuntimeError):  # the caller's loop has closed: nobody waits for this answer
            caller.call_soon_threadsafe(settle, *outcome)

    def start() -> None:  # in the call's thread
        # The caller sets `cancelled` before it looks for the task, and this sets the task before it looks at
        # `cancelled`: a timeout that came before the call started is seen on one side or the other.
        running["task"] = task = loop.create_task(_outcome(call))
        task.add_done_callback(ended)
        if cancelled.is_set():
            task.cancel()

    loop.call_soon_threadsafe(start)
    try:
        return await answer
    except asyncio.CancelledError:
        cancelled.set()
        if "task" in running:
            loop.call_soon_threadsafe(running["task"].cancel)
        raise


async def _guarded(call: Awaitable[Any], tool: Any, timeout_s: float, doing: str,
                   raised: str = "") -> tuple[Any, ToolOutcome | None]:
    """What `call` returned, or None and the error message the model reads (`raised` before the exception's name):
    an exception or a timeout never ends the step."""
    try:
        return await asyncio.wait_for(_apart(call), timeout_s), None
    except asyncio.TimeoutError:
        return None, ToolOutcome(f"Error: the tool {tool_name(tool)} did not {doing} within {timeout_s:g} s",
                                 error=True, timed_out=True)
    except Exception as err:
        return None, ToolOutcome(f"Error: {raised}{type(err).__name__}: {err}", error=True)


def _is_image(answer: Any) -> bool:
    """An image a tool may answer with: encoded bytes, a PIL image, or verl's multimodal answer ({"image": ...})."""
    return (isinstance(answer, (bytes, bytearray)) or hasattr(answer, "getpixel")
            or (isinstance(answer, Mapping) and ("image" in answer or "images" in answer)))


async def call_tool(tool: Any, args: Mapping[str, Any], context: ToolContext, timeout_s: float) -> ToolOutcome:
    """The tool's answer, or an error message the model sees."""
    answer, failed = await _guarded(tool.execute(dict(args), context), tool, timeout_s, "answer")
    if failed is not None:
        return failed
    try:
        text, reward, metrics = answer
    except (TypeError, ValueError):
        text = reward = metrics = None
    if _is_image(text):
        # A trajectory is token ids; a tool's image would need its pixels carried into the next turn's request and
        # the actor's batch, which the agent loop does not do.
        raise ToolError(f"the tool {tool_name(tool)} answered with an image ({type(text).__name__}); multi-turn "
                        "tools answer with text: images from tools are not carried into a trajectory")
    try:
        return ToolOutcome(str(text), float(reward), dict(metrics or {}))
    except (TypeError, ValueError):
        return ToolOutcome(f"Error: the tool {tool_name(tool)} returned {type(answer).__name__}, not "
                           "(text, reward_delta, metrics)", error=True)


async def tool_lifecycle(tool: Any, method: str, context: ToolContext, timeout_s: float) -> ToolOutcome | None:
    """The tool's per-trajectory `create` or `release`, if it has one, under the calls' timeout: None when it ran
    (or there is none), else what went wrong, as the model reads it in place of the tool's answers."""
    if not hasattr(tool, method):
        return None
    doing = "start" if method == "create" else "finish"
    _, failed = await _guarded(getattr(tool, method)(context), tool, timeout_s, doing,
                               raised=f"the tool {tool_name(tool)} could not {doing}: ")
    return failed


class ToolsInPrompt:
    """The tokenizer, with the tools' schemas handed to its chat template (`tools=`), which renders them into the
    prompt as the model family expects (Qwen and Hermes: a system block listing them); everything else is the
    tokenizer's own, so any dataset that templates its prompts declares the tools."""

    def __init__(self, tokenizer: Any, schemas: Sequence[Mapping[str, Any]]) -> None:
        self._tokenizer, self._schemas = tokenizer, [dict(schema) for schema in schemas]

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("tools", self._schemas)
        return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def declaring_tools(tokenizer: Any, tools: Sequence[tuple[str, Mapping[str, Any]]]) -> Any:
    """The tokenizer prompts are built with: one whose chat template lists `tools` (reference, config), if any."""
    return ToolsInPrompt(tokenizer, [tool_class(reference).schema for reference, _ in tools]) if tools else tokenizer
