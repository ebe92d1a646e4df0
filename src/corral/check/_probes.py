"""The items proved by functions run through the SDK and the API (the rest are in-sandbox eval tasks), and how a
function's outcome becomes a `Verdict`: its return value is what it observed, `ItemFailed` and `NotApplicable`
say why not, and anything else it raises fails the item with the error (a probe that could not run proves
nothing).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from .._exceptions import CorralError
from ._audit import item_34_audit_tamper_evident, item_35_audit_complete, item_39_audit_keyed
from ._backend import item_31_gvisor
from ._context import CheckContext
from ._fronts import item_43_front_ends_keep_tenancy
from ._host import item_02_agent_channel, item_19_symlink_swap_race, item_36_fail_closed
from ._kubernetes import item_44_pods_locked_down
from ._lifecycle import item_41_ports_are_the_tenants, item_42_volumes_bounded
from ._limits import item_09_process_limit, item_13_output_cap, item_46_runaway_tree_does_not_lock
from ._model import ItemFailed, NotApplicable, Status, Verdict
from ._policy import item_40_forced_runtime_holds
from ._secrets import item_37_secrets_never_inside, item_38_secrets_reach_only_their_hosts
from ._tenancy import item_32_tenants_isolated, item_33_roles_hold
from ._undo import item_45_destructive_command_undone

__all__ = ["PROBES", "Probe", "run_probe"]

ItemFunction = Callable[[CheckContext], Awaitable[str]]


@dataclass(frozen=True)
class Probe:
    number: int
    function: ItemFunction
    heavy: bool = False  # pushes the machine (CPU, processes, output): runs alone, after everything else
    loopback: bool = False  # needs the runner's loopback server (`CheckContext.loopback`, `echoes`)

    @property
    def name(self) -> str:
        return self.function.__name__


PROBES: tuple[Probe, ...] = (
    Probe(2, item_02_agent_channel),
    Probe(9, item_09_process_limit, heavy=True),
    Probe(13, item_13_output_cap, heavy=True),
    Probe(19, item_19_symlink_swap_race, heavy=True),
    Probe(31, item_31_gvisor),
    Probe(32, item_32_tenants_isolated),
    Probe(33, item_33_roles_hold),
    Probe(34, item_34_audit_tamper_evident),
    Probe(35, item_35_audit_complete),
    Probe(36, item_36_fail_closed),
    Probe(37, item_37_secrets_never_inside),
    Probe(38, item_38_secrets_reach_only_their_hosts, loopback=True),
    Probe(39, item_39_audit_keyed),
    Probe(40, item_40_forced_runtime_holds),
    Probe(41, item_41_ports_are_the_tenants),
    Probe(42, item_42_volumes_bounded),
    Probe(43, item_43_front_ends_keep_tenancy),
    Probe(44, item_44_pods_locked_down),
    Probe(45, item_45_destructive_command_undone),
    Probe(46, item_46_runaway_tree_does_not_lock, heavy=True),
)


async def run_probe(probe: Probe, ctx: CheckContext) -> Verdict:
    started = time.monotonic()

    def verdict(status: Status, detail: str, fix: str = "") -> Verdict:
        return Verdict(status, detail, fix, seconds=time.monotonic() - started)

    try:
        return verdict("PASS", await probe.function(ctx))
    except ItemFailed as exc:
        return verdict("FAIL", exc.detail, exc.fix)
    except NotApplicable as exc:
        return verdict("N/A", exc.reason)
    except CorralError as exc:
        return verdict("FAIL", f"the probe could not run: {exc.code}: {' '.join(exc.message.split())}")
    except (httpx.HTTPError, OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        return verdict("FAIL", f"the probe could not run: {type(exc).__name__}: {exc}")
