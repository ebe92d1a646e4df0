// The REST API, called with the signed-in key. The key lives in sessionStorage only (gone when the tab closes,
// cleared at sign-out), never in localStorage, a cookie or a URL.

const KEY = "corral.key";

export class ApiError extends Error {
  constructor(status, code, message, details) {
    super(message);
    this.status = status;
    this.code = code;
    this.details = details || {};
  }
}

export function key() { return sessionStorage.getItem(KEY); }
export function setKey(value) { sessionStorage.setItem(KEY, value); }
export function clearKey() { sessionStorage.removeItem(KEY); }

let onUnauthenticated = () => {};
/** What to do when the server refuses the key (it was revoked, its tenant disabled): sign out. */
export function whenUnauthenticated(fn) { onUnauthenticated = fn; }

/** `path` under the server; `query` an object (null values left out); `body` JSON, or raw with `raw: true`. */
export async function call(method, path, { query = null, body = undefined, raw = false, as = "json" } = {}) {
  const url = new URL(path, window.location.origin);
  for (const [name, value] of Object.entries(query || {})) {
    if (value !== null && value !== undefined && value !== "") url.searchParams.set(name, value);
  }
  const headers = { Authorization: `Bearer ${key() || ""}` };
  let payload;
  if (body !== undefined) {
    if (raw) { payload = body; headers["Content-Type"] = "application/octet-stream"; }
    else { payload = JSON.stringify(body); headers["Content-Type"] = "application/json"; }
  }
  let response;
  try {
    response = await fetch(url, { method, headers, body: payload, cache: "no-store", credentials: "omit" });
  } catch (exc) {
    throw new ApiError(0, "connection_lost", `the server did not answer (${exc.message}); is it still running?`);
  }
  if (!response.ok) throw await errorOf(response);
  if (response.status === 204) return null;
  if (as === "blob") return response.blob();
  if (as === "text") return response.text();
  return response.json();
}

async function errorOf(response) {
  let error = null;
  try { error = (await response.json()).error; } catch { /* not JSON: a proxy's page */ }
  const err = new ApiError(response.status, error ? error.code : `http_${response.status}`,
    error ? error.message : `${response.status} ${response.statusText}`, error ? error.details : {});
  if (response.status === 401) onUnauthenticated(err);
  return err;
}

export const get = (path, query) => call("GET", path, { query });
export const post = (path, body, query) => call("POST", path, { body, query });
export const patch = (path, body) => call("PATCH", path, { body });
export const del = (path, query) => call("DELETE", path, { query });

/** The terminal's WebSocket: a browser cannot set Authorization, so the key travels as a subprotocol. */
export function ptySocket(sandboxId) {
  const scheme = window.location.protocol === "https:" ? "wss" : "ws";
  const url = `${scheme}://${window.location.host}/v1/sandboxes/${encodeURIComponent(sandboxId)}/pty`;
  return new WebSocket(url, ["corral.pty", `corral.key.${key() || ""}`]);
}
