"""`Telemetry`: the server's Prometheus metrics (docs/operations.md), counted where every front end's operations
meet: the audit record each operation writes (`Audited.record`), the egress proxy's events, the reconciler's
passes. What is a state rather than an event (sandboxes by state, the warm pool, what the machine has promised) is
read when Prometheus scrapes, not kept up to date on every change.

Not `MetricsSampler` (`_metrics.py`): that samples each sandbox's CPU and memory for E2B's metrics API.

Each `Telemetry` has a registry of its own, not prometheus_client's global one, so several apps in one process
(tests, replicas in one test) count apart. Labels are bounded: tenant ids, actions, error codes, quota and
capacity names, egress rule classes; never a sandbox id, a host or a path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .._exceptions import CorralError
from ..control import Action, Principal, authorize
from ..egress import EgressEvent, rule_class
from ..engine import PoolStats

if TYPE_CHECKING:
    from prometheus_client import Metric

    from ..control import ControlStore
    from ..engine import Engine
    from ._replicas import Replica

__all__ = ["METRICS_CONTENT_TYPE", "EgressMetrics", "Telemetry", "egress_registry"]

# Prometheus' text format as every scraper reads it. The client's newest (1.0.0) differs only for names outside
# [a-zA-Z_:][a-zA-Z0-9_:]*, which these are not, and older Prometheus servers do not know it.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OK = "ok"  # the outcome label of an operation that did not fail
_UNKNOWN_TENANT = "unknown"  # egress of a sandbox whose record is gone
# Seconds. Creates are tens of milliseconds warm and seconds cold or under load; a command is one round trip
# (about a millisecond) up to whatever it runs.
_CREATE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_EXEC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_RECONCILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class EgressMetrics:
    """The egress proxy's counters: the server's (in its `Telemetry`) and a standalone `corral egress-proxy`'s
    (`--metrics-port`), the same names, so one dashboard sums a deployment's proxies wherever they run."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("corral_egress_requests", "Attempts to leave a sandbox through the egress proxy, by "
                                "decision and the class of rule that decided.", ["tenant", "decision", "rule"],
                                registry=registry)
        self.bytes = Counter("corral_egress_bytes", "Bytes through the egress proxy (up: from sandboxes; down: to "
                             "them).", ["tenant", "direction"], registry=registry)

    def observe(self, tenant: str | None, event: EgressEvent) -> None:
        """One attempt through the egress proxy ended (`tenant`: None when the sandbox's record is gone)."""
        tenant = tenant or _UNKNOWN_TENANT
        decision = "allowed" if event.allowed else "denied"
        self.requests.labels(tenant, decision, rule_class(event.rule)).inc()
        if event.bytes_up:
            self.bytes.labels(tenant, "up").inc(event.bytes_up)
        if event.bytes_down:
            self.bytes.labels(tenant, "down").inc(event.bytes_down)


def _process_registry() -> CollectorRegistry:
    """A registry of its own with the process' standard collectors (process_*, python_*)."""
    registry = CollectorRegistry()
    for standard in (ProcessCollector, PlatformCollector, GCCollector):
        standard(registry=registry)
    return registry


def egress_registry() -> tuple[CollectorRegistry, EgressMetrics]:
    """A registry of a standalone egress proxy: its counters and the process' own."""
    registry = _process_registry()
    return registry, EgressMetrics(registry)


class Telemetry:
    """The counters the service moves, and the exposition of them with the gauges read at scrape time."""

    def __init__(self, store: ControlStore, engine: Engine, replica: Replica) -> None:
        self._store = store
        self._replica = replica  # the sandboxes counted are this replica's
        self.registry = registry = _process_registry()
        self.operations = Counter("corral_operations", "Audited operations, by action and outcome (ok, or the "
                                  "error code).", ["action", "outcome"], registry=registry)
        self.creates = Counter("corral_sandbox_creates", "Sandbox creates, by tenant and outcome.",
                               ["tenant", "outcome"], registry=registry)
        self.create_seconds = Histogram("corral_sandbox_create_duration_seconds", "Time to create a sandbox, "
                                        "refusals and failures included.", registry=registry,
                                        buckets=_CREATE_BUCKETS)
        self.exec_seconds = Histogram("corral_exec_duration_seconds", "Time to run a command to its end, from "
                                      "the request to its result.", registry=registry, buckets=_EXEC_BUCKETS)
        self.file_bytes = Counter("corral_file_bytes", "Bytes of files and archives moved through the file API "
                                  "(up: into sandboxes; down: out of them).", ["tenant", "direction"],
                                  registry=registry)
        self.egress = EgressMetrics(registry)
        self.quota_refusals = Counter("corral_quota_refusals", "Operations refused by a tenant quota, by the "
                                      "quota.", ["tenant", "limit"], registry=registry)
        self.capacity_refusals = Counter("corral_capacity_refusals", "Creates refused because the machine is "
                                         "full, by the resource that is short.", ["resource"], registry=registry)
        self.reconciler_runs = Counter("corral_reconciler_runs", "Reconciler passes, by outcome (ok, error).",
                                       ["outcome"], registry=registry)
        self.reconciler_seconds = Histogram("corral_reconciler_duration_seconds", "Time of one reconciler pass.",
                                            registry=registry, buckets=_RECONCILE_BUCKETS)
        self._states = _StateCollector(engine)
        registry.register(self._states)
        self._by_action: Mapping[str, Callable[[str, float, str, dict[str, Any], dict[str, Any]], None]] = {
            "sandbox.create": self._created, "sandbox.exec": self._executed,
            "files.write": self._uploaded, "archive.write": self._uploaded,
            "files.read": self._downloaded, "archive.read": self._downloaded,
        }

    # -- counted as things happen (cheap: a few dictionary lookups and additions) ---------------------------

    def operation(self, action: str, tenant: str, seconds: float, exc: BaseException | None,
                  params: dict[str, Any], outcome: dict[str, Any]) -> None:
        """One audited operation ended (`outcome` is its audit record's: status, error code, figures)."""
        result = str(outcome.get("error") or ("disconnected" if outcome.get("disconnected") else OK))
        self.operations.labels(action, result).inc()
        special = self._by_action.get(action)
        if special is not None:
            special(tenant, seconds, result, params, outcome)
        if isinstance(exc, CorralError):
            self._refused(tenant, exc)

    def refusal(self, action: str, code: str) -> None:
        """A request refused before any operation ran (`auth.denied`, `request.invalid`)."""
        self.operations.labels(action, code).inc()

    def reconciled(self, seconds: float, *, ok: bool) -> None:
        self.reconciler_runs.labels(OK if ok else "error").inc()
        self.reconciler_seconds.observe(seconds)

    def _created(self, tenant: str, seconds: float, result: str, params: dict[str, Any],
                 outcome: dict[str, Any]) -> None:
        self.creates.labels(tenant, result).inc()
        self.create_seconds.observe(seconds)

    def _executed(self, tenant: str, seconds: float, result: str, params: dict[str, Any],
                  outcome: dict[str, Any]) -> None:
        if not params.get("detached"):  # a background process's call ends when the process does, or never
            self.exec_seconds.observe(seconds)

    def _uploaded(self, tenant: str, seconds: float, result: str, params: dict[str, Any],
                  outcome: dict[str, Any]) -> None:
        self._moved(tenant, "up", params.get("size"))

    def _downloaded(self, tenant: str, seconds: float, result: str, params: dict[str, Any],
                    outcome: dict[str, Any]) -> None:
        self._moved(tenant, "down", outcome.get("size"))

    def _moved(self, tenant: str, direction: str, size: object) -> None:
        if isinstance(size, int) and size > 0:
            self.file_bytes.labels(tenant, direction).inc(size)

    def _refused(self, tenant: str, exc: CorralError) -> None:
        """Quota and capacity refusals, by the limit (a quota's name, a resource: a fixed set of words)."""
        if exc.code == "quota_exceeded":
            self.quota_refusals.labels(tenant, str(exc.details.get("limit", "unknown"))[:64]).inc()
        elif exc.code == "capacity_exceeded":
            self.capacity_refusals.labels(str(exc.details.get("resource", "unknown"))[:64]).inc()

    # -- the exposition --------------------------------------------------------------------------------------

    async def scrape(self, principal: Principal) -> bytes:
        """The metrics for an admin (on the API port). Not audited: a scrape every few seconds would fill the
        trail with records of reading it, as reading the audit trail is not audited either."""
        authorize(principal, Action.METRICS_READ)
        return await self.exposition()

    async def exposition(self) -> bytes:
        """Every metric in Prometheus' text format (`METRICS_CONTENT_TYPE`), with the sandboxes by state counted now."""
        self._states.sandboxes = await self._store.count_sandboxes(owner=self._replica.id)
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Gauges of what is, read at scrape time: the sandboxes the store has counted (refreshed by `exposition`
    just before, since the store is async and a collector is not), and the engine's pool and usage (memory)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.sandboxes: dict[tuple[str, str], int] = {}

    def describe(self) -> Iterable[Metric]:
        return ()  # nothing to check for name clashes at registration: these names are ours alone

    def collect(self) -> Iterable[Metric]:
        engine = self._engine
        sandboxes = GaugeMetricFamily("corral_sandboxes", "Live sandboxes this server runs, by tenant and state.",
                                      labels=["tenant", "state"])
        for (tenant, state), count in sorted(self.sandboxes.items()):
            sandboxes.add_metric([tenant, state], count)
        usage = engine.usage()
        yield sandboxes
        stats = engine.pool_stats()
        yield GaugeMetricFamily("corral_pool_size", "Warm sandboxes the engine keeps started ahead of demand "
                                "(all pools: a pinned pool's size, a self-sizing pool's target now).",
                                value=sum(figures.target for figures in stats.values()))
        yield GaugeMetricFamily("corral_pool_ready", "Warm sandboxes started and waiting now.",
                                value=engine.pool_ready)
        yield from _pool_metrics(stats)
        yield GaugeMetricFamily("corral_machine_sandboxes", "Sandboxes that hold room on this machine now "
                                "(running, pooled, being created): what the capacity check counts.",
                                value=usage.sandboxes)
        yield GaugeMetricFamily("corral_machine_memory_promised_bytes", "Sum of the memory limits of those "
                                "sandboxes.", value=usage.memory)
        if engine.capacity.max_sandboxes is not None:
            yield GaugeMetricFamily("corral_capacity_max_sandboxes", "The machine's cap on sandboxes "
                                    "(`corral serve --max-sandboxes`).", value=engine.capacity.max_sandboxes)


def _pool_metrics(stats: Mapping[str, PoolStats]) -> Iterable[Metric]:
    """Per pool (labelled with its `--pool` description): ready members, and how creates were served."""
    ready = GaugeMetricFamily("corral_pool_members_ready", "Ready members of each warm pool.", labels=["pool"])
    target = GaugeMetricFamily("corral_pool_target", "Members each warm pool wants now: a pinned pool's size, a "
                               "self-sizing pool's target (its largest recent burst, within capacity and its "
                               "memory budget).", labels=["pool"])
    counters = {name: CounterMetricFamily(f"corral_pool_{name}", help_, labels=["pool"]) for name, help_ in (
        ("claimed", "Creates served by a warm pool's ready member."),
        ("missed", "Creates that matched a warm pool and found it empty (started cold)."),
        ("made", "Members a warm pool started."),
        ("evicted", "Members given back (memory pressure, room for a caller's create, or over the target)."))}
    for pool, figures in sorted(stats.items()):
        ready.add_metric([pool], figures.ready)
        target.add_metric([pool], figures.target)
        for name, family in counters.items():
            family.add_metric([pool], getattr(figures, name))
    yield ready
    yield target
    yield from counters.values()
