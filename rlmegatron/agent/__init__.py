"""Multi-turn, tool-calling rollouts (`rollout.multi_turn`): tools and their sandbox (`tools`, `python_tool`), the
tool-call formats (`parsers`), and the agent loop that builds each trajectory from token ids turn by turn (`loop`).
Everything but `loop` is torch-free, so the spec checks and the preflight can load and check tool plug-ins."""
