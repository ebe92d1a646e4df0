// /ui/audit: the trail, filtered by key, action, sandbox (and tenant for admins); verify the hash chain.
import * as api from "../api.js";
import { caller } from "../app.js";
import { errorBox, h, json, mount, table, time } from "../dom.js";

export function auditPage(main) {
  const params = new URLSearchParams(window.location.search);
  const field = (id, placeholder) => h("input", { type: "text", id, placeholder, value: params.get(id) || "" });
  const key = field("key", "key id");
  const action = field("action", "action, e.g. sandbox.exec");
  const sandbox = field("sandbox", "sandbox id");
  const tenant = caller().role === "admin" ? field("tenant", "tenant (name or id)") : null;
  const limit = h("select", { id: "limit" }, [100, 1000, 10000].map((n) => h("option", { value: n }, `newest ${n}`)));
  const list = h("div", { id: "audit-list" });
  const verdict = h("div", { id: "verify-result" });
  let broken = null; // the seq where the chain breaks, to mark it in the table

  const load = async (event) => {
    if (event) event.preventDefault();
    const query = { key: key.value.trim(), action: action.value.trim(), sandbox: sandbox.value.trim(),
      tenant: tenant ? tenant.value.trim() : null, limit: limit.value, order: "desc" };
    let records;
    try {
      records = (await api.get("/v1/audit", query)).records;
    } catch (err) {
      mount(list, errorBox(err, "Could not read the audit trail: "));
      return;
    }
    const shown = records; // newest first, at most `limit`
    mount(list, h("p", { class: "muted small" }, `The newest ${records.length} matching record(s), newest first.`),
      table(["Seq", "Time", "Tenant", "Key", "Role", "Action", "Target", "Outcome", "Parameters"],
        shown.map(row), { empty: "No records match." }));
  };

  const row = (r) => h("tr", { dataset: { seq: r.seq }, class: broken !== null && r.seq === broken ? "broken" : null },
    h("td", { class: "num" }, r.seq), h("td", { class: "small" }, time(r.time)),
    h("td", { class: "mono small" }, r.tenant_id ?? "–"),
    h("td", { class: "mono small" }, r.key_id ? h("button", { class: "link", onclick: () => {
      key.value = r.key_id; load();
    } }, r.key_id) : "–"),
    h("td", {}, r.role ?? "–"), h("td", {}, r.action), h("td", { class: "mono small" }, r.target ?? "–"),
    h("td", { class: `small ${r.outcome && r.outcome.error ? "error" : ""}` }, summary(r.outcome || {}, r.action)),
    h("td", { class: "mono small params" }, json(r.params)));

  // What the server's key proved: records from before audit keys are linked by plain SHA-256 only, which whoever
  // can write the database can redo (docs/audit.md).
  const keyed = (r) => r.unkeyed
    ? `${r.unkeyed} of them from before audit keys (plain SHA-256 links, no HMAC)`
    : "every one signed with the audit key (HMAC)";

  const verify = async () => {
    mount(verdict, h("p", { class: "muted" }, "Verifying the whole chain…"));
    try {
      const r = await api.get("/v1/audit/verify");
      broken = r.problem ? r.problem.seq : null;
      mount(verdict, r.ok
        ? h("p", { class: "ok", id: "verify-ok" }, `The chain is intact: ${r.checked} record(s) checked, `
          + `${keyed(r)}, head ${r.head}.`)
        : h("p", { class: "error", id: "verify-broken" }, `The chain breaks at record ${r.problem.seq} `
          + `(${r.problem.kind}): ${r.problem.message}. ${r.checked} record(s) checked before it.`));
      load();
    } catch (err) {
      mount(verdict, errorBox(err, "Could not verify: "));
    }
  };

  mount(main, h("div", { class: "title" }, h("h1", {}, "Audit trail")),
    h("form", { class: "toolbar", onsubmit: load }, key, action, sandbox, tenant, limit,
      h("button", { type: "submit", class: "primary" }, "Search")),
    h("section", { class: "card" }, h("div", { class: "toolbar" }, h("button", { id: "verify", onclick: verify },
      "Verify the chain"), h("span", { class: "muted small" },
      "Recomputes every record's hash and link: an edited, inserted or deleted record shows where it breaks.")),
    verdict),
    list);
  load();
  return null;
}

function summary(o, action) {
  const parts = [];
  if (o.status !== undefined) parts.push(`${o.status}`);
  if (o.error) parts.push(o.error);
  if (o.exit_code !== undefined && o.exit_code !== null) parts.push(`exit ${o.exit_code}`);
  if (o.allowed !== undefined) parts.push(o.allowed ? "allowed" : "denied");
  if (o.count !== undefined && action === "auth.denied") parts.push(`×${o.count} denied`); // an aggregated flood
  return parts.join(" · ") || json(o);
}
