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
