"""Tool calls: the Hermes format, a tool's errors and timeouts as answers the model reads, and the python tool's
sandbox containing an infinite loop, a fork bomb, a memory hog and a 10 MB print while the trajectory goes on."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

from rlmegatron.agent.parsers import PARSERS, ToolCall, tool_call_parser
from rlmegatron.agent.python_tool import PythonTool
from rlmegatron.agent.tools import ToolContext, call_tool
from rlmegatron.data.tokenizer import build_char_tokenizer
from rlmegatron.rollout.agent_loop import AgentLoop, AgentSettings
from rlmegatron.rollout.engine import GenerationRequest, SamplingSpec
from tests.agent.scripted import ScriptedEngine

CONTEXT = ToolContext("0/0", {})


def test_hermes_reads_every_call_of_a_turn_and_names_what_is_malformed():
    parser = tool_call_parser("hermes")
    text = ('Let me look.<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>'
            '<tool_call>{"name": "add", "arguments": "{\\"x\\": 1}"}</tool_call>'
            '<tool_call>{"name": "lookup", "arguments": {oops}</tool_call>'
            '<tool_call>["lookup"]</tool_call><tool_call>{"name": "cut", "argu')
    calls = parser.parse(text)
    assert calls[:2] == [ToolCall("lookup", {"key": "a"}), ToolCall("add", {"x": 1})]
    assert "not valid JSON" in calls[2].error and 'needs {"name"' in calls[3].error
    assert "not valid JSON" in calls[4].error  # cut off by the token budget
    assert parser.parse("The answer is 7.") == []
    assert "hermes" in PARSERS


class Flaky:
    schema = {"type": "function", "function": {"name": "flaky", "parameters": {}}}

    async def execute(self, args, context):
        if args["mode"] == "raise":
            raise KeyError("no such key")
        if args["mode"] == "hang":
            await asyncio.sleep(60)
        if args["mode"] == "wrong":
            return "just text"
        return f"ok {args['mode']}", 0.5, {"flaky/calls": 1}


def test_a_tool_that_raises_or_hangs_answers_with_an_error_message_instead():
    async def calls():
        return await asyncio.gather(*(call_tool(Flaky(), {"mode": mode}, CONTEXT, timeout_s=0.2)
                                      for mode in ("fine", "raise", "hang", "wrong")))

    start = time.perf_counter()
    fine, raised, hung, wrong = asyncio.run(calls())
    assert time.perf_counter() - start < 5
    assert (fine.text, fine.reward, dict(fine.metrics), fine.error) == ("ok fine", 0.5, {"flaky/calls": 1}, False)
    assert raised.text == "Error: KeyError: 'no such key'" and raised.error and not raised.timed_out
    assert hung.text == "Error: the tool flaky did not answer within 0.2 s" and hung.error and hung.timed_out
    assert "returned str, not (text, reward_delta, metrics)" in wrong.text and wrong.error


class Blocking:
    """A tool whose `async def execute` blocks whatever event loop runs it, as `time.sleep` or a slow C call does."""

    schema = {"type": "function", "function": {"name": "blocking", "parameters": {}}}

    async def execute(self, args, context):
        time.sleep(args["seconds"])
        return "done", 0.0, {}


def test_a_tool_that_blocks_its_event_loop_is_cut_at_the_timeout_while_the_others_answer():
    async def calls():
        return await asyncio.gather(call_tool(Blocking(), {"seconds": 3}, CONTEXT, timeout_s=0.3),
                                    call_tool(Flaky(), {"mode": "fine"}, CONTEXT, timeout_s=0.3))

    start = time.perf_counter()
    blocked, fine = asyncio.run(calls())
    assert time.perf_counter() - start < 1.5  # not the 3 s the blocked call sleeps
    assert blocked.text == "Error: the tool blocking did not answer within 0.3 s" and blocked.timed_out
    assert (fine.text, fine.error) == ("ok fine", False)


class WhichThread:
    """Answers with the thread its call ran in."""

    schema = {"type": "function", "function": {"name": "which_thread", "parameters": {}}}

    async def execute(self, args, context):
        await asyncio.sleep(args.get("seconds", 0))
        return str(threading.get_ident()), 0.0, {}


@pytest.fixture
def tool_loops(monkeypatch):
    """A pool of tool-call threads of the test's own: none of another test's calls (a blocked one still sleeping)
    takes from it or gives back to it."""
    from rlmegatron.agent import tools

    pool = tools._ToolLoops()
    monkeypatch.setattr(tools, "_LOOPS", pool)
    return pool


def test_a_calls_thread_is_reused_once_the_call_has_ended_and_never_while_a_blocked_one_runs(tool_loops):
    async def calls():
        first = await call_tool(WhichThread(), {}, CONTEXT, timeout_s=5)
        again = await call_tool(WhichThread(), {}, CONTEXT, timeout_s=5)
        # Blocked past its timeout, on the thread the two calls above had: the next call must not queue behind it.
        blocked = await call_tool(Blocking(), {"seconds": 1.5}, CONTEXT, timeout_s=0.1)
        start = time.perf_counter()
        meanwhile = await call_tool(WhichThread(), {}, CONTEXT, timeout_s=5)
        return first, again, blocked, meanwhile, time.perf_counter() - start

    first, again, blocked, meanwhile, waited_s = asyncio.run(calls())
    assert first.text == again.text  # one thread, reused: no thread and event loop of its own per call
    assert blocked.timed_out
    assert meanwhile.text != first.text and waited_s < 1  # another thread, at once, while the blocked call sleeps
    time.sleep(1.6)  # the blocked call has returned: its thread is free again
    assert len(tool_loops._idle) == 2


def test_a_timed_out_call_gives_its_thread_back_once_cancelled(tool_loops):
    async def calls(n, seconds, timeout_s):
        return await asyncio.gather(*(call_tool(WhichThread(), {"seconds": seconds}, CONTEXT, timeout_s=timeout_s)
                                      for _ in range(n)))

    assert all(outcome.timed_out for outcome in asyncio.run(calls(20, 5, 0.05)))  # cancelled where they await
    time.sleep(0.2)
    loops = set(tool_loops._idle)
    assert len(loops) == 20  # each back, its call cancelled
    assert not any(outcome.error for outcome in asyncio.run(calls(20, 0, 5)))
    assert set(tool_loops._idle) == loops  # the next 20 calls at once ran on them, no new one


def test_a_call_cut_before_its_thread_started_it_is_closed_never_awaited_and_frees_the_thread(tool_loops,
                                                                                               monkeypatch):
    """The call's thread is held up (a busy machine) past the call's timeout: when it gets to the call, the call is
    cancelled unstarted, closed without a 'never awaited' warning, and the thread is given back."""
    import gc
    import warnings

    loop, gate = asyncio.new_event_loop(), threading.Event()
    threading.Thread(target=loop.run_forever, name="rlm-tool-call", daemon=True).start()
    loop.call_soon_threadsafe(gate.wait)  # the loop runs nothing else until the gate opens
    given_back = []
    monkeypatch.setattr(tool_loops, "take", lambda: loop)
    monkeypatch.setattr(tool_loops, "give_back", given_back.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert asyncio.run(call_tool(WhichThread(), {}, CONTEXT, timeout_s=0.05)).timed_out
        gate.set()
        deadline = time.monotonic() + 5
        while not given_back and time.monotonic() < deadline:
            time.sleep(0.01)
        gc.collect()
    assert given_back == [loop]
    assert not [str(warning.message) for warning in caught if "never awaited" in str(warning.message)]
    loop.call_soon_threadsafe(loop.stop)


def test_a_forked_child_calls_tools_on_threads_of_its_own():
    asyncio.run(call_tool(WhichThread(), {}, CONTEXT, timeout_s=5))  # the parent has an idle tool thread
    pid = os.fork()
    if pid == 0:  # the child: the parent's tool threads do not exist here
        try:
            outcome = asyncio.run(asyncio.wait_for(call_tool(WhichThread(), {}, CONTEXT, timeout_s=5), 10))
            os._exit(0 if not outcome.error else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def run_python(tool: PythonTool, *snippets: str) -> list[tuple[str, float, dict]]:
    async def runs():
        return await asyncio.gather(*(tool.execute({"code": code}, CONTEXT) for code in snippets))

    return asyncio.run(runs())


def test_the_python_tool_answers_with_what_the_snippet_prints_in_a_fresh_directory():
    tool = PythonTool(cpu_s=2, memory_mb=256, wall_s=30)
    (first, _, metrics), (second, _, _) = run_python(
        tool, "import math, os\nopen('note', 'w').write('x')\nprint(math.isqrt(144), sorted(os.listdir('.')))",
        "import os\nprint(sorted(os.listdir('.')), os.getcwd())")
    assert first == "12 ['note', 'snippet.py', 'stderr', 'stdout']"
    assert metrics == {"python/limit_hits": 0.0, "python/errors": 0.0}
    listing, cwd = second.rsplit(" ", 1)
    assert listing == "['snippet.py', 'stderr', 'stdout']" and not os.path.exists(cwd)  # removed afterwards


def test_the_python_tool_contains_a_loop_a_fork_bomb_a_memory_hog_a_huge_print_and_the_network():
    """Through the agent loop: one model turn runs six snippets, each contained; the trajectory goes on to its answer."""
    tokenizer = build_char_tokenizer()
    snippets = ["while True:\n    pass",
                "import os\nwhile True:\n    os.fork()",
                "hog = bytearray(2 << 30)\nprint('allocated')",
                "print('x' * 10_000_000)",
                "import socket\nsocket.create_connection(('127.0.0.1', 9))\nprint('connected')",
                "print('started', flush=True)\nwhile True:\n    pass"]
    calls = "".join(f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"
                    for code in snippets)
    eos = tokenizer.eos_token_id
    turns = [tokenizer.encode(calls) + [eos], tokenizer.encode("done") + [eos]]
    settings = AgentSettings(max_turns=3, max_tool_response_length=2000, tool_call_format="hermes",
                             tools=(("python", {"cpu_s": 1, "memory_mb": 128, "wall_s": 30, "max_output_bytes": 1000}),),
                             tool_timeout_s=60, tokenizer_path="unused")
    start = time.perf_counter()
    (result,) = AgentLoop(settings, tokenizer).generate(
        ScriptedEngine(turns, eos), [GenerationRequest((1, 5), SamplingSpec(max_new_tokens=20_000))])
    assert time.perf_counter() - start < 25  # the CPU limits ended the loops, not the 30 s wall limit
    assert result.finish_reason == "stop" and result.agent.turns == 2 and result.agent.tool_calls == 6
    assert tokenizer.decode(result.output_token_ids[result.agent.answer_start:], skip_special_tokens=True) == "done"
    answers = tokenizer.decode([t for t, m in zip(result.output_token_ids, result.response_mask) if not m])
    loop, fork, memory, flood, network, sleeper = [part.split("<|im_end|>")[0]
                                                   for part in answers.split("<|im_start|>tool\n")[1:]]
    assert loop.endswith("[stopped: the CPU time limit of 1 s]")
    assert "PermissionError: the python tool does not allow os.fork" in fork
    assert "MemoryError" in memory and "allocated" not in memory
    assert flood.startswith("x" * 1000) and len(flood) < 1200  # the first 1000 bytes, and why it stopped
    assert "File too large" in flood or "output limit" in flood
    assert "Error" in network and "connected" not in network
    assert sleeper.startswith("started") and sleeper.endswith("[stopped: the CPU time limit of 1 s]")
    assert result.agent.tool_metrics["python/limit_hits"] >= 2 and result.agent.tool_metrics["python/errors"] == 6


def test_the_wall_limit_ends_a_snippet_that_waits():
    # 3 s: the interpreter must start and print within the limit, which a loaded CI machine took more than 0.5 s for.
    tool = PythonTool(cpu_s=5, memory_mb=128, wall_s=3)
    start = time.perf_counter()
    ((text, _, metrics),) = run_python(tool, "import time\nprint('waiting', flush=True)\ntime.sleep(60)")
    assert time.perf_counter() - start < 20  # the sleep's 60 s cut short
    assert text == "waiting\n[stopped: the wall time limit of 3 s]" and metrics["python/limit_hits"] == 1


def test_python_tool_limits_are_checked():
    with pytest.raises(ValueError, match="memory_mb >= 32"):
        PythonTool(memory_mb=1)


def test_the_prompts_declare_the_tools_through_the_chat_template():
    from rlmegatron.agent.tools import declaring_tools
    from rlmegatron.data.dataset import PromptEncoder
    from rlmegatron.data.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    # As Qwen's templates do: the tools' schemas in a system block before the conversation.
    tokenizer.chat_template = ("{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n"
                               "{% endfor %}<|im_end|>\n{% endif %}" + tokenizer.chat_template)
    messages = [{"role": "user", "content": "2+2?"}]
    plain = tokenizer.decode(PromptEncoder(tokenizer)(messages))
    declared = declaring_tools(tokenizer, [("python", {"cpu_s": 1})])
    with_tools = tokenizer.decode(PromptEncoder(declared)(messages))
    assert declaring_tools(tokenizer, []) is tokenizer and "python" not in plain
    assert with_tools.startswith('<|im_start|>system\n{"type": "function", "function": {"name": "python"')
    assert with_tools.endswith(plain) and len(declared) == len(tokenizer)


@pytest.mark.parametrize("answer", [b"\x89PNG...", {"image": [b"..."], "text": "a crop"}], ids=["bytes", "verl"])
def test_a_tool_answering_with_an_image_is_refused_in_one_line(answer):
    """A trajectory carries token ids only: a tool's image (a crop tool's) is refused, not stringified."""
    from rlmegatron.agent.tools import ToolError

    class Crop:
        schema = {"type": "function", "function": {"name": "crop", "parameters": {}}}

        async def execute(self, args, context):
            return answer, 0.0, {}

    with pytest.raises(ToolError, match=r"^the tool crop answered with an image \(\w+\); multi-turn tools answer "
                                        "with text: images from tools are not carried into a trajectory$"):
        asyncio.run(call_tool(Crop(), {}, CONTEXT, timeout_s=5))
