"""The undo category's machinery: fingerprints of a tree taken inside the sandbox, what a session remembers
between steps (checkpoint ids by label, fingerprints by label), and the checks that compare them.

A fingerprint is one line per entry under the given paths: type, size and sha256 of a regular file's bytes, a
symlink's target, the permission bits and the owner (`uid:gid`). Modification times are left out: a restore puts
files back as they were, but nobody promises a directory's mtime. Each adapter runs `FINGERPRINT_SCRIPT` with its
own command call (the fingerprint is ASCII JSON, so E2B's text decoding leaves it intact) and hands the output to
`fingerprinted`.

`Restored` passes when the fingerprint equals the one recorded before the break, entry for entry; `Broken` when it
differs (the destructive step really destroyed something, so a task cannot pass by breaking nothing);
`AutoCheckpointed` when the step's result carried the automatic checkpoint taken before it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from ._checks import Check, Failure
from ._outcome import ErrorInfo, Outcome
from ._task import AUTO, Fingerprint

__all__ = ["FINGERPRINT_SCRIPT", "AutoCheckpointed", "Broken", "Restored", "Stopped", "UndoState", "differences",
           "fingerprint_argv", "fingerprinted"]

FINGERPRINT_SCRIPT = r"""
import hashlib, json, os, stat, sys
out = {}
def add(p):
    try:
        st = os.lstat(p)
        m = st.st_mode
        if stat.S_ISLNK(m):
            d = "link " + os.readlink(p)
        elif stat.S_ISDIR(m):
            d = "dir"
        elif stat.S_ISREG(m):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            d = "file %d %s" % (st.st_size, h.hexdigest())
        else:
            d = "other %d" % st.st_rdev
        out[p] = "%s %o %d:%d" % (d, stat.S_IMODE(m), st.st_uid, st.st_gid)
    except OSError as e:
        out[p] = "error " + (e.strerror or type(e).__name__)
for root in sys.argv[1:]:
    if not os.path.lexists(root):
        out[root] = "absent"
        continue
    add(root)
    if os.path.isdir(root) and not os.path.islink(root):
        for top, dirs, files in os.walk(root, onerror=lambda e: None):
            for name in dirs + files:
                add(os.path.join(top, name))
print(json.dumps(out, sort_keys=True))
"""

_SHOWN = 6  # differences named in a failure's detail


def fingerprint_argv(step: Fingerprint) -> list[str]:
    return ["python3", "-c", FINGERPRINT_SCRIPT, *step.paths]


@dataclass
class UndoState:
    """What one session remembers: checkpoint ids by label (`AUTO`: the automatic checkpoint before the last step
    that carried one) and fingerprints by label."""

    checkpoints: dict[str, str] = field(default_factory=dict)
    fingerprints: dict[str, dict[str, str]] = field(default_factory=dict)

    def note(self, outcome: Outcome) -> Outcome:
        if outcome.checkpoint is not None:
            self.checkpoints[AUTO] = outcome.checkpoint
        return outcome

    def checkpoint_id(self, label: str) -> str | None:
        return self.checkpoints.get(label)


def fingerprinted(step: Fingerprint, exec_outcome: Outcome, state: UndoState) -> Outcome:
    """The fingerprint command's outcome as the step's: the tree parsed, recorded under `step.record`, and the
    one recorded under `step.compare` beside it."""
    if exec_outcome.error is not None:
        return replace(exec_outcome, kind="fingerprint")
    try:
        found = json.loads(exec_outcome.stdout.decode("utf-8", "replace").strip().splitlines()[-1])
        tree = {str(k): str(v) for k, v in dict(found).items()}
    except (ValueError, IndexError, TypeError) as exc:
        detail = exec_outcome.stderr.decode("utf-8", "replace")[-300:]
        return Outcome("fingerprint", error=ErrorInfo("fingerprint_failed", f"the fingerprint command printed no "
                                                      f"tree ({exc}; exit {exec_outcome.exit_code}): {detail}"))
    if step.record is not None:
        state.fingerprints[step.record] = tree
    recorded = state.fingerprints.get(step.compare) if step.compare is not None else None
    return Outcome("fingerprint", fingerprint=tree, recorded=recorded)


def differences(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """What differs between two fingerprints, one phrase per path, in path order."""
    found = []
    for path in sorted(before.keys() | after.keys()):
        was, now = before.get(path), after.get(path)
        if was == now:
            continue
        if now is None:
            found.append(f"{path} is missing (was {was})")
        elif was is None:
            found.append(f"{path} was not there before ({now})")
        else:
            found.append(f"{path}: {now}, was {was}")
    return found


def _compared(o: Outcome) -> tuple[dict[str, str], dict[str, str]] | Failure:
    if o.fingerprint is None:
        return Failure("sandbox_unavailable", f"no fingerprint came back ({o.summary()})")
    if o.recorded is None:
        return Failure("wrong_result", "no fingerprint was recorded to compare with: the task is malformed")
    return o.recorded, o.fingerprint


@dataclass(frozen=True)
class Restored(Check):
    """Every entry is back exactly as it was when the compared fingerprint was recorded."""

    mode: str = "restore_incomplete"

    def verify(self, o: Outcome) -> Failure | None:
        pair = _compared(o)
        if isinstance(pair, Failure):
            return pair
        diff = differences(*pair)
        if not diff:
            return None
        more = f"; and {len(diff) - _SHOWN} more" if len(diff) > _SHOWN else ""
        return self.fail(f"{len(diff)} of {len(pair[0])} entries are not as they were: "
                         f"{'; '.join(diff[:_SHOWN])}{more}")


@dataclass(frozen=True)
class Broken(Check):
    """Something under the paths differs from the compared fingerprint: the destructive step did its damage."""

    mode: str = "wrong_result"

    def verify(self, o: Outcome) -> Failure | None:
        pair = _compared(o)
        if isinstance(pair, Failure):
            return pair
        if differences(*pair):
            return None
        return self.fail("the destructive step changed nothing that was fingerprinted: the task proves nothing")


@dataclass(frozen=True)
class AutoCheckpointed(Check):
    """The step's result carries the automatic checkpoint taken before it (`checkpoints="auto"`)."""

    mode: str = "checkpoint_missing"

    def verify(self, o: Outcome) -> Failure | None:
        if o.checkpoint:
            return None
        return self.fail(f"the result carries no checkpoint ({o.summary()}), though the sandbox takes one "
                         "before every step that can change files")


@dataclass(frozen=True)
class Stopped(Check):
    """The restore said it stopped a process whose command line contains `command`."""

    command: str = ""
    mode: str = "restore_incomplete"

    def verify(self, o: Outcome) -> Failure | None:
        if any(self.command in c for c in o.stopped):
            return None
        return self.fail(f"the restore did not say it stopped {self.command!r} (it named: "
                         f"{', '.join(o.stopped) or 'nothing'})")
