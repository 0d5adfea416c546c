// Rendering what a sandbox sends back. Everything here is untrusted: text goes in
// as text; HTML and SVG only into an <iframe sandbox> (no scripts, an opaque origin,
// no forms, no popups, no navigation of this page); images only as data: URLs of
// checked base64.

import { h } from './dom.js';

// The only Trusted Types policy this page's CSP allows: it makes the srcdoc of a
// sandboxed frame, and nothing else. Browsers without Trusted Types get the string.
const framePolicy = window.trustedTypes
  ? window.trustedTypes.createPolicy('sandlot-frame', { createHTML: (html) => html })
  : null;

// Tested after whitespace is removed: no two parts of the pattern can match the same
// character, so the check is linear (a pattern with \s in two places backtracked
// quadratically: a sandbox's megabyte of spaces froze the tab for minutes).
const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;

export function sandboxedFrame(content, title = 'sandbox output') {
  const frame = document.createElement('iframe');
  // Set before the content: the frame must never load it unsandboxed.
  frame.setAttribute('sandbox', '');
  frame.setAttribute('referrerpolicy', 'no-referrer');
  frame.setAttribute('title', title);
  frame.className = 'output-frame';
  const doc = '<!doctype html><html><head><meta charset="utf-8">'
    + '<link rel="stylesheet" href="/ui/static/frame.css"></head><body>'
    + content + '</body></html>';
  frame.srcdoc = framePolicy ? framePolicy.createHTML(doc) : doc;
  return frame;
}

function image(kind, data) {
  const clean = typeof data === 'string' ? data.replace(/\s+/g, '') : null;
  if (clean === null || !BASE64.test(clean)) {
    return h('pre', { class: 'output-error', text: `(${kind} image that is not base64)` });
  }
  const img = document.createElement('img');
  img.className = 'output-image';
  img.alt = `${kind} result`;
  img.src = `data:image/${kind};base64,${clean}`;
  return img;
}

/** One rich result (a `result` message) as an element. */
export function renderResult(message) {
  const box = h('div', { class: 'result' + (message.is_main_result ? ' main' : '') });
  if (message.png) box.append(image('png', message.png));
  else if (message.jpeg) box.append(image('jpeg', message.jpeg));
  else if (message.svg) box.append(sandboxedFrame(message.svg, 'SVG result'));
  else if (message.html) box.append(sandboxedFrame(message.html, 'HTML result'));
  else if (message.markdown) box.append(h('pre', { class: 'output-text', text: message.markdown }));
  else if (message.latex) box.append(h('pre', { class: 'output-text', text: message.latex }));
  else if (message.json !== undefined) {
    box.append(h('pre', { class: 'output-text', text: JSON.stringify(message.json, null, 2) }));
  } else if (message.text !== undefined) {
    box.append(h('pre', { class: 'output-text', text: message.text }));
  } else {
    box.append(h('pre', { class: 'muted', text: '(a result with no format this page shows)' }));
  }
  return box;
}

/** The pre-check report of a cell (advice, never a verdict). */
export function renderPrecheck(report) {
  if (!report) return null;
  const findings = report.findings || [];
  const summary = !report.syntax_ok
    ? 'pre-check: syntax error'
    : findings.length === 0
      ? 'pre-check: nothing found'
      : `pre-check: ${findings.length} finding(s)${report.flagged ? ', flagged' : ''}`;
  const details = h('details', { class: 'precheck' + (report.flagged ? ' flagged' : '') },
    h('summary', { text: summary }));
  if (findings.length) {
    details.append(h('ul', {}, findings.map((f) =>
      h('li', { class: `severity-${f.severity}` },
        h('code', { text: `${f.line}:${f.col} ${f.rule}` }), ` ${f.severity}: ${f.message}`))));
  }
  return details;
}
