// A sandbox's timeline of checkpoints (on /ui/sandboxes/{id}): newest first, each with its time, name, the command
// an automatic one was taken before, and the bytes it added. Clicking one shows what changed from it to the next
// one (what that command did), or to now for the newest. Roles that may write checkpoints (control/_rbac.py:
// checkpoint.write) get "Checkpoint now" and a Restore button on each; auditors see the timeline and the changes
// only, and the API refuses them anyway.
import * as api from "../api.js";
import { caller } from "../app.js";
import { bytes, errorBox, h, mount, table, time } from "../dom.js";

const WRITERS = ["admin", "operator", "developer"];
const REFRESH_MS = 10000;

export function mayWriteCheckpoints() {
  const who = caller();
  return who !== null && WRITERS.includes(who.role);
}

export function checkpoints(path, cleanups) {
  const list = h("div", { id: "checkpoint-list" });
  const note = h("div", { id: "checkpoint-note" });
  const changes = h("div", { id: "checkpoint-changes" });
  const writer = mayWriteCheckpoints();
  let selected = null;

  const show = async () => {
    let found;
    try {
      found = (await api.get(`${path}/checkpoints`)).checkpoints;
    } catch (err) {
      mount(list, errorBox(err, "Could not list checkpoints: "));
      return;
    }
    const headers = ["Time", "Name", "Before command", "Size", ""];
    mount(list, table(headers, found.map((c, i) => row(c, found[i - 1] || null)),
      { empty: "No checkpoints yet: take one, or create the sandbox with automatic checkpoints." }));
  };

  const row = (c, newer) => h("tr", { dataset: { checkpoint: c.id }, class: c.id === selected ? "selected" : null,
    onclick: () => open(c, newer) },
  h("td", { class: "small" }, time(c.created_at)),
  h("td", {}, c.name ? h("span", { class: "mono" }, c.name) : h("span", { class: "muted small" }, c.id)),
  h("td", { class: "mono small" }, c.command || (c.automatic ? "" : "(taken by hand)")),
  h("td", { class: "num" }, bytes(c.size)),
  h("td", {}, writer ? h("button", { class: "small danger restore", onclick: (event) => {
    event.stopPropagation();
    restore(c);
  } }, "Restore") : null));

  const open = async (c, newer) => {
    selected = c.id;
    for (const tr of list.querySelectorAll("tr[data-checkpoint]")) {
      tr.classList.toggle("selected", tr.dataset.checkpoint === c.id);
    }
    const span = `${c.name || c.id} → ${newer ? newer.name || newer.id : "now"}`;
    mount(changes, h("p", { class: "muted" }, `Loading the changes ${span}…`));
    let found;
    try {
      found = await api.get(`${path}/changes`, { since: c.id, until: newer ? newer.id : null, diff: "true" });
    } catch (err) {
      mount(changes, errorBox(err, "Could not list the changes: "));
      return;
    }
    mount(changes, h("h3", {}, `What changed ${span}`), changeTable(found.changes),
      found.truncated ? h("p", { class: "muted small" }, "Cut at the server's bound: not every change is shown.")
        : null);
  };

  const restore = async (c) => {
    if (!window.confirm(`Restore the sandbox's files to ${c.name || c.id}? Its running processes, code `
      + "sessions and terminals are stopped first.")) return;
    mount(note, h("p", { class: "muted" }, `Restoring ${c.name || c.id}…`));
    try {
      const done = await api.post(`${path}/restore`, { checkpoint: c.id, paths: null });
      mount(note, h("p", { class: "ok", id: "restore-done" }, restored(done)));
      document.dispatchEvent(new CustomEvent("sandbox-restored")); // the processes list follows
    } catch (err) {
      mount(note, errorBox(err, "Could not restore: "));
    }
    show();
  };

  const take = async (event) => {
    event.preventDefault();
    const name = event.target.elements.name.value.trim();
    try {
      const made = await api.post(`${path}/checkpoints`, { name: name || null });
      mount(note, h("p", { class: "ok" }, `Took checkpoint ${made.name || made.id} (${bytes(made.size)}).`));
      event.target.reset();
    } catch (err) {
      mount(note, errorBox(err, "Could not take a checkpoint: "));
    }
    show();
  };

  show();
  const timer = setInterval(show, REFRESH_MS);
  cleanups.push(() => clearInterval(timer));
  const tools = [h("button", { type: "button", id: "checkpoint-refresh", onclick: show }, "Refresh")];
  if (writer) {
    tools.unshift(h("input", { type: "text", name: "name", id: "checkpoint-name", placeholder: "name (optional)" }),
      h("button", { type: "submit", id: "checkpoint-take" }, "Checkpoint now"));
  }
  return [h("form", { class: "toolbar", onsubmit: take }, tools), note, list, changes];
}

function restored(done) {
  const stopped = done.stopped || {};
  const parts = [];
  const procs = stopped.processes || [];
  if (procs.length) parts.push(`${procs.length} process(es) (${procs.map((p) => p.cmd).join("; ")})`);
  if (stopped.code_contexts) parts.push(`${stopped.code_contexts} code session(s)`);
  if (stopped.terminals) parts.push(`${stopped.terminals} terminal(s)`);
  const where = done.paths && done.paths.length ? done.paths.join(", ") : "every file";
  const to = done.checkpoint && typeof done.checkpoint === "object"
    ? done.checkpoint.name || done.checkpoint.id : done.checkpoint;
  return `Restored ${where} to ${to}. Stopped: ${parts.length ? parts.join(", ") : "nothing"}.`;
}

function changeTable(found) {
  return table(["Change", "Type", "Path", "Size", "Was"], found.map((c) => h("tr", { dataset: { path: c.path } },
    h("td", {}, h("span", { class: `change change-${c.kind}` }, c.kind)),
    h("td", { class: "small" }, c.type),
    h("td", { class: "mono small" }, c.path, c.diff ? h("details", {}, h("summary", {}, "diff"),
      h("pre", { class: "diff" }, c.diff)) : null),
    h("td", { class: "num" }, c.size === null ? "" : bytes(c.size)),
    h("td", { class: "num" }, c.old_size === null ? "" : bytes(c.old_size)))),
  { empty: "Nothing changed." });
}
