// Calls to the server. The session lives in an HttpOnly cookie this code cannot
// read; the CSRF token is kept in this module's memory only (never in storage) and
// sent with every call that changes state.

let csrf = null;
const signedOutListeners = [];

export class ApiError extends Error {
  constructor(status, type, message) {
    super(message);
    this.status = status;
    this.type = type;
  }
}

export function setCsrf(token) {
  csrf = token;
}

export function onSignedOut(listener) {
  signedOutListeners.push(listener);
}

/** A path of the API as the page reaches it (the server's gateway to /v1). */
export function v1(path) {
  return `/ui/api/v1${path}`;
}

export async function api(method, path, { json, body, headers = {}, raw = false, signal } = {}) {
  const sent = { ...headers };
  if (method !== 'GET' && method !== 'HEAD') sent['X-CSRF-Token'] = csrf ?? '';
  let payload = body;
  if (json !== undefined) {
    sent['Content-Type'] = 'application/json';
    payload = JSON.stringify(json);
  }
  const response = await fetch(path, {
    method,
    headers: sent,
    body: payload,
    credentials: 'same-origin',
    cache: 'no-store',
    redirect: 'error',
    signal,
  });
  if (!response.ok) {
    let detail = {};
    try {
      detail = await response.json();
    } catch {
      // not JSON: keep the status text
    }
    if (response.status === 401) {
      csrf = null;
      for (const listener of signedOutListeners) listener();
    }
    throw new ApiError(response.status, detail.type || 'HttpError',
      detail.message || `${response.status} ${response.statusText}`);
  }
  if (raw) return response;
  if (response.status === 204) return null;
  return response.json();
}

/** The messages of an NDJSON response, as they arrive. */
export async function* ndjson(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf('\n')) >= 0) {
      const line = buffer.slice(0, end);
      buffer = buffer.slice(end + 1);
      if (line.trim()) yield JSON.parse(line);
    }
  }
  buffer += decoder.decode();
  if (buffer.trim()) yield JSON.parse(buffer);
}
