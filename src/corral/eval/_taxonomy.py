"""The failure taxonomy: every way a task can fail, named, with a severity and what the user would have seen.

The first eighteen are the modes the field report found when it ran 1,000 agent tasks through a production
code-interpreter sandbox; the rest are what Corral's own corpus can also reveal. Checks (`_checks.py`) name the
mode their failure reveals; the runner adds `hang`, `sandbox_unavailable` and `unstructured_error` for tasks
that never got as far as a check.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._task import Severity

__all__ = ["MODES", "FailureMode", "mode"]


@dataclass(frozen=True)
class FailureMode:
    name: str
    severity: Severity
    title: str
    seen: str  # one line: what the user would have seen


_ALL = (
    FailureMode("binary_corruption", "critical", "Binary data corrupted in transport",
                "a file or output came back with different bytes (re-encoded as text, CRLF-translated, garbled) "
                "and nothing said so"),
    FailureMode("nul_truncation", "critical", "NUL byte truncated the data",
                "everything after the first NUL byte of a file or output was silently missing"),
    FailureMode("silent_output_truncation", "high", "Output cut without saying so",
                "output or a download was shorter than what the program produced, with no truncation flag and "
                "no true size"),
    FailureMode("unhelpful_network_error", "medium", "Network refusal with no useful reason",
                "pip or curl failed with a bare 403 or 'No matching distribution' and nothing named the host, "
                "the policy or the fix"),
    FailureMode("path_traversal_accepted", "critical", "Path traversal accepted",
                "a path with '..', an absolute path outside the allowed roots or a link out was written or read"),
    FailureMode("timeout_not_enforced", "high", "Timeout not enforced",
                "a command ran past its timeout, or the call returned late, or it did not say it timed out"),
    FailureMode("oom_not_reported", "medium", "Out-of-memory kill not reported",
                "a process killed for memory came back as a bare exit 137 or a lost connection"),
    FailureMode("zombie_processes", "medium", "Processes left behind",
                "background, setsid or double-forked children kept running after the command was timed out or "
                "killed"),
    FailureMode("lost_state", "high", "State lost between steps",
                "a variable, file, directory or session set in one step was gone in the next (or after a pause)"),
    FailureMode("text_decoding_crash", "high", "Invalid UTF-8 broke the call",
                "output that was not valid UTF-8 made the request fail or came back as an exception"),
    FailureMode("package_install_failed", "high", "Package install failed",
                "pip or npm could not install a package the policy allowed"),
    FailureMode("network_isolation_breach", "critical", "Network isolation breached",
                "the sandbox reached a host its policy or the private-range ban forbids (metadata, LAN, the host)"),
    FailureMode("privilege_escalation", "critical", "Privileges beyond the sandbox user",
                "code ran as root, kept capabilities, or a setuid binary / forbidden syscall worked"),
    FailureMode("limit_not_enforced", "high", "Resource limit not enforced",
                "a disk, memory, process, CPU or tmpfs limit did not hold, or held without a clear outcome"),
    FailureMode("wrong_exit_code", "medium", "Exit status lost",
                "the exit code or signal of the command was not the one the program ended with"),
    FailureMode("stdin_lost", "medium", "Stdin lost or altered",
                "the program did not receive the exact bytes sent to its standard input"),
    FailureMode("host_file_exposed", "critical", "Host file exposed",
                "a symlink or race inside the sandbox made the host read or write one of its own files"),
    FailureMode("env_leak", "high", "Host environment leaked",
                "host variables, credentials or orchestrator tokens were visible inside the sandbox"),
    # Beyond the field report's eighteen.
    FailureMode("unstructured_error", "medium", "Server error instead of a clear one",
                "a 500, a stack trace or a dropped connection answered input the service should have refused "
                "clearly"),
    FailureMode("unclear_error", "low", "Error that does not explain itself",
                "the right kind of error came back, but its message did not say what was wrong or how to fix it"),
    FailureMode("hang", "high", "Task hung",
                "the task did not finish within its time budget; the agent would have waited forever"),
    FailureMode("sandbox_unavailable", "high", "Sandbox unavailable",
                "the sandbox could not be created, or died, or a step failed with an unexpected error"),
    FailureMode("wrong_result", "medium", "Wrong result",
                "the program ran but printed something other than the right answer (a missing library, a "
                "different tool version, a broken runtime)"),
    FailureMode("missing_rich_output", "medium", "Rich output missing",
                "a chart, table or other rich result of a code cell did not come back"),
    FailureMode("filename_mangled", "medium", "File name mangled",
                "a file whose name has spaces, Unicode or odd characters was stored or listed under another name"),
    FailureMode("large_transfer_failed", "high", "Large transfer failed",
                "a large upload or download failed, timed out or exhausted memory"),
    FailureMode("host_disrupted", "critical", "Abuse in one sandbox disrupted others",
                "a fork bomb, memory hog or CPU burner in one sandbox made other sandboxes or the host "
                "unresponsive"),
    FailureMode("code_error_misreported", "medium", "Code error misreported",
                "an exception, compile error or runtime error of a cell came back as success, or lost its name "
                "or message"),
    FailureMode("restore_incomplete", "critical", "Restore did not bring everything back",
                "after restoring the checkpoint taken before a destructive command, a file, its bytes, mode, "
                "owner or link, or a deletion was not as it had been (or the restore failed)"),
    FailureMode("checkpoint_missing", "high", "No checkpoint to undo with",
                "a sandbox with automatic checkpoints ran a command that changes files and its result named no "
                "checkpoint taken before it, or a checkpoint could not be taken"),
)

MODES: dict[str, FailureMode] = {m.name: m for m in _ALL}


def mode(name: str) -> FailureMode:
    """The failure mode called `name`; a KeyError names the known ones."""
    try:
        return MODES[name]
    except KeyError:
        raise KeyError(f"unknown failure mode {name!r}; known: {', '.join(MODES)}") from None
