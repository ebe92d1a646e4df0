// /ui/: the tenant's sandboxes, with live CPU and memory from the metrics endpoint; New sandbox; kill; the kill
// switch.
import * as api from "../api.js";
import { can, caller } from "../app.js";
import { age, bytes, errorBox, h, json, mount, table } from "../dom.js";
import { mayCreate, newSandbox } from "./newsandbox.js";

const REFRESH_MS = 5000;

export function sandboxesPage(main) {
  const filter = h("input", { type: "search", id: "filter", placeholder: "Filter: id, state, template, metadata…" });
  const metadata = h("input", { type: "text", id: "metadata-filter", placeholder: "metadata key=value (server-side)" });
  const list = h("div", { id: "sandbox-list" });
  const status = h("span", { class: "muted small", id: "refreshed" });
  let sandboxes = [];
  let metrics = {};

  const render = () => {
    const words = filter.value.trim().toLowerCase().split(/\s+/).filter(Boolean);
    const shown = sandboxes.filter((s) => words.every((w) => haystack(s).includes(w)));
    mount(list, table(["Sandbox", "State", "Template", "Age", "Limits", "CPU", "Memory", "Metadata", ""],
      shown.map((s) => row(s, metrics[s.id], refresh)),
      { empty: sandboxes.length ? "No sandbox matches the filter." : "No sandboxes in this tenant." }));
  };

  async function refresh() {
    const query = {};
    const [k, ...v] = metadata.value.split("=");
    if (k.trim() && v.length) query[`metadata.${k.trim()}`] = v.join("=").trim();
    try {
      sandboxes = (await api.get("/v1/sandboxes", query)).sandboxes;
    } catch (err) {
      mount(list, errorBox(err, "Could not list sandboxes: "));
      return;
    }
    const since = Math.floor(Date.now() / 1000) - 30;
    const running = sandboxes.filter((s) => s.state === "running");
    const found = await Promise.all(running.map((s) =>
      api.get(`/v1/sandboxes/${encodeURIComponent(s.id)}/metrics`, { start: since })
        .then((r) => r.metrics.at(-1) || null).catch(() => null)));
    metrics = Object.fromEntries(running.map((s, i) => [s.id, found[i]]));
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
    render();
  }

  filter.addEventListener("input", render);
  metadata.addEventListener("change", refresh);
  const create = mayCreate() ? newSandbox(() => refresh()) : null;
  mount(main,
    h("div", { class: "title" }, h("h1", {}, "Sandboxes"), status, create ? create.button : null),
    create ? create.form : null,
    h("div", { class: "toolbar" }, filter, metadata,
      h("button", { onclick: refresh }, "Refresh")),
    list,
    can("audit") && caller().role !== "auditor" ? killSwitch(refresh) : null);
  refresh();
  const timer = setInterval(refresh, REFRESH_MS);
  return () => clearInterval(timer);
}

function haystack(s) {
  return [s.id, s.state, s.template, s.runtime, json(s.metadata)].join(" ").toLowerCase();
}

function row(s, m, refresh) {
  const limits = s.limits || {};
  const cpu = m ? `${m.cpu_used_pct.toFixed(1)}%` : "–";
  const memory = m ? `${bytes(m.memory_used)} / ${bytes(m.memory_total)}` : "–";
  const meta = Object.entries(s.metadata || {}).map(([k, v]) => h("span", { class: "tag" }, `${k}=${v}`));
  return h("tr", { dataset: { sandbox: s.id } },
    h("td", {}, h("a", { href: `/ui/sandboxes/${encodeURIComponent(s.id)}`, "data-nav": true, class: "mono" }, s.id)),
    h("td", {}, h("span", { class: `state state-${s.state}` }, s.state)),
    h("td", {}, s.template),
    h("td", { title: s.created_at }, age(s.created_at)),
    h("td", { class: "small" }, `${limits.cpus ?? "–"} cpu · ${bytes(limits.memory)} · ${bytes(limits.disk)}`),
    h("td", { class: "num cpu" }, cpu),
    h("td", { class: "num memory" }, memory),
    h("td", {}, meta),
    h("td", {}, h("button", { class: "danger small", onclick: () => kill(s.id, refresh) }, "Kill")));
}

async function kill(id, refresh) {
  if (!window.confirm(`Kill sandbox ${id}? Its processes and files are gone.`)) return;
  try {
    await api.del(`/v1/sandboxes/${encodeURIComponent(id)}`);
  } catch (err) {
    window.alert(`Could not kill ${id}: ${err.code}: ${err.message}`);
  }
  refresh();
}

/** Operators and admins: stop every sandbox of a tenant, or of one key (optionally revoking it). */
function killSwitch(refresh) {
  const c = caller();
  const which = h("select", { id: "kill-kind" }, h("option", { value: "tenant" }, "every sandbox of the tenant"),
    h("option", { value: "key" }, "every sandbox created with the key"));
  const target = h("input", { type: "text", id: "kill-target", value: c.tenant, placeholder: "tenant name or key id" });
  const revoke = h("input", { type: "checkbox", id: "kill-revoke" });
  const result = h("div", { id: "kill-result" });
  which.addEventListener("change", () => { target.value = which.value === "tenant" ? c.tenant : ""; });
  const fire = async () => {
    const body = which.value === "tenant" ? { tenant: target.value.trim() }
      : { key: target.value.trim(), revoke: revoke.checked };
    if (!window.confirm(`Stop ${which.value === "tenant" ? "every sandbox of tenant" : "every sandbox of key"} `
      + `${target.value.trim()} now?`)) return;
    try {
      const r = await api.post("/v1/kill", body);
      const failed = Object.entries(r.failed || {});
      mount(result, h("p", { class: failed.length ? "error" : "ok" },
        `Stopped ${r.killed.length} sandbox(es)${r.revoked ? "; key revoked" : ""}.`
        + (failed.length ? ` Failed: ${failed.map(([id, why]) => `${id} (${why})`).join(", ")}` : "")));
    } catch (err) {
      mount(result, errorBox(err, "Kill switch refused: "));
    }
    refresh();
  };
  return h("section", { class: "card danger-zone", id: "kill-switch" },
    h("h2", {}, "Kill switch"),
    h("p", { class: "muted small" }, "Stops at once, in parallel. Operators act in their own tenant only."),
    h("div", { class: "toolbar" }, "Stop", which, target,
      h("label", { class: "inline" }, revoke, " revoke the key first"),
      h("button", { class: "danger", onclick: fire }, "Stop now")),
    result);
}
