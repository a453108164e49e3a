// The Mesh tab (plugins/mesh_tab): TensorBoard imports this module into the
// tab's iframe and calls render(). Plain DOM + SVG, no build step, no fetches
// beyond this plugin's own routes (runs, mesh, compare; plugin.py).
//
// Query string (this iframe's, or mesh_<name> on TensorBoard's page):
//   run=R  variable=PATH  compare=R2  search=TEXT

const SVG = 'http://www.w3.org/2000/svg';
const SLICE_COLOURS = ['#4e79a7', '#f28e2b', '#59a14f', '#e15759', '#76b7b2', '#edc948',
                       '#b07aa1', '#ff9da7', '#9c755f', '#bab0ac'];

const STYLE = `
body { font: 13px/1.4 Roboto, system-ui, sans-serif; margin: 0; padding: 12px 16px; color: #212121; }
h2 { font-size: 15px; margin: 18px 0 6px; font-weight: 500; }
select, input { font: inherit; padding: 2px 4px; margin-right: 12px; }
.controls { display: flex; flex-wrap: wrap; align-items: center; gap: 4px; }
.summary { color: #555; margin: 6px 0; }
.error { background: #fdecea; border: 1px solid #e57373; padding: 8px 12px; margin: 10px 0; white-space: pre-wrap; }
.columns { display: flex; flex-wrap: wrap; gap: 24px; align-items: flex-start; }
table { border-collapse: collapse; font-size: 12px; }
th, td { border-bottom: 1px solid #e0e0e0; padding: 2px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; font-weight: 500; position: sticky; top: 0; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.variable { cursor: pointer; }
tr.variable:hover { background: #f1f8ff; }
tr.selected { background: #fff3cd !important; }
tr.flagged td { color: #b71c1c; font-weight: 500; }
.scroll { max-height: 420px; overflow: auto; border: 1px solid #e0e0e0; }
.legend span.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; vertical-align: middle; }
svg text { font-family: Roboto, system-ui, sans-serif; }
`;

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === 'onclick' || key === 'oninput' || key === 'onchange') node[key] = value;
    else if (value !== null && value !== undefined) node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) {
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }
  return node;
}

function svg(tag, attributes = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  if (text !== null) node.textContent = text;
  return node;
}

function bytes(n) {
  if (n === null || n === undefined) return '-';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = n, unit = 0;
  while (Math.abs(value) >= 1024 && unit < units.length - 1) { value /= 1024; unit++; }
  return unit === 0 ? `${value} B` : `${value.toFixed(value < 10 ? 2 : 1)} ${units[unit]}`;
}

const specText = (spec) => '(' + spec.join(', ') + ')';
// A variable's layout: where its bytes live and, with FSDP (use_spec set),
// the layout its math gathers it to.
const layoutText = (v) => v.use_spec ?
    `stored ${specText(v.spec)}, gathered at use to ${specText(v.use_spec)} ` +
    `(${bytes(v.bytes_per_device_at_use)}/device)` : specText(v.spec);
const indexText = (index) => index.map(([start, stop]) => `${start}:${stop}`).join(', ');

function parameters() {
  const own = new URLSearchParams(location.search);
  let page = new URLSearchParams();
  try { page = new URLSearchParams(window.top.location.search); } catch (e) { /* other origin */ }
  const get = (name) => own.get(name) || page.get('mesh_' + name) || '';
  return {run: get('run'), variable: get('variable'), compare: get('compare'),
          search: get('search')};
}

async function getJson(route) {
  const response = await fetch(route);
  let body;
  try { body = await response.json(); } catch (e) {
    throw new Error(`${route}: HTTP ${response.status}, not JSON`);
  }
  if (!response.ok || body.error) throw new Error(body.error || `${route}: HTTP ${response.status}`);
  return body;
}

// Grid position of each device: columns are the last mesh axis, rows the
// other axes in order (row-major, as DTensor numbers devices).
function gridOf(mesh, devices) {
  const sizes = mesh.axes.map(([, size]) => size);
  const columns = sizes[sizes.length - 1];
  const place = new Map();
  for (const device of devices) {
    let row = 0;
    for (let a = 0; a < sizes.length - 1; a++) row = row * sizes[a] + device.coords[a];
    place.set(device.id, {row, column: device.coords[sizes.length - 1]});
  }
  const rows = sizes.slice(0, -1).reduce((a, b) => a * b, 1);
  return {rows, columns, place};
}

function heat(fraction) {
  const light = 94 - Math.round(44 * fraction);  // lighter = fewer bytes
  return `hsl(210, 60%, ${light}%)`;
}

function drawGrid(doc, variable) {
  const {mesh, devices} = doc;
  const {rows, columns, place} = gridOf(mesh, devices);
  const cellW = Math.max(44, Math.min(132, Math.floor(880 / columns)));
  const cellH = Math.max(34, Math.min(74, Math.round(cellW * 0.56)));
  const left = 110, top = 46, gap = 4;
  const outlined = Boolean(mesh.stage_axis) || mesh.num_clients > 1;
  const width = left + columns * (cellW + gap) + (outlined ? 70 : 20);
  const height = top + rows * (cellH + gap) + 24;
  const root = svg('svg', {width, height, id: 'mesh-grid', role: 'img',
                           'aria-label': 'device mesh'});
  const axes = mesh.axes;
  const [lastName, lastSize] = axes[axes.length - 1];
  root.append(svg('text', {x: left, y: 14, 'font-size': 12, 'font-weight': 500},
                  `${lastName} (${lastSize}) \u2192`));
  for (let c = 0; c < columns; c++) {
    root.append(svg('text', {x: left + c * (cellW + gap) + cellW / 2, y: top - 8,
                             'font-size': 11, 'text-anchor': 'middle', fill: '#666'},
                    `${lastName} ${c}`));
  }
  const leading = axes.slice(0, -1);
  if (leading.length) {
    root.append(svg('text', {x: 4, y: 30, 'font-size': 12, 'font-weight': 500},
                    leading.map(([n, s]) => `${n} (${s})`).join(' \u00d7 ') + ' \u2193'));
  }
  const rowLabels = new Map();
  for (const device of devices) {
    const {row} = place.get(device.id);
    if (!rowLabels.has(row) && leading.length) {
      rowLabels.set(row, leading.map(([n], a) => `${n} ${device.coords[a]}`).join(' \u00b7 '));
    }
  }
  for (const [row, label] of rowLabels) {
    root.append(svg('text', {x: left - 8, y: top + row * (cellH + gap) + cellH / 2 + 4,
                             'font-size': 11, 'text-anchor': 'end', fill: '#666'}, label));
  }
  const totals = devices.map((d) => d.bytes.parameters + d.bytes.optimizer);
  const low = Math.min(...totals), high = Math.max(...totals);
  const holders = new Map();  // device id -> [slice number, slice]
  if (variable) {
    variable.slices.forEach((piece, k) => piece.devices.forEach((id) => holders.set(id, [k, piece])));
  }
  for (const device of devices) {
    const {row, column} = place.get(device.id);
    const x = left + column * (cellW + gap), y = top + row * (cellH + gap);
    const total = device.bytes.parameters + device.bytes.optimizer;
    const fullest = total === high;  // every device, when they hold the same
    const held = holders.get(device.id);
    let fill = heat(high > low ? (total - low) / (high - low) : 0.5);
    if (variable) fill = held ? SLICE_COLOURS[held[0] % SLICE_COLOURS.length] : '#eeeeee';
    const group = svg('g', {
        'class': 'device', 'data-device': device.id, 'data-client': device.client,
        'data-stage': device.stage === null ? '' : device.stage,
        'data-bytes-parameters': device.bytes.parameters,
        'data-bytes-optimizer': device.bytes.optimizer, 'data-fullest': fullest ? 1 : 0,
        'data-holds': variable ? (held ? 1 : 0) : '',
        'data-slice': held ? indexText(held[1].index) : '',
        'data-slice-number': held ? held[0] : '',
        'data-replicas': held ? held[1].devices.length : ''});
    const title = [`${device.name} (id ${device.id}): ` +
                   mesh.axes.map(([n], a) => `${n}=${device.coords[a]}`).join(', ')];
    if (mesh.num_clients > 1) title.push(`client ${device.client}`);
    if (device.stage !== null) title.push(`stage ${device.stage}`);
    title.push(`parameters ${bytes(device.bytes.parameters)}, ` +
               `optimizer state ${bytes(device.bytes.optimizer)}`);
    if (held) title.push(`holds [${indexText(held[1].index)}] of ${variable.path}` +
                         (held[1].devices.length > 1 ?
                          `, one of ${held[1].devices.length} replicas` : ''));
    group.append(svg('title', {}, title.join('\n')));
    const marked = fullest && high > low;  // a border only when devices differ
    group.append(svg('rect', {x, y, width: cellW, height: cellH, rx: 3, fill,
                              stroke: marked ? '#d84315' : '#9e9e9e',
                              'stroke-width': marked ? 3 : 1}));
    const dark = variable ? Boolean(held) : (high > low && (total - low) / (high - low) > 0.6);
    const ink = dark ? '#ffffff' : '#212121';
    group.append(svg('text', {x: x + 5, y: y + 13, 'font-size': 11, 'font-weight': 500,
                              fill: ink}, device.name + (fullest ? ' \u2605' : '')));
    let line2 = bytes(total), line3 = `params ${bytes(device.bytes.parameters)}`;
    if (variable) {
      line2 = held ? `[${indexText(held[1].index)}]` : '\u2014';
      line3 = held && held[1].devices.length > 1 ? `${held[1].devices.length} replicas` : '';
    }
    if (cellH >= 30) group.append(svg('text', {x: x + 5, y: y + 26, 'font-size': 10, fill: ink},
                                      line2));
    if (cellH >= 44 && line3) group.append(svg('text', {x: x + 5, y: y + 38, 'font-size': 10,
                                                        fill: ink}, line3));
    root.append(group);
  }
  const outline = (ids, label, dashed, key) => {
    const spots = ids.map((id) => place.get(id));
    const r0 = Math.min(...spots.map((s) => s.row)), r1 = Math.max(...spots.map((s) => s.row));
    const c0 = Math.min(...spots.map((s) => s.column));
    const c1 = Math.max(...spots.map((s) => s.column));
    const x = left + c0 * (cellW + gap) - 3, y = top + r0 * (cellH + gap) - 3;
    root.append(svg('rect', {x, y, width: (c1 - c0 + 1) * (cellW + gap) + 2,
                             height: (r1 - r0 + 1) * (cellH + gap) + 2, fill: 'none',
                             stroke: dashed ? '#6a1b9a' : '#37474f', 'stroke-width': 1.5,
                             'stroke-dasharray': dashed ? '5,3' : 'none', 'class': key,
                             'pointer-events': 'none'}));
    root.append(svg('text', {x: x + (c1 - c0 + 1) * (cellW + gap) + 6, y: y + (dashed ? 28 : 14),
                             'font-size': 11, fill: dashed ? '#6a1b9a' : '#37474f'}, label));
  };
  const groups = (key) => {
    const by = new Map();
    for (const d of devices) by.set(d[key], [...(by.get(d[key]) || []), d.id]);
    return by;
  };
  if (mesh.stage_axis) {
    for (const [stage, ids] of groups('stage')) outline(ids, `stage ${stage}`, false, 'stage');
  }
  if (mesh.num_clients > 1) {
    for (const [client, ids] of groups('client')) outline(ids, `client ${client}`, true, 'client');
  }
  return root;
}

function legend(doc, variable) {
  if (!variable) {
    const fullest = doc.devices.find((d) => d.id === doc.fullest_device);
    const total = (d) => d.bytes.parameters + d.bytes.optimizer;
    const ties = doc.devices.filter((d) => total(d) === total(fullest)).length;
    return element('div', {'class': 'legend summary'},
        'Colour: bytes held (parameters + optimizer state), light = fewest. ',
        `\u2605 (red border) fullest device: ${fullest.name}, ` +
        `${bytes(fullest.bytes.parameters)} parameters + ` +
        `${bytes(fullest.bytes.optimizer)} optimizer state` +
        (ties > 1 ? ` (${ties} devices hold as much).` : '.'));
  }
  const total = new Set(variable.slices.flatMap((s) => s.devices)).size;
  return element('div', {'class': 'legend summary', id: 'slice-legend'},
      element('div', {id: 'slice-layout'}, `${variable.path} ${layoutText(variable)}` +
                         (variable.mesh ? ` on sub-mesh ${variable.mesh}` : '') +
                         `: ${variable.slices.length} slice(s) on ${total} of ` +
                         `${doc.devices.length} devices; grey devices hold none of it.`),
      variable.slices.map((piece, k) => element('div', {'data-slice-row': k},
          element('span', {'class': 'swatch',
                           style: `background:${SLICE_COLOURS[k % SLICE_COLOURS.length]}`}),
          `[${indexText(piece.index)}] on ` +
          piece.devices.map((id) => doc.devices[id] ? doc.devices[id].name : id).join(', ') +
          (piece.devices.length > 1 ? ` (${piece.devices.length} replicas)` : ''))));
}

function rulesTable(doc) {
  const rows = doc.rules.map((rule) => element('tr', {
      'class': rule.unused ? 'flagged' : '', 'data-rule': rule.index,
      'data-matched': rule.matched, 'data-unused': rule.unused ? 1 : 0,
      'data-shadowed': rule.shadowed ? 1 : 0},
    element('td', {'class': 'num'}, rule.index), element('td', {}, element('code', {}, rule.pattern)),
    element('td', {}, specText(rule.spec)), element('td', {'class': 'num'}, rule.matched),
    element('td', {}, rule.unused ? rule.note : '')));
  rows.push(element('tr', {'data-rule': 'default'}, element('td', {}, ''),
                    element('td', {}, 'no rule matched'), element('td', {}, 'replicated'),
                    element('td', {'class': 'num'}, doc.replicated_by_default),
                    element('td', {}, '')));
  return element('table', {id: 'rules'},
      element('tr', {}, ['#', 'pattern (first match wins)', 'spec', 'variables', ''].map(
          (h) => element('th', {}, h))), rows);
}

function variablesTable(doc, state, select) {
  // 'sharding' and 'bytes/device': where the bytes live; with FSDP also the
  // layout each split variable is gathered to at use (as layouts.txt has it).
  const withUse = doc.variables.some((v) => v.use_spec);
  const header = element('tr', {},
      ['path', 'shape', 'dtype', 'sharding', ...(withUse ? ['sharding at use'] : []), 'mesh',
       'rule', 'bytes/device', 'optimizer/device'].map(
          (h) => element('th', {'class': h.includes('/') ? 'num' : ''}, h)));
  const rows = doc.variables.map((v) => element('tr', {
      'class': 'variable' + (v.path === state.variable ? ' selected' : ''),
      'data-path': v.path, onclick: () => select(v.path)},
    element('td', {}, v.path), element('td', {}, v.shape.join('x') || 'scalar'),
    element('td', {}, v.dtype), element('td', {'class': 'spec'}, v.spec.join(', ') || '-'),
    withUse ? element('td', {'class': 'use-spec'}, v.use_spec ? v.use_spec.join(', ') : '-')
            : null,
    element('td', {}, v.mesh || '-'), element('td', {}, v.source),
    element('td', {'class': 'num'}, bytes(v.bytes_per_device)),
    element('td', {'class': 'num'},
            bytes(v.optimizer_state.reduce((sum, s) => sum + s.bytes_per_device, 0)))));
  const table = element('table', {id: 'variables'}, header, rows);
  const filter = (text) => {
    let pattern = null;
    try { pattern = new RegExp(text, 'i'); } catch (e) { pattern = null; }
    let shown = 0;
    for (const row of rows) {
      const path = row.getAttribute('data-path');
      const match = !text || (pattern ? pattern.test(path) : path.includes(text));
      row.style.display = match ? '' : 'none';
      shown += match;
    }
    count.textContent = `${shown} of ${rows.length} variables`;
  };
  const count = element('span', {'class': 'summary', id: 'variable-count'});
  const search = element('input', {type: 'search', id: 'search', placeholder: 'search paths (regex)',
                                   value: state.search, size: 40,
                                   oninput: (e) => { state.search = e.target.value; filter(e.target.value); }});
  filter(state.search);
  return element('div', {}, element('div', {'class': 'controls'}, search, count),
                 element('div', {'class': 'scroll'}, table));
}

function compareView(result, a, b) {
  const changed = result.variables.filter((v) => v.changed);
  const layout = (x) => x ? `${specText(x.spec)}${x.mesh ? ' @' + x.mesh : ''}, ` +
                            `${bytes(x.bytes_per_device)}/device` : '-';
  const variables = element('table', {id: 'compare-variables'},
      element('tr', {}, ['variable', 'A', 'B', 'what changed'].map((h) => element('th', {}, h))),
      changed.map((v) => element('tr', {'data-path': v.path},
          element('td', {}, v.path), element('td', {}, layout(v.a)), element('td', {}, layout(v.b)),
          element('td', {}, v.changes.join('; ')))));
  const cell = (x, key) => element('td', {'class': 'num'}, x ? bytes(x[key]) : '-');
  const devices = element('table', {id: 'compare-devices'},
      element('tr', {}, ['device', 'A parameters', 'A optimizer', 'B parameters', 'B optimizer',
                         'B \u2212 A'].map((h) => element('th', {'class': 'num'}, h))),
      result.devices.map((d) => element('tr', {'data-device': d.id},
          element('td', {'class': 'num'}, d.id + (d.id === result.fullest_device.a ? ' \u2605A' : '') +
                                          (d.id === result.fullest_device.b ? ' \u2605B' : '')),
          cell(d.a, 'parameters'), cell(d.a, 'optimizer'), cell(d.b, 'parameters'),
          cell(d.b, 'optimizer'),
          element('td', {'class': 'num'}, d.a && d.b ?
              bytes(d.b.parameters + d.b.optimizer - d.a.parameters - d.a.optimizer) : '-'))));
  return element('div', {id: 'compare'},
      element('h2', {}, `Compared: A = ${a} (${result.mesh.a}), B = ${b} (${result.mesh.b})`),
      element('div', {'class': 'summary', id: 'compare-summary'},
              `${result.num_changed} of ${result.variables.length} variables changed layout`),
      element('div', {'class': 'columns'},
              element('div', {'class': 'scroll'}, variables),
              element('div', {'class': 'scroll'}, devices)));
}

async function showRun(view, runs, state) {
  view.replaceChildren();
  document.body.setAttribute('data-state', 'loading');
  const entry = runs.find((r) => r.run === state.run);
  if (!entry || !entry.mesh) {
    view.append(element('div', {'class': 'error', id: 'error'},
                        entry ? entry.problem : `no run '${state.run}' in this logdir`));
    document.body.setAttribute('data-state', 'error');
    return;
  }
  const doc = await getJson(`mesh?run=${encodeURIComponent(state.run)}`);
  const variable = doc.variables.find((v) => v.path === state.variable) || null;
  const mesh = doc.mesh;
  const select = (path) => {
    state.variable = state.variable === path ? '' : path;
    remember(state);
    showRun(view, runs, state);
  };
  view.append(
      element('div', {'class': 'summary', id: 'mesh-summary'},
              `${mesh.axes.map(([n, s]) => `${n} ${s}`).join(' \u00d7 ')} = ` +
              `${mesh.num_devices} ${mesh.device_type} devices` +
              (mesh.num_clients > 1 ? `, ${mesh.num_clients} clients` : '') +
              (mesh.stage_axis ? `, pipeline stages on '${mesh.stage_axis}'` : '') +
              `; ${doc.variables.length} variables; optimizer ${doc.optimizer}`),
      element('div', {'class': 'columns'},
              element('div', {}, drawGrid(doc, variable), legend(doc, variable)),
              element('div', {}, element('h2', {}, 'Layout rules'), rulesTable(doc))),
      element('h2', {}, 'Variables' + (variable ? ` (selected: ${variable.path})` : '')),
      variablesTable(doc, state, select));
  if (state.compare) {
    try {
      const result = await getJson(`compare?a=${encodeURIComponent(state.run)}` +
                                   `&b=${encodeURIComponent(state.compare)}`);
      view.append(compareView(result, state.run, state.compare));
    } catch (e) {
      view.append(element('div', {'class': 'error', id: 'compare-error'}, e.message));
    }
  }
  document.body.setAttribute('data-state', 'ready');
}

function remember(state) {
  const query = new URLSearchParams(location.search);
  for (const key of ['run', 'variable', 'compare', 'search']) {
    if (state[key]) query.set(key, state[key]); else query.delete(key);
  }
  history.replaceState(null, '', '?' + query.toString());
}

export async function render() {
  document.head.append(element('style', {}, STYLE));
  const state = parameters();
  const header = element('div', {'class': 'controls'});
  const view = element('div', {id: 'view'});
  document.body.append(header, view);
  let listing;
  try {
    listing = await getJson('runs');
  } catch (e) {
    view.append(element('div', {'class': 'error', id: 'error'}, e.message));
    document.body.setAttribute('data-state', 'error');
    return;
  }
  const runs = listing.runs;
  if (!runs.length) {
    view.append(element('div', {'class': 'error', id: 'error'},
                        `no meshgin runs under ${listing.logdir}`));
    document.body.setAttribute('data-state', 'error');
    return;
  }
  if (!state.run) state.run = (runs.find((r) => r.mesh) || runs[0]).run;
  const choose = (key) => (e) => { state[key] = e.target.value; remember(state); refresh(); };
  const options = (chosen, blank) => [
      ...(blank ? [element('option', {value: ''}, blank)] : []),
      ...runs.map((r) => element('option', {value: r.run, selected: r.run === chosen ? '' : null},
                                 r.run + (r.mesh ? '' : ' (no mesh.json)')))];
  header.append(element('label', {}, 'Run '),
                element('select', {id: 'run', onchange: choose('run')}, options(state.run)),
                element('label', {}, 'compare with '),
                element('select', {id: 'compare-run', onchange: choose('compare')},
                        options(state.compare, '(none)')));
  const refresh = () => showRun(view, runs, state).catch((e) => {
    view.append(element('div', {'class': 'error', id: 'error'}, e.message));
    document.body.setAttribute('data-state', 'error');
  });
  await refresh();
}
