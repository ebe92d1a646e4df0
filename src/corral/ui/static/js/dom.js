// Building the page without ever parsing API data as HTML: every string goes in as a text node or an attribute.

/** h("a", {href, class, onclick}, child, ...): an element; children are nodes, strings (text), arrays or null. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") el.addEventListener(name.slice(2), value);
    else if (name === "class") el.className = value;
    else if (name === "dataset") Object.assign(el.dataset, value);
    else if (name === "value") el.value = value;
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.appendChild(child);
    else el.appendChild(document.createTextNode(String(child)));
  }
}

/** Replace the children of `el`. */
export function mount(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function table(headers, rows, { empty = "Nothing here." } = {}) {
  if (!rows.length) return h("p", { class: "muted" }, empty);
  return h("table", {},
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows));
}

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

export function bytes(n) {
  if (n === null || n === undefined || n === "") return "–";
  if (typeof n === "string") return n;
  let i = 0;
  while (Math.abs(n) >= 1024 && i < UNITS.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${UNITS[i]}`;
}

export function age(iso) {
  if (!iso) return "–";
  const s = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  if (s < 60) return `${Math.floor(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d`;
}

/** An ISO 8601 time, or unix seconds (file times), in the browser's locale. */
export function time(iso) {
  if (iso === null || iso === undefined || iso === "") return "–";
  const d = new Date(typeof iso === "number" ? iso * 1000 : iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toLocaleString();
}

export function json(value) {
  return JSON.stringify(value);
}

/** A one-line error box for a failed call (`err` an ApiError or any Error). */
export function errorBox(err, prefix = "") {
  const code = err && err.code ? `${err.code}: ` : "";
  return h("p", { class: "error", role: "alert" }, `${prefix}${code}${err && err.message ? err.message : err}`);
}
