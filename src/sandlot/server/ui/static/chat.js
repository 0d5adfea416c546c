// Chat with your data: the data-analysis agent on the server; each cell it writes is
// shown with its pre-check report to allow, edit or refuse before it runs.

import { api, ndjson } from './api.js';
import { $, h, hasHidden, revealed } from './dom.js';
import { renderPrecheck, renderResult } from './render.js';

const state = { chat: null, asking: false };

function status(text) {
  $('#chat-status').textContent = text;
}

function log(el) {
  $('#chat-log').append(el);
  el.scrollIntoView({ block: 'nearest' });
  return el;
}

function enable(on) {
  $('#chat-upload').disabled = !on;
  $('#chat-question').disabled = !on;
  $('#chat-ask').disabled = !on;
}

async function startChat() {
  if (state.chat) {
    api('DELETE', `/ui/api/chat/${encodeURIComponent(state.chat)}`).catch(() => {});
  }
  state.chat = null;
  enable(false);
  status('starting a sandbox for the chat…');
  const chat = await api('POST', '/ui/api/chat');
  state.chat = chat.chat_id;
  enable(true);
  status(`chat ready (sandbox ${chat.sandbox_id}): load a CSV or Excel file, then ask`);
}

async function loadData(files) {
  for (const file of files) {
    status(`loading ${file.name}…`);
    const dataset = await api('POST',
      `/ui/api/chat/${encodeURIComponent(state.chat)}/files?name=${encodeURIComponent(file.name)}`,
      { body: file, headers: { 'Content-Type': 'application/octet-stream' } });
    const sampled = dataset.kept < dataset.rows ? `, sampled from ${dataset.rows}` : '';
    log(h('div', { class: 'chat-note', text: `Loaded ${file.name} as ${dataset.name}: `
      + `${dataset.kept} rows${sampled}, ${dataset.columns.length} columns `
      + `(${dataset.columns.map((c) => c[0]).join(', ')})` }));
  }
  status('data loaded');
}

function reviewBox(message) {
  // Code with characters that do not show (a bidirectional override can make a line
  // read differently from how Python reads it) is shown with them revealed, and cannot
  // be run as is: what the user approves must be what runs.
  const hidden = hasHidden(message.code);
  const source = h('textarea', { class: 'source', spellcheck: 'false',
    rows: Math.min(20, Math.max(3, message.code.split('\n').length)) });
  source.value = revealed(message.code);
  const box = h('div', { class: 'cell chat-review', 'data-status': 'review' },
    h('div', { class: 'cell-head' }, h('span', { class: 'count', text: `cell ${message.step}` }),
      h('span', { class: 'status', text: 'waiting for your decision' })),
    hidden ? h('p', { class: 'error hidden-characters', text: 'This cell has characters that do '
      + 'not show (marked ⟨U+…⟩): it cannot be run as the model wrote it. Edit it or refuse it.' })
      : null,
    source, renderPrecheck(message.precheck));
  const decide = async (action) => {
    const body = { review_id: message.review_id, action };
    if (action === 'edit') body.code = source.value;
    if (action === 'refuse') body.reason = 'the user refused this cell';
    for (const button of box.querySelectorAll('button')) button.disabled = true;
    source.readOnly = true;
    await api('POST', `/ui/api/chat/${encodeURIComponent(state.chat)}/decide`, { json: body });
    box.dataset.status = action;
    box.querySelector('.status').textContent = { allow: 'allowed', edit: 'edited and allowed', refuse: 'refused' }[action];
  };
  const guarded = (action) => () => decide(action).catch((error) => status(`error: ${error.message}`));
  box.append(h('div', { class: 'toolbar' },
    h('button', { type: 'button', class: 'allow', text: 'Run', onclick: guarded('allow'),
      disabled: hidden }),
    h('button', { type: 'button', class: 'edit', text: 'Run my edit', onclick: guarded('edit') }),
    h('button', { type: 'button', class: 'refuse danger', text: 'Refuse', onclick: guarded('refuse') })));
  return box;
}

function stepBox(message) {
  const box = h('div', { class: 'cell chat-step', 'data-status': message.status || message.decision });
  if (!message.status) {
    box.append(h('pre', { class: 'muted', text: `not run: ${message.reason}` }));
    return box;
  }
  if (!$('#chat-review').checked || message.decision === 'edit') {
    box.append(h('pre', { class: 'code-ran', text: revealed(message.code) }));
  }
  const precheck = renderPrecheck(message.precheck);
  if (precheck && !$('#chat-review').checked) box.append(precheck);
  const output = h('div', { class: 'output' });
  if (message.stdout) output.append(h('pre', { class: 'output-stdout', text: message.stdout }));
  if (message.stderr) output.append(h('pre', { class: 'output-stderr', text: message.stderr }));
  for (const result of message.results || []) output.append(renderResult(result));
  if (message.error) {
    output.append(h('pre', { class: 'output-error',
      text: message.error.traceback || `${message.error.name}: ${message.error.value}` }));
  }
  box.append(h('div', { class: 'cell-head' }, h('span', { class: 'status', text: message.status })), output);
  return box;
}

async function ask(event) {
  event.preventDefault();
  const question = $('#chat-question').value.trim();
  if (!question || !state.chat || state.asking) return;
  state.asking = true;
  $('#chat-ask').disabled = true;
  $('#chat-question').value = '';
  log(h('div', { class: 'chat-question', text: question }));
  status('thinking…');
  try {
    const response = await api('POST', `/ui/api/chat/${encodeURIComponent(state.chat)}/ask`, {
      json: { question, review: $('#chat-review').checked }, raw: true });
    for await (const message of ndjson(response)) {
      if (message.type === 'review') {
        log(reviewBox(message));
        status('a cell is waiting for your decision');
      } else if (message.type === 'step') {
        log(stepBox(message));
        status('thinking…');
      } else if (message.type === 'answer') {
        if (message.exception) {
          log(h('pre', { class: 'output-error chat-answer',
            text: `${message.exception.type}: ${message.exception.message}` }));
        } else {
          log(h('div', { class: 'chat-answer', text: message.text }));
          if (message.stopped) log(h('div', { class: 'chat-note', text: `(${message.stopped})` }));
        }
        status('');
      }
    }
  } catch (error) {
    status(`error: ${error.message}`);
  } finally {
    state.asking = false;
    $('#chat-ask').disabled = !state.chat;
  }
}

export function initChat() {
  $('#chat-start').addEventListener('click', () => startChat().catch((error) => status(`error: ${error.message}`)));
  $('#chat-upload').addEventListener('change', (event) => {
    const files = [...event.target.files];
    loadData(files).catch((error) => status(`error: ${error.message}`))
      .finally(() => { event.target.value = ''; });
  });
  $('#chat-form').addEventListener('submit', ask);
}

export async function showChat() {
  const info = await api('GET', '/ui/api/chat');
  $('#chat-start').disabled = !info.available;
  const note = $('#chat-unavailable');
  note.hidden = info.available;
  note.textContent = info.available ? ''
    : 'No model provider is configured on this server. Start it with SANDLOT_CHAT_PROVIDER=openai '
      + '(OpenAI or a compatible server: SANDLOT_CHAT_BASE_URL, OPENAI_API_KEY) or anthropic '
      + '(ANTHROPIC_API_KEY); see docs/ui.md.';
}
