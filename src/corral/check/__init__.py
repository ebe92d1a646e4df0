"""`corral check`: the sandbox checklist proved against a running deployment, on whatever backend it runs.

```python
from corral.check import Target, run_check
report = asyncio.run(run_check(Target(url="http://127.0.0.1:7770", admin_key=ADMIN_KEY, home=Path("/var/lib/corral"))))
report.exit_code  # 1 if any item failed
```

The in-sandbox items are eval tasks of the corpus (tagged with their item numbers) run by the eval runner; the
rest are item functions run through the SDK and the API (`_probes.py`). What the server's backend cannot give
(`GET /v1/info`) is N/A with its reason (`_backend.py`). Everything runs in throwaway tenants that are disabled,
emptied and stripped of their keys at the end.

`private_target(backend)` is a deployment of the check's own (`corral check --backend`, `_private.py`): a private
`corral serve` on this machine, stopped and emptied afterwards; on Kubernetes, `cluster_missing()` says first why
no cluster can be checked, and the command exits `SKIPPED` (3) instead of reporting anything.
"""

from ._catalog import ITEMS, Item
from ._context import CheckContext, Deployment, Target
from ._model import CheckReport, ItemFailed, ItemResult, NotApplicable, Verdict, combine
from ._private import CLUSTER_TIMEOUT, SKIPPED, cluster_missing, private_target
from ._probes import PROBES, Probe
from ._report import print_report, report_json, report_table
from ._run import CheckOptions, Progress, provision, run_check
from ._tasks import checklist_tasks, task_verdicts

__all__ = [
    "CLUSTER_TIMEOUT",
    "ITEMS",
    "PROBES",
    "SKIPPED",
    "CheckContext",
    "CheckOptions",
    "CheckReport",
    "Deployment",
    "Item",
    "ItemFailed",
    "ItemResult",
    "NotApplicable",
    "Probe",
    "Progress",
    "Target",
    "Verdict",
    "checklist_tasks",
    "cluster_missing",
    "combine",
    "print_report",
    "private_target",
    "provision",
    "report_json",
    "report_table",
    "run_check",
    "task_verdicts",
]
