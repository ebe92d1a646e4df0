"""The in-sandbox agent: PID 1 of every sandbox.

Standard library only, started as `python3 -S -B -m agent` from a read-only bind mount at `/.corral/agent`.
It reaps zombies, runs commands (pipes or a PTY) with timeouts that kill whole process trees, and performs
file operations inside the sandbox's own mount namespace, so that the host never resolves a sandbox path.

Modules: `protocol` (framing, shared with the host), `server` (connections, auth, dispatch), `processes`
(spawning, reaping, output caps, tree kill), `files` (file operations and tar archives).
"""
