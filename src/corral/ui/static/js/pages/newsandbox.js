// "New sandbox" on /ui/: a form over POST /v1/sandboxes. The server validates every field; its error (naming
// the field) is shown next to the form, and nothing is created. Offered to the roles that may create sandboxes;
// the server refuses the others anyway.
import * as api from "../api.js";
import { caller } from "../app.js";
import { errorBox, h, mount } from "../dom.js";

const CREATORS = ["admin", "operator", "developer"];

export function mayCreate() { const c = caller(); return c !== null && CREATORS.includes(c.role); }

/** The button and its (hidden until opened) form; `created(sandbox)` runs after a create the server accepted. */
export function newSandbox(created) {
  const box = h("section", { class: "card", id: "new-sandbox-form", hidden: true });
  const open = h("button", { class: "primary", id: "new-sandbox", onclick: () => {
    box.hidden = !box.hidden;
    if (!box.hidden && !box.firstChild) build(box, created);
  } }, "New sandbox");
  return { button: open, form: box };
}

function field(label, input, hint = "") {
  return h("label", {}, label, input, hint ? h("span", { class: "small muted" }, hint) : null);
}

function build(box, created) {
  const template = h("select", { id: "ns-template", name: "template" }, h("option", { value: "" }, "loading…"));
  const memory = h("input", { type: "text", id: "ns-memory", placeholder: "512M" });
  const cpus = h("input", { type: "text", id: "ns-cpus", placeholder: "1" });
  const pids = h("input", { type: "text", id: "ns-pids", placeholder: "256" });
  const disk = h("input", { type: "text", id: "ns-disk", placeholder: "1G" });
  const timeout = h("input", { type: "text", id: "ns-timeout", value: "300" });
  const network = h("select", { id: "ns-network" }, h("option", { value: "none" }, "none"),
    h("option", { value: "allowlist" }, "allowlist"), h("option", { value: "internet" }, "internet"));
  const hosts = h("input", { type: "text", id: "ns-hosts", placeholder: "pypi.org, *.example.com:443, @packages",
    disabled: true });
  network.addEventListener("change", () => { hosts.disabled = network.value !== "allowlist"; });
  const metadata = h("div", { id: "ns-metadata" });
  const addPair = (k = "", v = "") => metadata.appendChild(h("div", { class: "toolbar pair" },
    h("input", { type: "text", class: "ns-meta-key", placeholder: "key", value: k }),
    h("input", { type: "text", class: "ns-meta-value", placeholder: "value", value: v })));
  addPair();
  const problem = h("div", { id: "new-sandbox-error" });
  const submit = h("button", { type: "submit", class: "primary", id: "ns-create" }, "Create");

  const body = () => {
    const limits = {};
    for (const [name, input] of [["memory", memory], ["disk", disk]]) {
      if (input.value.trim()) limits[name] = input.value.trim(); // sizes as text: the server parses "512M"
    }
    for (const [name, input] of [["cpus", cpus], ["pids", pids]]) {
      if (input.value.trim()) limits[name] = Number(input.value.trim()) || input.value.trim(); // bad: the server says
    }
    const meta = {};
    for (const pair of metadata.querySelectorAll(".pair")) {
      const k = pair.querySelector(".ns-meta-key").value.trim();
      if (k) meta[k] = pair.querySelector(".ns-meta-value").value;
    }
    const net = network.value === "allowlist"
      ? hosts.value.split(",").map((x) => x.trim()).filter(Boolean) : network.value;
    return { template: template.value, timeout: Number(timeout.value.trim()) || timeout.value.trim(), limits,
      network: net, metadata: meta };
  };

  const onsubmit = async (event) => {
    event.preventDefault();
    mount(problem);
    submit.disabled = true;
    try {
      const sandbox = await api.post("/v1/sandboxes", body());
      mount(problem, h("p", { class: "ok", id: "new-sandbox-created" }, `Created ${sandbox.id}.`));
      created(sandbox);
    } catch (err) {
      mount(problem, errorBox(err, "The server refused it: "));
    } finally {
      submit.disabled = false;
    }
  };

  mount(box, h("h2", {}, "New sandbox"),
    h("form", { id: "ns", onsubmit },
      h("div", { class: "grid" },
        field("Template", template), field("Memory", memory, "e.g. 512M, 2G"), field("CPUs", cpus),
        field("Processes (pids)", pids), field("Disk", disk, "e.g. 1G"), field("Timeout (s)", timeout),
        field("Network", network), field("Allowed hosts", hosts, "comma-separated rules")),
      h("h3", {}, "Metadata"), metadata,
      h("div", { class: "toolbar" }, h("button", { type: "button", id: "ns-add-metadata", onclick: () => addPair() },
        "+ metadata"), submit),
      problem));

  api.get("/v1/templates").then((r) => {
    mount(template, r.templates.map((t) => h("option", { value: t.name }, t.name)));
    if (r.templates.some((t) => t.name === "default")) template.value = "default";
  }).catch((err) => mount(problem, errorBox(err, "Could not list the templates: ")));
}
