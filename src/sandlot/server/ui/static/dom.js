// DOM helpers. Text only ever goes in through textContent or attributes: nothing
// here parses a string as HTML (the page's Trusted Types policy would refuse it).

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith('on') && typeof value === 'function') {
      el.addEventListener(name.slice(2), value);
    } else if (name === 'class') {
      el.className = value;
    } else if (name === 'text') {
      el.textContent = value;
    } else {
      el.setAttribute(name, value === true ? '' : String(value));
    }
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

export const $ = (selector, root = document) => root.querySelector(selector);

export function clear(el) {
  while (el.firstChild) el.firstChild.remove();
}

export function showError(el, error) {
  el.textContent = error ? String(error.message || error) : '';
}

export function seconds(value) {
  if (value === null || value === undefined) return '–';
  if (value < 1) return `${(value * 1000).toFixed(0)} ms`;
  if (value < 120) return `${value.toFixed(1)} s`;
  if (value < 7200) return `${(value / 60).toFixed(1)} min`;
  return `${(value / 3600).toFixed(1)} h`;
}

export function bytes(value) {
  if (value === null || value === undefined) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let n = value;
  let unit = 0;
  while (n >= 1024 && unit < units.length - 1) {
    n /= 1024;
    unit += 1;
  }
  return `${unit === 0 ? n : n.toFixed(1)} ${units[unit]}`;
}

// Characters that change how text looks without showing themselves: controls (but tab,
// line feed and carriage return), bidirectional overrides, embeddings, isolates and
// marks, zero-width spaces and joiners, the byte-order mark. In code or a file name they
// can make what is shown differ from what is there ("Trojan Source": a right-to-left
// override reorders a line; `invoice\u202Efdp.exe` shows as invoiceexe.pdf).
const HIDDEN = /[\u0000-\u0008\u000b\u000c\u000e-\u001f\u007f-\u009f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]/g;

/** `text` with every hidden character shown as ⟨U+XXXX⟩. */
export function revealed(text) {
  return String(text).replace(HIDDEN,
    (c) => `⟨U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, '0')}⟩`);
}

/** Whether `text` holds a character that `revealed` would show. */
export function hasHidden(text) {
  HIDDEN.lastIndex = 0;
  const found = HIDDEN.test(String(text));
  HIDDEN.lastIndex = 0;
  return found;
}
