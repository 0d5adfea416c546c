// The operator console: the tenant's live sandboxes (CPU, memory, age; kill one)
// and a search of its audit log.

import { api, v1 } from './api.js';
import { $, bytes, clear, h, seconds, showError } from './dom.js';

const REFRESH_MS = 5000;
let timer = null;

async function loadSandboxes() {
  const rows = await api('GET', '/ui/api/console/sandboxes');
  const body = $('#console-sandboxes tbody');
  clear(body);
  if (rows.length === 0) {
    body.append(h('tr', {}, h('td', { colspan: 10, class: 'muted', text: 'no live sandboxes' })));
  }
  for (const row of rows) {
    const usage = row.usage || {};
    const kill = h('button', { type: 'button', class: 'kill danger', text: 'Kill',
      onclick: () => killSandbox(row.sandbox_id, kill) });
    body.append(h('tr', { 'data-sandbox': row.sandbox_id },
      h('td', {}, h('code', { text: row.sandbox_id })),
      h('td', { text: row.template }),
      h('td', { class: 'num', text: seconds(row.age) }),
      h('td', { class: 'num', text: seconds(row.idle) }),
      h('td', { class: 'num', text: usage.cpu_seconds == null ? '–' : `${usage.cpu_seconds.toFixed(2)} s` }),
      h('td', { class: 'num', text: bytes(usage.memory_peak_bytes) }),
      h('td', { class: 'num', text: bytes(usage.memory_limit_bytes) }),
      h('td', { class: 'num', text: usage.pids ?? '–' }),
      h('td', { text: row.running ? 'yes' : 'no' }),
      h('td', {}, kill)));
  }
  $('#console-updated').textContent = `updated ${new Date().toLocaleTimeString()}`;
}

async function killSandbox(id, button) {
  button.disabled = true;
  try {
    await api('DELETE', v1(`/sandboxes/${encodeURIComponent(id)}`));
  } catch (error) {
    showError($('#console-error'), error);
  }
  await loadSandboxes();
}

async function searchAudit(event) {
  if (event) event.preventDefault();
  const query = new URLSearchParams();
  const sandbox = $('#audit-sandbox').value.trim();
  const outcome = $('#audit-outcome').value;
  const text = $('#audit-text').value.trim();
  if (sandbox) query.set('sandbox_id', sandbox);
  if (outcome) query.set('outcome', outcome);
  if (text) query.set('text', text);
  query.set('limit', $('#audit-limit').value || '100');
  showError($('#audit-error'), null);
  let rows;
  try {
    rows = await api('GET', `/ui/api/console/audit?${query}`);
  } catch (error) {
    showError($('#audit-error'), error);
    return;
  }
  const body = $('#audit-results tbody');
  clear(body);
  if (rows.length === 0) {
    body.append(h('tr', {}, h('td', { colspan: 8, class: 'muted', text: 'no matching executions' })));
  }
  for (const row of rows.reverse()) {
    const code = row.code ?? `(code not kept: sha256 ${row.code_sha256.slice(0, 12)}…, ${row.code_bytes} bytes)`;
    const flagged = row.precheck ? (row.precheck.flagged ? 'flagged' : 'clean') : '–';
    body.append(h('tr', { 'data-execution': row.execution_id },
      h('td', { text: new Date(row.started_at * 1000).toLocaleString() }),
      h('td', {}, h('code', { text: row.sandbox_id })),
      h('td', { text: row.context }),
      h('td', { class: `outcome-${row.outcome}`, text: row.outcome }),
      h('td', { class: 'num', text: seconds(row.duration) }),
      h('td', { text: row.error_name ?? '' }),
      h('td', { text: flagged }),
      h('td', {}, h('pre', { class: 'code-snippet', text: code }))));
  }
}

function guard(promise) {
  promise.then(() => showError($('#console-error'), null),
    (error) => showError($('#console-error'), error));
}

export function initConsole() {
  $('#console-refresh').addEventListener('click', () => guard(loadSandboxes()));
  $('#audit-form').addEventListener('submit', searchAudit);
}

export function showConsole() {
  guard(loadSandboxes());
  searchAudit();
  if (timer === null) timer = setInterval(() => guard(loadSandboxes()), REFRESH_MS);
}

export function hideConsole() {
  if (timer !== null) clearInterval(timer);
  timer = null;
}
