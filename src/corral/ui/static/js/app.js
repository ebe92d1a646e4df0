// The dashboard: sign-in, navigation, and one module per page. Routes are paths under /ui/.
import * as api from "./api.js";
import { errorBox, h, mount } from "./dom.js";
import { adminPage } from "./pages/admin.js";
import { auditPage } from "./pages/audit.js";
import { evalPage } from "./pages/eval.js";
import { sandboxPage } from "./pages/sandbox.js";
import { sandboxesPage } from "./pages/sandboxes.js";

const main = document.getElementById("main");
const ROLES = {
  sandboxes: ["admin", "operator", "developer"],
  audit: ["admin", "operator", "auditor"],
  eval: ["admin", "auditor"],
  admin: ["admin"],
};

let session = null; // {caller: {key_id, tenant_id, tenant, role}, info}
let leave = null; // the current page's cleanup (timers, sockets)

export function can(page) { return session !== null && ROLES[page].includes(session.caller.role); }
export function caller() { return session ? session.caller : null; }

export function banner(message) {
  const el = document.getElementById("banner");
  el.hidden = !message;
  el.textContent = message || "";
}

export function go(path) {
  window.history.pushState({}, "", path);
  route();
}

/** Same-page links: no reload, so the session (and a running terminal's cleanup) stays in our hands. */
document.addEventListener("click", (event) => {
  const link = event.target.closest("a[data-nav]");
  if (!link || event.ctrlKey || event.metaKey || event.shiftKey || event.button !== 0) return;
  event.preventDefault();
  go(link.getAttribute("href"));
});
window.addEventListener("popstate", () => route());

api.whenUnauthenticated((err) => {
  if (!session) return; // signing in: the form says why itself
  api.clearKey();
  session = null;
  signIn(`Signed out: the server refused the key (${err.code}: ${err.message}).`);
});

function nav() {
  const links = [["/ui/", "Sandboxes", "sandboxes"], ["/ui/audit", "Audit", "audit"],
    ["/ui/eval", "Eval", "eval"], ["/ui/admin", "Tenants & keys", "admin"]];
  const here = window.location.pathname;
  mount(document.getElementById("nav"), links.filter(([, , page]) => can(page)).map(([href, label]) =>
    h("a", { href, "data-nav": true, class: here === href ? "active" : null }, label)));
  const who = document.getElementById("who");
  if (!session) { mount(who); return; }
  const c = session.caller;
  mount(who, h("span", { class: "muted", title: `key ${c.key_id}` }, `${c.tenant} · `),
    h("span", { class: `role role-${c.role}` }, c.role),
    h("button", { class: "link", id: "sign-out", onclick: signOut }, "Sign out"));
}

function signOut() {
  api.clearKey();
  session = null;
  window.history.pushState({}, "", "/ui/");
  signIn("Signed out. The key was removed from this tab.");
}

function signIn(notice = "") {
  if (leave) { leave(); leave = null; }
  nav();
  banner("");
  const input = h("input", { type: "password", id: "api-key", name: "key", autocomplete: "off",
    placeholder: "corral_…", required: true, spellcheck: "false" });
  const problem = h("div", { id: "sign-in-error" });
  const form = h("form", { id: "sign-in", class: "card narrow", onsubmit: async (event) => {
    event.preventDefault();
    api.setKey(input.value.trim());
    try {
      await start();
    } catch (err) {
      api.clearKey();
      mount(problem, errorBox(err, err.status === 401 ? "That key was refused. " : "Could not sign in: "));
    }
  } },
  h("h1", {}, "Sign in"),
  notice ? h("p", { class: "notice" }, notice) : null,
  h("label", { for: "api-key" }, "API key"), input,
  h("p", { class: "muted small" },
    "The key is kept in this tab's session storage only, and sent to this server's API with every call."),
  problem,
  h("button", { type: "submit", class: "primary" }, "Sign in"));
  mount(main, form);
  input.focus();
}

async function start() {
  const info = await api.get("/v1/info");
  session = { caller: info.caller, info };
  route();
}

function route() {
  if (leave) { leave(); leave = null; }
  if (!session) { signIn(); return; }
  nav();
  banner("");
  const path = window.location.pathname.replace(/\/+$/, "") || "/ui";
  const match = path.match(/^\/ui\/sandboxes\/([^/]+)$/);
  let page;
  if (path === "/ui") page = can("sandboxes") ? ["sandboxes", sandboxesPage] : ["audit", auditPage];
  else if (match) page = ["sandboxes", (el) => sandboxPage(el, decodeURIComponent(match[1]))];
  else if (path === "/ui/audit") page = ["audit", auditPage];
  else if (path === "/ui/eval") page = ["eval", evalPage];
  else if (path === "/ui/admin") page = ["admin", adminPage];
  if (!page) { mount(main, h("p", { class: "error" }, `No page at ${path}.`)); return; }
  const [name, render] = page;
  if (!can(name) && !(name === "sandboxes" && match)) {
    mount(main, h("p", { class: "error", role: "alert" },
      `permission_denied: the role ${session.caller.role} may not use this page.`));
    return;
  }
  mount(main);
  leave = render(main) || null;
}

if (api.key()) {
  start().catch((err) => { if (err.status !== 401) { api.clearKey(); signIn(`Could not sign in: ${err.message}`); } });
} else {
  signIn();
}
