// Small SVG charts drawn from numbers (never from markup): sparklines and bars.

const SVG = 'http://www.w3.org/2000/svg';

function svg(tag, attrs = {}) {
  const el = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) el.setAttribute(name, String(value));
  return el;
}

/** A line of the last values (oldest first), scaled to its own maximum. */
export function sparkline(values, { width = 220, height = 48 } = {}) {
  const root = svg('svg', { width, height, viewBox: `0 0 ${width} ${height}`, class: 'sparkline' });
  root.append(svg('rect', { x: 0, y: 0, width, height, class: 'chart-bg' }));
  if (values.length === 0) return root;
  if (values.length === 1) values = [values[0], values[0]]; // one sample: a flat line
  const top = Math.max(1, ...values);
  const step = values.length > 1 ? width / (values.length - 1) : 0;
  const points = values.map((v, i) => `${(i * step).toFixed(1)},${(height - 2 - (v / top) * (height - 6)).toFixed(1)}`);
  root.append(svg('polyline', { points: points.join(' '), class: 'chart-line' }));
  return root;
}

/** Horizontal bars for [label, value] pairs. */
export function bars(entries, { width = 260, row = 18 } = {}) {
  const label = 70;
  const height = Math.max(row, entries.length * row);
  const root = svg('svg', { width, height, viewBox: `0 0 ${width} ${height}`, class: 'bars' });
  const top = Math.max(1, ...entries.map(([, v]) => v));
  entries.forEach(([name, value], i) => {
    const y = i * row;
    const text = svg('text', { x: 0, y: y + row - 5, class: 'chart-label' });
    text.textContent = name;
    const bar = svg('rect', { x: label, y: y + 3, height: row - 6,
      width: Math.max(1, ((width - label - 40) * value) / top), class: 'chart-bar' });
    const count = svg('text', { x: label + 4 + ((width - label - 40) * value) / top, y: y + row - 5, class: 'chart-label' });
    count.textContent = String(Math.round(value));
    root.append(text, bar, count);
  });
  return root;
}
