// The notebook: a sandbox, its code contexts, cells with streamed output, files.

import { api, ndjson, v1 } from './api.js';
import { $, bytes, clear, h, revealed, seconds, showError } from './dom.js';
import { renderPrecheck, renderResult } from './render.js';

const state = {
  sandbox: null, // id of the sandbox cells run in
  context: 'default',
  dir: '.',
  running: new Set(), // cells whose stream is open
};

function status(text) {
  $('#nb-status').textContent = text;
}

function sandboxPath(path) {
  return v1(`/sandboxes/${encodeURIComponent(state.sandbox)}${path}`);
}

// --- sandboxes and contexts ------------------------------------------------------------

async function loadSandboxes(select) {
  const boxes = await api('GET', v1('/sandboxes'));
  const menu = $('#nb-sandbox');
  clear(menu);
  if (boxes.length === 0) menu.append(h('option', { value: '', text: '(none: create one)' }));
  for (const box of boxes) {
    menu.append(h('option', { value: box.sandbox_id, text: `${box.sandbox_id} (${box.template})` }));
  }
  const keep = select ?? state.sandbox;
  state.sandbox = boxes.some((b) => b.sandbox_id === keep) ? keep : (boxes[0]?.sandbox_id ?? null);
  menu.value = state.sandbox ?? '';
  await loadContexts();
  await listFiles('.');
}

async function newSandbox() {
  status('starting a sandbox…');
  // timeout null: as long as this server allows (an idle sandbox is still reaped).
  const box = await api('POST', v1('/sandboxes'), { json: { template: 'python-data', timeout: null } });
  status(`sandbox ${box.sandbox_id} started`);
  await loadSandboxes(box.sandbox_id);
}

async function loadContexts(select) {
  const menu = $('#nb-context');
  clear(menu);
  let contexts = [];
  if (state.sandbox) contexts = await api('GET', sandboxPath('/contexts'));
  const ids = ['default', ...contexts.map((c) => c.id).filter((id) => id !== 'default')];
  for (const id of ids) menu.append(h('option', { value: id, text: id }));
  state.context = ids.includes(select ?? state.context) ? (select ?? state.context) : 'default';
  menu.value = state.context;
}

async function newContext() {
  const context = await api('POST', sandboxPath('/contexts'), { json: {} });
  await loadContexts(context.id);
  status(`context ${context.id} created`);
}

async function interrupt() {
  await api('POST', sandboxPath('/interrupt'), { json: { context_id: state.context } });
  status(`interrupt sent to ${state.context}`);
}

async function restart() {
  status(`restarting ${state.context}…`);
  await api('POST', sandboxPath(`/contexts/${encodeURIComponent(state.context)}/restart`));
  status(`${state.context} restarted: its variables are gone`);
}

// --- cells -----------------------------------------------------------------------------

function addCell(code = '') {
  const source = h('textarea', { class: 'source', rows: 3, spellcheck: 'false',
    placeholder: "Python, e.g. df = pd.read_csv('sales.csv') (Shift+Enter runs)" });
  const fit = () => { source.rows = Math.min(30, Math.max(3, source.value.split('\n').length)); };
  source.addEventListener('input', fit);
  source.value = code;
  fit();
  const cell = h('div', { class: 'cell', 'data-status': 'idle' });
  const count = h('span', { class: 'count', text: '[ ]' });
  const badge = h('span', { class: 'status', text: 'idle' });
  const precheck = h('div', { class: 'precheck-box' });
  const output = h('div', { class: 'output' });
  const run = h('button', { class: 'run', type: 'button', text: 'Run' });
  const remove = h('button', { class: 'remove', type: 'button', text: 'Delete' });
  cell.append(h('div', { class: 'cell-head' }, count, run, remove, badge), source, precheck, output);
  const go = () => runCell({ cell, source, count, badge, precheck, output }).catch((error) => {
    setStatus({ cell, badge }, 'failed');
    output.append(h('pre', { class: 'output-error', text: String(error.message || error) }));
  });
  run.addEventListener('click', go);
  source.addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && event.shiftKey) {
      event.preventDefault();
      go();
    }
  });
  remove.addEventListener('click', () => cell.remove());
  $('#cells').append(cell);
  source.focus();
  return cell;
}

function setStatus({ cell, badge }, value) {
  cell.dataset.status = value;
  badge.textContent = value;
}

function streamTo(output, kind, text) {
  // Consecutive chunks of one stream share one <pre>, as a terminal would show them.
  let last = output.lastElementChild;
  if (!last || last.dataset.stream !== kind) {
    last = h('pre', { class: `output-${kind}`, 'data-stream': kind });
    output.append(last);
  }
  last.append(text);
}

async function runCell(parts) {
  const { cell, source, count, badge, precheck, output } = parts;
  if (!state.sandbox) throw new Error('no sandbox: create one first');
  if (state.running.has(cell)) return;
  source.rows = Math.min(30, Math.max(3, source.value.split('\n').length));
  clear(output);
  clear(precheck);
  setStatus(parts, 'running');
  count.textContent = '[*]';
  state.running.add(cell);
  try {
    const response = await api('POST', sandboxPath('/execute'), {
      json: { code: source.value, context_id: state.context },
      raw: true,
    });
    let ended = false;
    for await (const message of ndjson(response)) {
      switch (message.type) {
        case 'stdout':
        case 'stderr':
          streamTo(output, message.type, message.text);
          break;
        case 'result':
          output.append(renderResult(message));
          break;
        case 'error':
          output.append(h('pre', { class: 'output-error',
            text: message.traceback || `${message.name}: ${message.value}` }));
          break;
        case 'number_of_executions':
          count.textContent = `[${message.execution_count}]`;
          break;
        case 'end_of_execution': {
          ended = true;
          if (message.exception) {
            output.append(h('pre', { class: 'output-error',
              text: `${message.exception.type}: ${message.exception.message}` }));
            setStatus(parts, 'failed');
            break;
          }
          setStatus(parts, message.status);
          badge.textContent = `${message.status} · ${seconds(message.duration)}`
            + (message.truncated ? ' · output truncated' : '');
          const report = renderPrecheck(message.precheck);
          if (report) precheck.append(report);
          break;
        }
        default:
          break; // a message type this page does not show
      }
    }
    if (!ended) setStatus(parts, 'disconnected');
    if (count.textContent === '[*]') count.textContent = '[ ]';
  } finally {
    state.running.delete(cell);
  }
  listFiles(state.dir).catch(() => {});
}

// --- files -----------------------------------------------------------------------------

function joinPath(dir, name) {
  return dir === '.' || dir === '' ? name : `${dir.replace(/\/+$/, '')}/${name}`;
}

async function listFiles(dir) {
  const body = $('#files-list tbody');
  showError($('#files-error'), null);
  if (!state.sandbox) {
    clear(body);
    return;
  }
  const entries = await api('GET', sandboxPath(`/files/list?path=${encodeURIComponent(dir)}`));
  state.dir = dir;
  $('#files-path').textContent = revealed(dir);
  clear(body);
  entries.sort((a, b) => (a.type === b.type ? a.name.localeCompare(b.name) : a.type === 'dir' ? -1 : 1));
  for (const entry of entries) {
    const path = joinPath(dir, entry.name);
    // A name is the sandbox's to choose: shown with its hidden characters revealed.
    const shown = revealed(entry.name);
    let name;
    if (entry.type === 'dir') {
      name = h('a', { href: '#', class: 'dir', text: `${shown}/`,
        onclick: (event) => { event.preventDefault(); listFiles(path).catch(fileError); } });
    } else {
      name = h('a', { href: sandboxPath(`/files?path=${encodeURIComponent(path)}`),
        download: shown, class: 'file', text: shown });
    }
    body.append(h('tr', { 'data-path': path }, h('td', {}, name),
      h('td', { class: 'num', text: entry.type === 'dir' ? '' : bytes(entry.size) })));
  }
}

function fileError(error) {
  showError($('#files-error'), error);
}

async function upload(files) {
  for (const file of files) {
    status(`uploading ${file.name}…`);
    await api('POST', sandboxPath(`/files?path=${encodeURIComponent(joinPath(state.dir, file.name))}`), {
      body: file,
      headers: { 'Content-Type': 'application/octet-stream' },
    });
  }
  status(`uploaded ${files.length} file(s)`);
  await listFiles(state.dir);
}

function parent(dir) {
  if (dir === '.' || !dir.includes('/')) return '.';
  return dir.slice(0, dir.lastIndexOf('/')) || '/';
}

// --- wiring ----------------------------------------------------------------------------

function guarded(fn) {
  return (...args) => fn(...args).catch((error) => status(`error: ${error.message || error}`));
}

export function initNotebook() {
  $('#nb-new-sandbox').addEventListener('click', guarded(newSandbox));
  $('#nb-sandbox').addEventListener('change', guarded(async (event) => {
    state.sandbox = event.target.value || null;
    state.dir = '.';
    await loadContexts('default');
    await listFiles('.');
  }));
  $('#nb-context').addEventListener('change', (event) => { state.context = event.target.value; });
  $('#nb-new-context').addEventListener('click', guarded(newContext));
  $('#nb-interrupt').addEventListener('click', guarded(interrupt));
  $('#nb-restart').addEventListener('click', guarded(restart));
  $('#nb-add-cell').addEventListener('click', () => addCell());
  $('#files-refresh').addEventListener('click', () => listFiles(state.dir).catch(fileError));
  $('#files-up').addEventListener('click', () => listFiles(parent(state.dir)).catch(fileError));
  $('#files-upload').addEventListener('change', (event) => {
    const files = [...event.target.files];
    upload(files).catch(fileError).finally(() => { event.target.value = ''; });
  });
  addCell();
}

export async function showNotebook() {
  await loadSandboxes();
}
