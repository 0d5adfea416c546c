// The app's entry: sign-in, sign-out and which page shows.

import { api, onSignedOut, setCsrf } from './api.js';
import { $ } from './dom.js';
import { initChat, showChat } from './chat.js';
import { hideConsole, initConsole, showConsole } from './console.js';
import { initNotebook, showNotebook } from './notebook.js';

const PAGES = ['signin', 'notebook', 'chat', 'console'];
let signedIn = false;

function showPage(name) {
  for (const page of PAGES) $(`#page-${page}`).hidden = page !== name;
  for (const link of document.querySelectorAll('#nav a')) {
    link.classList.toggle('active', link.getAttribute('href') === `#/${name}`);
  }
  document.body.dataset.page = name;
}

async function route() {
  if (!signedIn) {
    showPage('signin');
    $('#signin-key').focus();
    return;
  }
  const name = { '#/console': 'console', '#/chat': 'chat' }[location.hash] || 'notebook';
  showPage(name);
  if (name === 'console') {
    showConsole();
  } else if (name === 'chat') {
    hideConsole();
    await showChat().catch((error) => { $('#chat-status').textContent = `error: ${error.message}`; });
  } else {
    hideConsole();
    await showNotebook().catch((error) => { $('#nb-status').textContent = `error: ${error.message}`; });
  }
}

function enter(session) {
  setCsrf(session.csrf);
  signedIn = true;
  $('#whoami').textContent = `tenant ${session.tenant} · key ${session.key_id}`;
  $('#nav').hidden = false;
  $('#sign-out').hidden = false;
  route();
}

function leave() {
  setCsrf(null);
  signedIn = false;
  hideConsole();
  $('#whoami').textContent = '';
  $('#nav').hidden = true;
  $('#sign-out').hidden = true;
  route();
}

async function signIn(event) {
  event.preventDefault();
  const input = $('#signin-key');
  const key = input.value.trim();
  // The key leaves the page with this one request and is not kept in it.
  input.value = '';
  $('#signin-error').textContent = '';
  try {
    enter(await api('POST', '/ui/api/session', { json: { api_key: key } }));
  } catch (error) {
    $('#signin-error').textContent = error.message;
  }
}

async function signOut() {
  try {
    await api('DELETE', '/ui/api/session');
  } finally {
    leave();
  }
}

async function main() {
  initNotebook();
  initConsole();
  initChat();
  $('#signin-form').addEventListener('submit', signIn);
  $('#sign-out').addEventListener('click', signOut);
  window.addEventListener('hashchange', route);
  onSignedOut(() => { if (signedIn) leave(); });
  try {
    enter(await api('GET', '/ui/api/session'));
  } catch {
    leave();
  }
  document.body.dataset.ready = 'true';
}

main();
