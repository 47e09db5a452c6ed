"""Tools for multi-turn, tool-calling rollouts (`rollout.multi_turn`): the tool protocol, loading and checking
plug-ins, calling them safely (`tools`), the sandboxed built-in `python` tool (`python_tool`) and the tool-call formats
(`parsers`). Torch-free, so the spec checks and the preflight use it; the agent loop that drives the engines with it
is `rollout.agent_loop`."""
