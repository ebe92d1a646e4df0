"""The agent's start is on every cold create's path (docs/performance.md): it must not import the modules that
cost milliseconds and that it does without. Checked with the interpreter sandboxes run (`-S -B`, as the agent)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import corral

AGENT_PARENT = Path(corral.__file__).parent  # holds the `agent` package, as `/.corral` does inside a sandbox
AVOIDED = ("typing", "socket", "signal", "subprocess", "asyncio", "selectors", "dataclasses", "pathlib")


def test_the_agent_starts_without_the_slow_modules() -> None:
    code = (f"import sys; sys.path.insert(0, {str(AGENT_PARENT)!r}); import agent.__main__; "
            f"print(' '.join(m for m in {AVOIDED!r} if m in sys.modules))")
    r = subprocess.run(["/usr/bin/python3", "-S", "-B", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [], f"the agent's start imports {r.stdout.strip()}: import them where used"
