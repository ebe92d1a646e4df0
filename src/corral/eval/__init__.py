"""Corral's evaluation: a corpus of agent tasks, a runner that aims it at a sandbox service through an adapter,
a failure taxonomy, and reports (docs/eval.md).

```python
from corral.eval import load_corpus, select
tasks = select(load_corpus(), categories=["file_io"], sample=50, seed=1)
```
"""

from ._adapter import Adapter, Session, SetupError
from ._checks import (
    Check,
    CodeError,
    CodeText,
    Data,
    Denied,
    Duration,
    ExitCode,
    Fails,
    Failure,
    Ok,
    Oom,
    RichResult,
    Stderr,
    Stdout,
    TimedOut,
    Truncated,
    classify_bytes,
)
from ._corral import CorralAdapter
from ._deployment import eval_tenant, local_server, run_on_corral
from ._e2b import E2BAdapter
from ._loopback import LoopbackServer
from ._outcome import Denial, ErrorInfo, Outcome
from ._result import RunResults, StepRecord, TaskFailure, TaskResult
from ._runner import run_tasks
from ._select import select
from ._task import (
    CAPABILITIES,
    CATEGORIES,
    SEVERITIES,
    Blob,
    Code,
    Exec,
    Pause,
    Read,
    SetNetwork,
    Setup,
    Step,
    Task,
    Write,
    WriteArchive,
)
from ._taxonomy import MODES, FailureMode, mode
from .corpus import load_corpus

__all__ = [
    "CAPABILITIES",
    "CATEGORIES",
    "MODES",
    "SEVERITIES",
    "Adapter",
    "Blob",
    "Check",
    "Code",
    "CodeError",
    "CodeText",
    "CorralAdapter",
    "Data",
    "Denial",
    "Denied",
    "Duration",
    "E2BAdapter",
    "ErrorInfo",
    "Exec",
    "ExitCode",
    "Fails",
    "Failure",
    "FailureMode",
    "LoopbackServer",
    "Ok",
    "Oom",
    "Outcome",
    "Pause",
    "Read",
    "RichResult",
    "RunResults",
    "Session",
    "SetNetwork",
    "Setup",
    "SetupError",
    "Stderr",
    "Stdout",
    "Step",
    "StepRecord",
    "Task",
    "TaskFailure",
    "TaskResult",
    "TimedOut",
    "Truncated",
    "Write",
    "WriteArchive",
    "classify_bytes",
    "eval_tenant",
    "load_corpus",
    "local_server",
    "mode",
    "run_on_corral",
    "run_tasks",
    "select",
]
