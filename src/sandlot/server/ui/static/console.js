// The operator console: the tenant's live sandboxes (CPU, memory, age; kill one)
// and a search of its audit log.

import { api, v1 } from './api.js';
import { bars, sparkline } from './charts.js';
import { $, bytes, clear, h, revealed, seconds, showError } from './dom.js';

const REFRESH_MS = 5000;
const HISTORY = 60; // samples kept for the sparklines (5 minutes at REFRESH_MS)
let timer = null;
const history = { live: [], ready: [], cellsPerMinute: [], lastCells: null, lastTime: null };

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
      h('td', {}, h('pre', { class: 'code-snippet', text: revealed(code) }))));
  }
}

// --- server figures (Prometheus samples) ------------------------------------------------

function sum(samples, name, labels = {}) {
  return samples
    .filter((s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v))
    .reduce((total, s) => total + s.value, 0);
}

function byLabel(samples, name, label) {
  return samples.filter((s) => s.name === name).map((s) => [s.labels[label], s.value]);
}

function push(list, value) {
  list.push(value);
  if (list.length > HISTORY) list.shift();
}

function figure(title, value, chart) {
  return h('div', { class: 'figure' }, h('h3', { text: title }),
    h('div', { class: 'value', text: value }), chart);
}

async function loadFigures() {
  const samples = await api('GET', '/ui/api/console/metrics');
  const now = Date.now();
  const cells = sum(samples, 'sandlot_executions_total');
  push(history.live, sum(samples, 'sandlot_sandboxes_live'));
  push(history.ready, sum(samples, 'sandlot_pool_ready'));
  if (history.lastCells !== null && now > history.lastTime) {
    push(history.cellsPerMinute, ((cells - history.lastCells) * 60000) / (now - history.lastTime));
  }
  history.lastCells = cells;
  history.lastTime = now;
  const hits = sum(samples, 'sandlot_pool_requests_total', { result: 'hit' });
  const misses = sum(samples, 'sandlot_pool_requests_total', { result: 'miss' });
  const starts = sum(samples, 'sandlot_sandbox_start_seconds_count');
  const startMean = starts ? sum(samples, 'sandlot_sandbox_start_seconds_sum') / starts : null;
  const runs = sum(samples, 'sandlot_execution_seconds_count');
  const runMean = runs ? sum(samples, 'sandlot_execution_seconds_sum') / runs : null;
  const box = $('#figures');
  clear(box);
  box.append(
    figure('Sandboxes live (server)', String(history.live.at(-1)), sparkline(history.live)),
    figure('Cells per minute', history.cellsPerMinute.length
      ? history.cellsPerMinute.at(-1).toFixed(1) : '…', sparkline(history.cellsPerMinute)),
    figure('Warm pool ready', String(history.ready.at(-1)), sparkline(history.ready)),
    figure('Pool hit rate', hits + misses ? `${((100 * hits) / (hits + misses)).toFixed(0)} %` : '–',
      bars([['hit', hits], ['miss', misses]])),
    figure('Cells by outcome', String(cells), bars(byLabel(samples, 'sandlot_executions_total', 'outcome'))),
    figure('Mean sandbox start / cell', `${seconds(startMean)} / ${seconds(runMean)}`, null),
    figure('Requests refused', String(sum(samples, 'sandlot_requests_rejected_total')),
      bars(byLabel(samples, 'sandlot_requests_rejected_total', 'reason'))),
  );
  box.dataset.samples = String(history.live.length);
}

// --- egress and keys --------------------------------------------------------------------

async function searchEgress(event) {
  if (event) event.preventDefault();
  const query = new URLSearchParams({ limit: '100' });
  const sandbox = $('#egress-sandbox').value.trim();
  const verdict = $('#egress-verdict').value;
  if (sandbox) query.set('sandbox_id', sandbox);
  if (verdict) query.set('verdict', verdict);
  showError($('#egress-error'), null);
  let rows;
  try {
    rows = await api('GET', `/ui/api/console/egress?${query}`);
  } catch (error) {
    showError($('#egress-error'), error);
    return;
  }
  const body = $('#egress-results tbody');
  clear(body);
  if (rows.length === 0) {
    body.append(h('tr', {}, h('td', { colspan: 9, class: 'muted', text: 'no egress records' })));
  }
  for (const row of rows.reverse()) {
    body.append(h('tr', {},
      h('td', { text: new Date(row.time * 1000).toLocaleString() }),
      h('td', {}, h('code', { text: row.sandbox_id })),
      h('td', { text: row.method }),
      h('td', { text: row.host }),
      h('td', { class: 'num', text: row.port }),
      h('td', { class: `verdict-${row.verdict}`, text: row.count > 1 ? `${row.verdict} ×${row.count}` : row.verdict }),
      h('td', { text: row.reason }),
      h('td', { class: 'num', text: bytes(row.bytes_in) }),
      h('td', { class: 'num', text: bytes(row.bytes_out) })));
  }
}

async function loadKeys() {
  const rows = await api('GET', '/ui/api/console/keys');
  const body = $('#keys tbody');
  clear(body);
  for (const row of rows) {
    body.append(h('tr', {},
      h('td', {}, h('code', { text: row.key_id })),
      h('td', { text: new Date(row.created_at * 1000).toLocaleString() }),
      h('td', { text: row.revoked_at ? new Date(row.revoked_at * 1000).toLocaleString() : '' }),
      h('td', { class: 'muted', text: row.current ? 'this session' : '' })));
  }
}

function refresh() {
  guard(Promise.all([loadSandboxes(), loadFigures()]));
}

function guard(promise) {
  promise.then(() => showError($('#console-error'), null),
    (error) => showError($('#console-error'), error));
}

export function initConsole() {
  $('#console-refresh').addEventListener('click', refresh);
  $('#audit-form').addEventListener('submit', searchAudit);
  $('#egress-form').addEventListener('submit', searchEgress);
}

export function showConsole() {
  refresh();
  searchAudit();
  searchEgress();
  guard(loadKeys());
  if (timer === null) timer = setInterval(refresh, REFRESH_MS);
}

export function hideConsole() {
  if (timer !== null) clearInterval(timer);
  timer = null;
}
