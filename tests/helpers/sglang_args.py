"""Command lines through SGLang 0.5.23's own argument handling (`prepare_server_args`: its argparse, which exits 2 on
an unknown or ambiguous flag, and ServerArgs' checks), in a process of its own with SGLang's GPU imports stubbed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SGLANG_CPU = REPO_ROOT / "tests" / "rollout" / "sglang_cpu"

_PARSE = """
import json, sys
import gpu_stubs
gpu_stubs.install()
from sglang.srt.server_args import prepare_server_args
for argv in json.loads(sys.stdin.read()):
    try:
        prepare_server_args(argv)
        print(json.dumps([argv, "ok"]))
    except SystemExit as error:
        print(json.dumps([argv, f"exit {error.code}"]))
"""


def parse_with_sglang(commands: list[list[str]]) -> tuple[list[list], str]:
    """[[argv, "ok" or "exit N"], ...] for each command line (its flags, without the interpreter and module), and
    what the parsing process printed on stderr."""
    answer = subprocess.run([sys.executable, "-c", _PARSE], input=json.dumps(commands), text=True,
                            capture_output=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SGLANG_CPU), str(REPO_ROOT)])})
    return [json.loads(line) for line in answer.stdout.splitlines() if line.startswith("[")], answer.stderr


_RESOLVE = """
import json, sys
import gpu_stubs
gpu_stubs.install()
from sglang.srt.arg_groups.model_override_base import resolved_view
from sglang.srt.server_args import prepare_server_args
argv, names = json.loads(sys.stdin.read())
server_args = prepare_server_args(argv)
server_args.resolve_once()
resolved = resolved_view(server_args)
print(json.dumps({name: getattr(resolved, name) for name in names}))
"""


def resolved_by_sglang(argv: list[str], names: list[str]) -> tuple[dict, str]:
    """The values SGLang 0.5.23 settles on for the server arguments `names` from the command line `argv`: its
    argparse, then ServerArgs' resolution (its defaults and aliases; it reads the model's config.json), and what
    it printed on stderr."""
    answer = subprocess.run([sys.executable, "-c", _RESOLVE], input=json.dumps([argv, names]), text=True,
                            capture_output=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(SGLANG_CPU), str(REPO_ROOT)])})
    lines = [line for line in answer.stdout.splitlines() if line.startswith("{")]
    assert answer.returncode == 0 and lines, answer.stderr[-3000:]
    return json.loads(lines[-1]), answer.stderr
