// /ui/sandboxes/{id}: CPU and memory charts, a live terminal (xterm.js over the PTY WebSocket), the timeline of
// checkpoints (./checkpoints.js), files, processes, recent activity.
import * as api from "../api.js";
import { go } from "../app.js";
import { lineChart } from "../charts.js";
import { age, bytes, errorBox, h, json, mount, table, time } from "../dom.js";
import { checkpoints } from "./checkpoints.js";

// What each close code of the PTY WebSocket means to the person at the terminal (docs/api.md).
const CLOSES = {
  4401: "the server refused the key (unauthenticated): sign in again",
  4403: "your role may not open a terminal (permission_denied)",
  4404: "this sandbox does not exist, or is not your tenant's (not_found)",
  4409: "the sandbox is paused (conflict): resume it first",
  4410: "the sandbox's timeout ended; it is gone (sandbox_timeout)",
  4429: "over the tenant's quota (quota_exceeded)",
  4502: "the sandbox stopped during the session (agent_error)",
  4503: "the runtime is unavailable (runtime_unavailable)",
};

export function sandboxPage(main, id) {
  const path = `/v1/sandboxes/${encodeURIComponent(id)}`;
  const header = h("div", { id: "sandbox-header" });
  const cleanups = [];
  mount(main,
    h("p", {}, h("a", { href: "/ui/", "data-nav": true }, "← Sandboxes")),
    header,
    h("section", { class: "card", id: "usage-charts" }, h("h2", {}, "CPU and memory over the last hour"),
      h("div", { class: "columns" },
        h("div", {}, h("h3", {}, "CPU (% of its cpus)"), h("div", { id: "cpu-chart" })),
        h("div", {}, h("h3", {}, "Memory used"), h("div", { id: "memory-chart" })))),
    h("section", { class: "card" }, h("h2", {}, "Terminal"), terminal(id, cleanups)),
    h("section", { class: "card", id: "checkpoints" }, h("h2", {}, "Checkpoints"), checkpoints(path, cleanups)),
    h("div", { class: "columns" },
      h("section", { class: "card" }, h("h2", {}, "Files"), files(path)),
      h("section", { class: "card" }, h("h2", {}, "Processes"), processes(path, cleanups))),
    h("section", { class: "card" }, h("h2", {}, "Recent commands and egress decisions"), activity(id)));
  loadHeader(header, path, cleanups);
  return () => cleanups.forEach((fn) => fn());
}

async function loadHeader(el, path, cleanups) {
  let s;
  try {
    s = await api.get(path);
  } catch (err) {
    mount(el, h("h1", { class: "mono" }, decodeURIComponent(path.split("/").pop())),
      errorBox(err, err.status === 404 ? "This sandbox is gone or was never yours: " : "Could not load it: "));
    return;
  }
  const limits = s.limits || {};
  const usage = h("span", { id: "usage" }, "…");
  const kill = async () => {
    if (!window.confirm(`Kill sandbox ${s.id}?`)) return;
    try { await api.del(path); go("/ui/"); } catch (err) { window.alert(`${err.code}: ${err.message}`); }
  };
  mount(el,
    h("div", { class: "title" }, h("h1", { class: "mono" }, s.id),
      h("span", { class: `state state-${s.state}` }, s.state),
      h("button", { class: "danger", onclick: kill }, "Kill")),
    h("dl", { class: "facts" },
      fact("Template", s.template), fact("Runtime", s.runtime), fact("Age", age(s.created_at)),
      fact("Expires", time(s.expires_at)),
      fact("Limits", `${limits.cpus ?? "–"} cpu · ${bytes(limits.memory)} memory · ${bytes(limits.disk)} disk`),
      fact("Network", json(s.network)), fact("Metadata", json(s.metadata)),
      fact("Usage", usage)));
  const sample = async () => {
    try {
      // The sampler keeps an hour of samples, one per 5 s (service/_metrics.py): chart them all.
      const found = (await api.get(`${path}/metrics`, { start: Math.floor(Date.now() / 1000) - 3600 })).metrics;
      charts(found);
      const m = found.at(-1);
      usage.textContent = m ? `${m.cpu_used_pct.toFixed(1)}% of ${m.cpus} cpu · memory ${bytes(m.memory_used)} / `
        + `${bytes(m.memory_total)} · disk ${bytes(m.disk_used)} / ${bytes(m.disk_total)}`
        : "no sample yet (one every 5 s while it runs)";
    } catch (err) {
      usage.textContent = `unavailable (${err.code}: ${err.message})`;
    }
  };
  sample();
  const timer = setInterval(sample, 5000);
  cleanups.push(() => clearInterval(timer));
}

function charts(samples) {
  const at = (m) => Date.parse(m.timestamp);
  const cpu = document.getElementById("cpu-chart");
  const memory = document.getElementById("memory-chart");
  if (cpu) {
    lineChart(cpu, samples.map((m) => ({ t: at(m), v: m.cpu_used_pct })),
      { max: 100, format: (v) => `${v.toFixed(0)}%`, label: "CPU used, percent of its cpus" });
  }
  if (memory) {
    const limit = samples.length ? samples.at(-1).memory_total : 0;
    lineChart(memory, samples.map((m) => ({ t: at(m), v: m.memory_used })),
      { max: Math.min(limit, Math.max(...samples.map((m) => m.memory_used), 0) * 1.25),
        format: (v) => bytes(Math.round(v)), label: "memory used, bytes" });
  }
}

function fact(name, value) {
  return [h("dt", {}, name), h("dd", {}, value)];
}

// -- terminal ---------------------------------------------------------------------------------------------------

function terminal(id, cleanups) {
  const box = h("div", { id: "terminal", class: "terminal" });
  const status = h("p", { id: "terminal-status", class: "muted small", role: "status" }, "Connecting…");
  const again = h("button", { id: "terminal-reconnect", hidden: true }, "Reconnect");
  const term = new window.Terminal({ cursorBlink: true, fontSize: 13, convertEol: false,
    fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
    theme: { background: "#0f172a", foreground: "#e2e8f0" } });
  const fit = new window.FitAddon.FitAddon();
  term.loadAddon(fit);
  let ws = null;
  const encoder = new TextEncoder();

  const send = (data) => { if (ws && ws.readyState === WebSocket.OPEN) ws.send(data); };
  term.onData((data) => send(encoder.encode(data)));
  term.onBinary((data) => send(Uint8Array.from(data, (c) => c.charCodeAt(0))));
  term.onResize(({ rows, cols }) => send(JSON.stringify({ type: "resize", rows, cols })));

  const connect = () => {
    again.hidden = true;
    status.textContent = "Connecting…";
    status.className = "muted small";
    let ended = null; // what the server said last (exit or error)
    ws = api.ptySocket(id);
    ws.binaryType = "arraybuffer";
    ws.onopen = () => {
      fit.fit();
      ws.send(JSON.stringify({ type: "start", cmd: "bash", rows: term.rows, cols: term.cols }));
    };
    ws.onmessage = (event) => {
      if (typeof event.data !== "string") { term.write(new Uint8Array(event.data)); return; }
      const frame = JSON.parse(event.data);
      if (frame.type === "started") {
        status.textContent = `Connected: bash, process ${frame.id} (pid ${frame.pid}).`;
        status.className = "ok small";
        term.focus();
        box.dispatchEvent(new CustomEvent("terminal-started", { bubbles: true })); // it shows in the processes
      } else if (frame.type === "exit" || frame.type === "error") {
        ended = frame;
      }
    };
    ws.onclose = (event) => {
      ws = null;
      again.hidden = false;
      status.className = event.code === 1000 ? "muted small" : "error small";
      if (ended && ended.type === "exit") {
        status.textContent = `The shell exited (code ${ended.exit_code}${ended.killed ? ", killed" : ""}`
          + `${ended.timed_out ? ", timed out" : ""}).`;
      } else if (ended && ended.type === "error") {
        status.textContent = `Terminal refused: ${CLOSES[event.code] || ended.error.code}. ${ended.error.message}`;
      } else if (CLOSES[event.code]) {
        status.textContent = `Terminal closed: ${CLOSES[event.code]}.`;
      } else {
        status.textContent = `Connection lost (WebSocket close ${event.code}): the server went away or the `
          + "network dropped. The shell was ended with the connection.";
      }
    };
  };
  again.addEventListener("click", () => { term.reset(); connect(); });

  // xterm needs the element in the document before `open`.
  requestAnimationFrame(() => { term.open(box); fit.fit(); connect(); });
  const onResize = () => fit.fit();
  window.addEventListener("resize", onResize);
  cleanups.push(() => {
    window.removeEventListener("resize", onResize);
    if (ws) ws.close(1000);
    term.dispose();
  });
  return [box, h("div", { class: "toolbar" }, status, again)];
}

// -- files ------------------------------------------------------------------------------------------------------

function files(path) {
  const where = h("input", { type: "text", id: "files-path", value: "/workspace" });
  const list = h("div", { id: "files-list" });
  const note = h("div", { id: "files-note" });
  const upload = h("input", { type: "file", id: "files-upload", multiple: true });

  const show = async (dir) => {
    where.value = dir;
    let entries;
    try {
      entries = (await api.get(`${path}/files/list`, { path: dir })).entries;
    } catch (err) {
      mount(list, errorBox(err, `Could not list ${dir}: `));
      return;
    }
    entries.sort((a, b) => (a.type === "dir") === (b.type === "dir") ? a.name.localeCompare(b.name)
      : (a.type === "dir" ? -1 : 1));
    const up = dir.replace(/\/[^/]+\/?$/, "") || "/";
    mount(list, h("p", {}, dir !== "/" ? h("button", { class: "link", onclick: () => show(up) }, "↑ up") : null),
      table(["Name", "Size", "Permissions", "Modified", ""], entries.map((e) => h("tr", { dataset: { file: e.name } },
        h("td", { class: "mono" }, e.type === "dir"
          ? h("button", { class: "link", onclick: () => show(e.path) }, `${e.name}/`) : e.name),
        h("td", { class: "num" }, e.type === "dir" ? "" : bytes(e.size)),
        h("td", { class: "mono small" }, e.permissions),
        h("td", { class: "small" }, time(e.mtime)),
        h("td", {}, e.type === "file" ? h("button", { class: "small download", onclick: () => download(e) },
          "Download") : null))), { empty: "Empty directory." }));
  };

  const download = async (entry) => {
    try {
      const blob = await api.call("GET", `${path}/files`, { query: { path: entry.path }, as: "blob" });
      const url = URL.createObjectURL(blob);
      const a = h("a", { href: url, download: entry.name, hidden: true });
      document.body.appendChild(a);
      a.click();
      a.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10000);
    } catch (err) {
      mount(note, errorBox(err, `Could not download ${entry.path}: `));
    }
  };

  upload.addEventListener("change", async () => {
    const dir = where.value.replace(/\/+$/, "") || "";
    for (const file of upload.files) {
      try {
        const r = await api.call("PUT", `${path}/files`, { query: { path: `${dir}/${file.name}` }, body: file,
          raw: true });
        mount(note, h("p", { class: "ok" }, `Uploaded ${r.path} (${bytes(r.size)}).`));
      } catch (err) {
        mount(note, errorBox(err, `Could not upload ${file.name}: `));
      }
    }
    upload.value = "";
    show(where.value);
  });
  show(where.value);
  const open = (event) => { event.preventDefault(); show(where.value.trim() || "/"); };
  return [h("form", { class: "toolbar", onsubmit: open }, where,
    h("button", { type: "submit", id: "files-open" }, "Open"),
    h("label", { class: "button", for: "files-upload" }, "Upload…"), upload), note, list];
}

// -- processes --------------------------------------------------------------------------------------------------

function processes(path, cleanups) {
  const list = h("div", { id: "process-list" });
  const show = async () => {
    let found;
    try {
      found = (await api.get(`${path}/processes`)).processes;
    } catch (err) {
      mount(list, errorBox(err, "Could not list processes: "));
      return;
    }
    mount(list, table(["Id", "Pid", "Command", "State", ""], found.map((p) => h("tr", {},
      h("td", {}, p.id), h("td", {}, p.pid ?? "–"),
      h("td", { class: "mono small" }, Array.isArray(p.argv) ? p.argv.join(" ") : String(p.cmd)),
      h("td", {}, p.running ? (p.pty ? "running (terminal)" : "running") : `exited ${p.exit_code}`),
      h("td", {}, p.running ? h("button", { class: "small danger", onclick: async () => {
        try { await api.post(`${path}/processes/${encodeURIComponent(p.id)}/kill`, {}); } catch (err) {
          window.alert(`${err.code}: ${err.message}`);
        }
        show();
      } }, "Kill") : null))), { empty: "No processes." }));
  };
  show();
  const timer = setInterval(show, 5000);
  document.addEventListener("terminal-started", show);
  document.addEventListener("sandbox-restored", show); // a restore stopped its processes
  cleanups.push(() => {
    clearInterval(timer);
    document.removeEventListener("terminal-started", show);
    document.removeEventListener("sandbox-restored", show);
  });
  return [h("div", { class: "toolbar" }, h("button", { id: "process-refresh", onclick: show }, "Refresh")), list];
}

// -- activity from the audit trail ------------------------------------------------------------------------------

const ACTIVITY = /^(exec|sandbox\.exec|process\.start|sandbox\.pty|code\.run|egress\.|checkpoint\.(restore|delete))/;

function activity(id) {
  const list = h("div", { id: "activity" });
  const show = async () => {
    let records;
    try {
      records = (await api.get("/v1/audit", { sandbox: id, limit: 500, order: "desc" })).records;
    } catch (err) {
      mount(list, err.status === 403
        ? h("p", { class: "muted" }, "Your role cannot read the audit trail (operators, auditors and admins can).")
        : errorBox(err, "Could not read the audit trail: "));
      return;
    }
    const shown = records.filter((r) => ACTIVITY.test(r.action)).slice(0, 50); // newest first
    mount(list, table(["Time", "Action", "What", "Outcome"], shown.map((r) => h("tr", {},
      h("td", { class: "small" }, time(r.time)), h("td", {}, r.action),
      h("td", { class: "mono small" }, describe(r)), h("td", { class: "small" }, outcome(r)))),
    { empty: "No commands or egress decisions recorded yet." }));
  };
  show();
  return [h("div", { class: "toolbar" }, h("button", { onclick: show }, "Refresh")), list];
}

function describe(r) {
  const p = r.params || {};
  if (r.action.startsWith("egress.")) return `${p.method || ""} ${p.host || ""}${p.port ? `:${p.port}` : ""}`.trim();
  const cmd = p.cmd ?? p.code;
  return cmd === undefined ? json(p) : (Array.isArray(cmd) ? cmd.join(" ") : String(cmd));
}

function outcome(r) {
  const o = r.outcome || {};
  if (r.action.startsWith("egress.")) return o.allowed === false ? `denied: ${o.reason || o.rule || ""}` : "allowed";
  if (o.error) return `error ${o.error}`;
  if (o.exit_code !== undefined && o.exit_code !== null) return `exit ${o.exit_code}`;
  return o.status !== undefined ? `status ${o.status}` : json(o);
}
