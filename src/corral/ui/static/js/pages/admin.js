// /ui/admin (admins): tenants, their quotas, enabling/disabling them, and API keys.
import * as api from "../api.js";
import { bytes, errorBox, h, mount, table, time } from "../dom.js";

const QUOTAS = ["max_sandboxes", "max_memory_bytes", "max_cpus", "max_sandbox_memory_bytes", "max_sandbox_cpus",
  "max_sandbox_disk_bytes", "max_sandbox_timeout", "max_volumes", "max_volume_bytes"];

export function adminPage(main) {
  const tenants = h("div", { id: "tenants" });
  const keys = h("div", { id: "keys" });
  const editor = h("div", { id: "quota-editor" });
  const note = h("div", { id: "admin-note" });

  const loadTenants = async () => {
    let found;
    try { found = (await api.get("/v1/tenants")).tenants; } catch (err) {
      mount(tenants, errorBox(err, "Could not list tenants: ")); return;
    }
    mount(tenants, table(["Tenant", "Id", "Created", "Quotas", "State", ""], found.map((t) => h("tr", {
      dataset: { tenant: t.name } },
    h("td", {}, t.name), h("td", { class: "mono small" }, t.id), h("td", { class: "small" }, time(t.created_at)),
    h("td", { class: "small" }, quotaText(t.quotas)),
    h("td", {}, t.disabled ? h("span", { class: "state state-killed" }, "disabled") : "enabled"),
    h("td", {}, h("button", { class: "small", onclick: () => editQuotas(t) }, "Quotas"),
      h("button", { class: "small", onclick: () => setDisabled(t, !t.disabled) }, t.disabled ? "Enable" : "Disable"),
      h("button", { class: "small", onclick: () => loadKeys(t.name) }, "Keys"))))));
  };

  const setDisabled = async (t, disabled) => {
    try { await api.patch(`/v1/tenants/${encodeURIComponent(t.id)}`, { disabled }); } catch (err) {
      mount(note, errorBox(err)); }
    loadTenants();
  };

  const editQuotas = (t) => {
    const inputs = QUOTAS.map((name) => [name, h("input", { type: "number", min: 0, step: "any", name,
      value: t.quotas[name] ?? "", placeholder: "no limit" })]);
    const save = async (event) => {
      event.preventDefault();
      const quotas = Object.fromEntries(inputs.map(([name, input]) => [name,
        input.value === "" ? null : Number(input.value)]));
      try {
        await api.patch(`/v1/tenants/${encodeURIComponent(t.id)}`, { quotas });
        mount(editor, h("p", { class: "ok" }, `Saved the quotas of ${t.name}.`));
      } catch (err) { mount(editor, errorBox(err, "Not saved: ")); }
      loadTenants();
    };
    mount(editor, h("form", { class: "card", onsubmit: save }, h("h3", {}, `Quotas of ${t.name}`),
      h("div", { class: "grid" }, inputs.map(([name, input]) => h("label", {}, name, input))),
      h("p", { class: "muted small" }, "Empty: no limit. Memory and disk in bytes, timeout in seconds."),
      h("button", { type: "submit", class: "primary" }, "Save")));
  };

  const loadKeys = async (tenant = null) => {
    let found;
    try { found = (await api.get("/v1/keys", { tenant })).keys; } catch (err) {
      mount(keys, errorBox(err, "Could not list keys: ")); return;
    }
    mount(keys, h("p", { class: "muted small" }, tenant ? `Keys of ${tenant}.` : "Keys of every tenant."),
      table(["Key", "Prefix", "Tenant", "Role", "Name", "Created", "Last used", "Revoked", ""], found.map((k) =>
        h("tr", { dataset: { key: k.id } }, h("td", { class: "mono small" }, k.id), h("td", { class: "mono small" }, k.prefix),
          h("td", {}, k.tenant ?? k.tenant_id), h("td", {}, k.role), h("td", {}, k.name),
          h("td", { class: "small" }, time(k.created_at)), h("td", { class: "small" }, time(k.last_used_at)),
          h("td", { class: "small" }, k.revoked_at ? time(k.revoked_at) : "–"),
          h("td", {}, k.revoked_at ? null : h("button", { class: "small danger", onclick: async () => {
            if (!window.confirm(`Revoke key ${k.id} (${k.name || k.prefix})? Its holder is locked out at once.`)) return;
            try { await api.del(`/v1/keys/${encodeURIComponent(k.id)}`); } catch (err) { mount(note, errorBox(err)); }
            loadKeys(tenant);
          } }, "Revoke"))))));
  };

  const newTenant = h("input", { type: "text", id: "new-tenant", placeholder: "new tenant name" });
  const keyTenant = h("input", { type: "text", id: "key-tenant", placeholder: "tenant" });
  const keyRole = h("select", { id: "key-role" }, ["developer", "operator", "auditor", "admin"].map((r) =>
    h("option", { value: r }, r)));
  const keyName = h("input", { type: "text", id: "key-name", placeholder: "key name (optional)" });
  const created = h("div", { id: "new-key" });

  const createTenant = async (event) => {
    event.preventDefault();
    try { await api.post("/v1/tenants", { name: newTenant.value.trim() }); newTenant.value = ""; mount(note); }
    catch (err) { mount(note, errorBox(err, "Not created: ")); }
    loadTenants();
  };
  const createKey = async (event) => {
    event.preventDefault();
    try {
      const k = await api.post("/v1/keys", { tenant: keyTenant.value.trim(), role: keyRole.value,
        name: keyName.value.trim() });
      mount(created, h("div", { class: "card notice" }, h("p", {}, `New ${k.role} key for ${k.tenant}. It is shown `
        + "once: copy it now."), h("code", { class: "secret", id: "new-key-secret" }, k.key)));
      loadKeys(keyTenant.value.trim());
    } catch (err) { mount(created, errorBox(err, "Not created: ")); }
  };

  mount(main, h("div", { class: "title" }, h("h1", {}, "Tenants & keys")), note,
    h("section", { class: "card" }, h("h2", {}, "Tenants"),
      h("form", { class: "toolbar", onsubmit: createTenant }, newTenant,
        h("button", { type: "submit" }, "Create tenant")), tenants, editor),
    h("section", { class: "card" }, h("h2", {}, "API keys"),
      h("form", { class: "toolbar", onsubmit: createKey }, keyTenant, keyRole, keyName,
        h("button", { type: "submit" }, "Create key")), created,
      h("button", { class: "link", onclick: () => loadKeys(null) }, "Show every tenant's keys"), keys));
  loadTenants();
  loadKeys(null);
  return () => mount(created); // the new key's secret leaves the page with it
}

function quotaText(q) {
  const set = Object.entries(q || {}).filter(([, v]) => v !== null && v !== undefined);
  if (!set.length) return "no limits";
  return set.map(([k, v]) => `${k.replace(/^max_/, "")}=${k.endsWith("_bytes") ? bytes(v) : v}`).join(", ");
}
