"""`Streamed`: an operation whose output a front end relays while it runs (exec, a code cell, a process attach).

It comes in two steps, so that a front end can still answer a refusal with an error status before its stream
begins: the service method authorizes and checks, and returns the operation begun (a refusal is audited and
raised); `run(...callbacks)` then does the work, handing output to the callbacks as it is produced, and writes
the one audit record when it ends: with the result's outcome, with the `error` code of a failure, or with
`disconnected` when the run is cancelled (the client left). `close()` ends an operation that never ran.

```python
stream = await service.commands.stream(principal, sandbox_id, Command("make test"))   # may raise: a refusal
try:
    result = await stream.run(on_stdout=send_stdout, on_stderr=send_stderr)
finally:
    await stream.close()                         # recorded as `disconnected` if `run` never got to end
```
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

from .._exceptions import CorralError, ServerError
from ._audited import Audited

__all__ = ["OutputCallback", "Streamed", "refusals"]

OutputCallback = Callable[[bytes], Awaitable[None]]
Result = TypeVar("Result")


@contextlib.asynccontextmanager
async def refusals(audit: Audited) -> AsyncIterator[Audited]:
    """Record the operation if the block raises (refused before its stream began); else leave it open."""
    try:
        yield audit
    except BaseException as exc:
        await audit.record(exc)
        raise


class Streamed(Generic[Result]):
    """An operation authorized and begun; subclasses give `run` its signature and the result its outcome."""

    def __init__(self, audit: Audited) -> None:
        self._audit = audit
        self._ran = False
        self._ended = False

    async def _run(self, call: Callable[[], Awaitable[Result]],
                   outcome: Callable[[Result], dict[str, Any]]) -> Result:
        if self._ran:
            raise RuntimeError("a streamed operation runs once")
        self._ran = True
        try:
            result = await call()
        except asyncio.CancelledError:
            await self._end(disconnected=True)
            raise
        except BaseException as exc:  # the stream began with a 200: the record keeps it, and names the error
            await self._end(error=exc.code if isinstance(exc, CorralError) else ServerError.code)
            raise
        await self._end(**outcome(result))
        return result

    async def close(self) -> None:
        """End the operation: one that never ran (its client left before) is recorded as `disconnected`, and
        may not run any more. Idempotent, and a no-op after `run` ended."""
        self._ran = True
        await self._end(disconnected=True)

    async def _end(self, **outcome: Any) -> None:
        if self._ended:
            return
        self._ended = True
        self._audit.outcome.update(outcome)
        # Shielded: a cancellation that lands while the record is written (the client left) must not lose it.
        await asyncio.shield(self._audit.record())
