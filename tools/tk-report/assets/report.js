// The report's page: charts (uPlot) and tables from the runs' data, which tk-report embeds as JSON.
// Everything is drawn from that data in the browser; nothing is fetched.
(function () {
  'use strict';

  const data = JSON.parse(document.getElementById('tk-data').textContent);
  const runs = data.runs;
  const palette = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd', '#8c564b', '#e377c2', '#17becf',
    '#7f7f7f', '#bcbd22'];
  const state = { x: 'step', smoothing: 0.6, logLoss: false, hidden: new Set() };
  let plots = [];     // the uPlot instances on the page
  let rendered = [];  // what each chart was given: {id, title, series: [{run, label, key, points}]}

  // ---- helpers ------------------------------------------------------------------------------
  const el = (tag, attrs, ...children) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === 'class') e.className = v;
      else if (k === 'text') e.textContent = v;
      else e.setAttribute(k, v);
    }
    for (const c of children) if (c != null) e.append(c);
    return e;
  };
  const isNum = (v) => typeof v === 'number' && isFinite(v);
  const col = (run, key) => (run.steps && run.steps[key]) || null;
  const vcol = (run, key) => (run.validation && run.validation[key]) || null;
  const has = (run, key) => { const c = col(run, key); return !!c && c.some(isNum); };
  const hasV = (run, key) => { const c = vcol(run, key); return !!c && c.some(isNum); };
  const stepCount = (run) => (col(run, 'step') || []).length;

  function fmt(v, digits) {
    if (!isNum(v)) return '—';
    const a = Math.abs(v);
    if (a !== 0 && (a >= 1e6 || a < 1e-3)) return v.toExponential(2);
    return v.toLocaleString('en-US', { maximumFractionDigits: digits == null ? 4 : digits });
  }
  function fmtTime(s) {
    if (!isNum(s)) return '—';
    if (s < 60) return s.toFixed(1) + ' s';
    const m = Math.floor(s / 60), h = Math.floor(m / 60);
    return h > 0 ? h + ' h ' + (m % 60) + ' min' : m + ' min ' + Math.round(s % 60) + ' s';
  }
  // an axis label: three significant digits, no float noise
  const tick = (v) => (v === 0 ? '0' : Math.abs(v) >= 1e5 || Math.abs(v) < 1e-4 ? v.toExponential(1) : String(Number(v.toPrecision(3))));
  const pct = (v) => (isNum(v) ? (100 * v).toFixed(2) + '%' : '—');
  const last = (a) => { if (!a) return null; for (let i = a.length - 1; i >= 0; --i) if (isNum(a[i])) return a[i]; return null; };
  function best(values, steps, better) {
    let b = null, at = null;
    (values || []).forEach((v, i) => { if (isNum(v) && (b === null || better(v, b))) { b = v; at = steps[i]; } });
    return b === null ? null : { value: b, step: at };
  }
  // the most frequent value (a run's usual k, say, not its epoch-end remainder)
  function mode(a) {
    const n = new Map();
    let bestV = null, bestN = 0;
    for (const v of a || []) if (isNum(v)) { const c = (n.get(v) || 0) + 1; n.set(v, c); if (c > bestN) { bestN = c; bestV = v; } }
    return bestV;
  }
  function median(a) {
    const s = a.filter(isNum).sort((x, y) => x - y);
    return s.length ? s[Math.floor(s.length / 2)] : null;
  }

  // ---- per-run derived series ----------------------------------------------------------------
  // x values of the step records: the step, the examples seen (all ranks), or the training time,
  // continued across resumes (each process's wall_time starts again at 0).
  function derive(run, i) {
    run.color = palette[i % palette.length];
    const steps = col(run, 'step') || [];
    const eb = col(run, 'effective_batch'), wall = col(run, 'wall_time');
    const examples = [], time = [];
    let seen = 0, offset = 0, prev = null;
    steps.forEach((s, j) => {
      seen += eb && isNum(eb[j]) ? eb[j] : 0;
      examples.push(eb ? seen : null);
      const w = wall ? wall[j] : null;
      if (isNum(w)) {
        if (prev !== null && w < prev) offset += prev;  // a resumed process: its clock starts again
        prev = w;
        time.push(offset + w);
      } else {
        time.push(null);
      }
    });
    run.x = { step: steps, examples, time };
    run.index = new Map(steps.map((s, j) => [s, j]));
    run.duration = time.length ? last(time) : null;
    run.examplesSeen = eb ? seen : null;
    run.throughput = rate(run, 'effective_batch', false);
    run.tokenRate = rate(run, 'tokens', true);
    const skippedEvents = (run.events || []).filter((e) => e.key === 'skipped').map((e) => e.step);
    run.skippedCount = skippedEvents.length;
    const skipSet = new Set(skippedEvents);
    let k = 0;
    run.skippedCumulative = steps.map((s) => (skipSet.has(s) ? ++k : k));
  }

  // Examples (or tokens) per second over the last few steps, from the records' wall_time: each
  // step's count over the time since the record ten steps before (the same process's clock).
  function rate(run, key, cumulative) {
    const c = col(run, key), wall = col(run, 'wall_time'), eb = col(run, 'effective_batch'), smp = col(run, 'samples');
    if (!c || !wall) return null;
    const out = [];
    for (let j = 0; j < c.length; ++j) {
      let v = null;
      const from = Math.max(0, j - 10);
      if (j > from && isNum(wall[j]) && isNum(wall[from]) && wall[j] > wall[from]) {
        let amount = 0, ok = true;
        for (let q = from + 1; q <= j; ++q) if (isNum(wall[q]) && wall[q] < wall[q - 1]) ok = false;  // a resume between
        if (cumulative) {
          // tokens and samples count the world's (records before that counted one rank's: the
          // effective batch over the samples scales those to the world, and is 1 now)
          const ds = isNum(smp && smp[j]) && isNum(smp && smp[from]) ? smp[j] - smp[from] : 0;
          let ebs = 0;
          for (let q = from + 1; q <= j; ++q) ebs += isNum(eb && eb[q]) ? eb[q] : 0;
          amount = isNum(c[j]) && isNum(c[from]) && ds > 0 ? (c[j] - c[from]) * (ebs / ds) : NaN;
        } else {
          for (let q = from + 1; q <= j; ++q) amount += isNum(c[q]) ? c[q] : 0;
        }
        if (ok && isNum(amount)) v = amount / (wall[j] - wall[from]);
      }
      out.push(v);
    }
    return out;
  }

  // Exponential moving average with the start debiased, as TensorBoard smooths scalars.
  function smooth(values, weight) {
    let acc = 0, n = 0;
    return values.map((v) => {
      if (!isNum(v)) return null;
      acc = acc * weight + (1 - weight) * v;
      ++n;
      return weight === 0 ? v : acc / (1 - Math.pow(weight, n));
    });
  }

  // ---- charts ---------------------------------------------------------------------------------
  // A series: one run's values of one key, at its step records (or its validation records).
  function stepSeries(run, values, label, opts) {
    const xs = run.x[state.x];
    const pts = [];
    (values || []).forEach((v, j) => { if (isNum(v) && isNum(xs[j])) pts.push([xs[j], v]); });
    return Object.assign({ run, label, points: pts }, opts || {});
  }
  function validationSeries(run, key, label) {
    const steps = vcol(run, 'step') || [], values = vcol(run, key) || [];
    const pts = [];
    values.forEach((v, j) => {
      if (!isNum(v)) return;
      const x = state.x === 'step' ? steps[j] : run.x[state.x][run.index.get(steps[j])];
      if (isNum(x)) pts.push([x, v]);
    });
    return { run, label, points: pts, points_shown: true };
  }

  const known = new Set(['step', 'epoch', 'loss', 'lr', 'micro_batches', 'effective_batch', 'samples', 'tokens',
    'wall_time', 'peak_rss_mib', 'grad_norm', 'loss_scale', 'amp_skipped_steps', 'micro_batch', 'step_peak_mib',
    'memory_budget_mib', 'data_ms', 'forward_ms', 'backward_ms', 'boundary_ms', 'optimizer_ms', 'validation_ms',
    'examples_per_s', 'tokens_per_s', 'model_gflop', 'gflops', 'mfu']);
  const phases = ['data', 'forward', 'backward', 'boundary', 'optimizer'];
  // Each phase its colour; with several runs, each run its line style (its index in the report).
  const phaseColor = { data: '#8c564b', forward: '#1f77b4', backward: '#d62728', boundary: '#9467bd', optimizer: '#2ca02c' };
  const runDash = [undefined, [6, 3], [2, 3], [8, 2, 2, 2]];

  // Each chart: what it shows and, per visible run, its series.
  function chartSpecs(visible) {
    const simple = (key, title, hint, extra) => ({
      id: key, title, hint, ...(extra || {}),
      series: (r) => (has(r, key) ? [stepSeries(r, col(r, key), r.name)] : []),
    });
    const valid = (key, title, hint, extra) => ({
      id: key, title, hint, ...(extra || {}),
      series: (r) => (hasV(r, key) ? [validationSeries(r, key, r.name)] : []),
    });
    const specs = [
      {
        id: 'loss', title: 'Training loss', log: state.logLoss,
        hint: 'the loss of each optimizer step\'s whole window (faint) and its moving average (smoothing ' +
          state.smoothing.toFixed(2) + ')',
        series: (r) => (has(r, 'loss') ? [
          stepSeries(r, col(r, 'loss'), r.name + ' (raw)', { faint: true }),
          stepSeries(r, smooth(col(r, 'loss'), state.smoothing), r.name + ' (smoothed)', { key: 'loss_smoothed' }),
        ] : []),
      },
      valid('validation_loss', 'Validation loss', 'the mean loss over the validation set', { log: state.logLoss }),
      valid('validation_accuracy', 'Validation accuracy', 'the share of validation examples classified right',
        { percent: true }),
      valid('validation_perplexity', 'Validation perplexity', 'exp(validation loss) of a language model',
        { log: state.logLoss }),
      simple('lr', 'Learning rate', 'the rate of each optimizer step, as the schedule set it'),
      simple('effective_batch', 'Effective batch', 'the examples each optimizer step took, over all ranks'),
      simple('micro_batches', 'Micro-batches per step', 'how many micro-batches made each step, over all ranks (k x world)'),
      simple('micro_batch', 'Micro-batch size', 'the examples in each micro-batch (m), where memory chose it'),
      simple('grad_norm', 'Gradient norm', 'the total norm of the gradients before clipping'),
      simple('loss_scale', 'Loss scale', 'the mixed-precision loss scale each step used', { log: true }),
      {
        id: 'skipped', title: 'Skipped steps', hint: 'optimizer steps vetoed so far (an inf or NaN gradient, say)',
        series: (r) => {
          if (r.skippedCount > 0) return [stepSeries(r, r.skippedCumulative, r.name)];
          return has(r, 'amp_skipped_steps') ? [stepSeries(r, col(r, 'amp_skipped_steps'), r.name)] : [];
        },
      },
      {
        id: 'throughput', title: 'Throughput (examples/s)', hint: 'examples per second over the last ten steps, all ranks',
        series: (r) => (r.throughput && r.throughput.some(isNum) ? [stepSeries(r, r.throughput, r.name)] : []),
      },
      {
        id: 'tokens_per_second', title: 'Throughput (tokens/s)', hint: 'tokens per second over the last ten steps, all ranks',
        series: (r) => {
          const t = col(r, 'tokens'), s = col(r, 'samples');
          const differ = t && s && t.some((v, j) => isNum(v) && v !== s[j]);
          return differ && r.tokenRate ? [stepSeries(r, r.tokenRate, r.name)] : [];
        },
      },
      simple('gflops', 'Model FLOP rate (GFLOP/s)',
        'the model\'s counted training FLOPs of each step over the step\'s time, this rank'),
      simple('mfu', 'Model FLOPs utilization', 'the FLOP rate over run.peak_gflops or the measured peak, this rank', { percent: true }),
      {
        id: 'phases', title: 'Time per step by phase (ms)',
        hint: 'where each step\'s time went (run.phase_times): reading data, forward with the loss, backward, the ' +
          'plugins\' boundary work (unscaling, clipping, a data-parallel wait), the optimizer',
        series: (r) => phases.filter((p) => has(r, p + '_ms')).map((p) => stepSeries(r, col(r, p + '_ms'),
          r.name + ' (' + p + ')', { color: phaseColor[p], dash: runDash[visible.indexOf(r) % runDash.length] })),
      },
      {
        id: 'memory', title: 'Peak memory (MiB)',
        hint: 'the process\'s peak resident memory; with a memory-chosen micro-batch, also the step\'s tensor peak and the budget',
        series: (r) => {
          const out = [];
          if (has(r, 'peak_rss_mib')) out.push(stepSeries(r, col(r, 'peak_rss_mib'), r.name + ' (process)'));
          if (has(r, 'step_peak_mib')) out.push(stepSeries(r, col(r, 'step_peak_mib'), r.name + ' (step tensors)', { dash: [6, 3] }));
          if (has(r, 'memory_budget_mib')) out.push(stepSeries(r, col(r, 'memory_budget_mib'), r.name + ' (budget)', { dash: [2, 3] }));
          return out;
        },
      },
    ];
    const others = [];
    for (const r of visible) for (const k of Object.keys(r.steps || {})) if (!known.has(k) && !others.includes(k)) others.push(k);
    const more = others.map((k) => simple(k, k, 'a metric a plugin logged'));
    return { main: specs, more };
  }

  function buildChart(container, spec, visible) {
    const series = [];
    for (const r of visible) for (const s of spec.series(r)) series.push(s);
    if (!series.some((s) => s.points.length > 0)) return false;
    const tables = series.map((s) => {
      // uPlot.join wants increasing, distinct x: keep each x's last value
      const byX = new Map();
      for (const [x, y] of s.points) byX.set(x, y);
      const xs = [...byX.keys()].sort((a, b) => a - b);
      return [xs, xs.map((x) => byX.get(x))];
    });
    const aligned = uPlot.join(tables);
    const logOk = spec.log && series.every((s) => s.points.every(([, y]) => y > 0));
    const card = el('div', { class: 'card', 'data-chart': spec.id },
      el('h3', { text: spec.title }), el('p', { class: 'hint', text: spec.hint || '' }));
    container.append(card);
    const width = Math.max(320, card.clientWidth - 24);
    const xLabel = { step: 'optimizer step', examples: 'examples seen', time: 'training time (s)' }[state.x];
    const opts = {
      width, height: 260,
      scales: { x: { time: false }, y: logOk ? { distr: 3 } : {} },
      axes: [
        { label: xLabel },
        { values: (u, ticks) => ticks.map(spec.percent ? (v) => (100 * v).toFixed(1) + '%' : tick), size: 70 },
      ],
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      series: [{ label: xLabel }].concat(series.map((s) => ({
        label: s.label,
        stroke: s.color || (s.faint ? s.run.color + '4d' : s.run.color),
        width: s.faint ? 1 : 2,
        dash: s.dash,
        spanGaps: true,
        points: { show: !!s.points_shown },
        value: spec.percent ? (u, v) => pct(v) : (u, v) => fmt(v),
      }))),
    };
    plots.push(new uPlot(opts, aligned, card));
    rendered.push({
      id: spec.id, title: spec.title,
      series: series.map((s, i) => ({
        run: s.run.name, label: s.label, key: s.key || spec.id,
        points: aligned[i + 1].filter((v) => v != null).length,
      })),
    });
    return true;
  }

  function drawCharts() {
    for (const p of plots) p.destroy();
    plots = [];
    rendered = [];
    const visible = runs.filter((r, i) => !state.hidden.has(i));
    const main = document.getElementById('charts'), more = document.getElementById('more');
    main.replaceChildren();
    more.replaceChildren();
    const specs = chartSpecs(visible);
    let drawn = 0;
    for (const s of specs.main) if (buildChart(main, s, visible)) ++drawn;
    // shown before drawing: a chart takes its width from its place on the page
    const moreSection = document.getElementById('more-section');
    moreSection.hidden = false;
    let drawnMore = 0;
    for (const s of specs.more) if (buildChart(more, s, visible)) ++drawnMore;
    moreSection.hidden = drawnMore === 0;
    if (drawn === 0)
      main.append(el('p', { class: 'empty', text: visible.length === 0 ? 'Every run is hidden: tick one above.'
        : 'No step has been recorded in ' + (visible.length === 1 ? 'this run' : 'these runs') + ' yet.' }));
    selfcheck();
  }

  // ---- tables ---------------------------------------------------------------------------------
  function statusBadge(run) {
    const s = run.status || {};
    const name = s.status || 'unknown';
    const label = { signal: 'stopped (signal)', max_time: 'stopped (max_time)' }[name] || name;
    const b = el('span', { class: 'status status-' + name, text: label });
    if (s.detail) b.title = s.detail;
    return b;
  }

  function summaryTable() {
    const head = ['run', 'status', 'steps', 'micro-batches × m (usual)', 'time', 'examples', 'train loss (last / smoothed)',
      'validation loss (last / best)', 'validation accuracy (last / best)', 'perplexity (best)', 'peak memory',
      'throughput', 'skipped steps'];
    const table = el('table', {}, el('tr', {}, ...head.map((h) => el('th', { text: h }))));
    runs.forEach((r) => {
      const steps = col(r, 'step') || [];
      const vsteps = vcol(r, 'step') || [];
      const vl = vcol(r, 'validation_loss'), va = vcol(r, 'validation_accuracy'), vp = vcol(r, 'validation_perplexity');
      const bl = best(vl, vsteps, (a, b) => a < b), ba = best(va, vsteps, (a, b) => a > b), bp = best(vp, vsteps, (a, b) => a < b);
      const loss = col(r, 'loss');
      const k = mode(col(r, 'micro_batches')), eb = mode(col(r, 'effective_batch'));
      const m = mode(col(r, 'micro_batch'));
      const km = isNum(k) ? k + ' × ' + (isNum(m) ? m : isNum(eb) ? Math.round(eb / k) : '?') : '—';
      const skipped = r.skippedCount || last(col(r, 'amp_skipped_steps')) || 0;
      const peak = (col(r, 'peak_rss_mib') || []).filter(isNum).reduce((a, b) => Math.max(a, b), -Infinity);
      const cells = [
        el('td', {}, el('span', { class: 'swatch', style: 'background:' + r.color }), r.name),
        el('td', {}, statusBadge(r)),
        el('td', { class: 'num', text: steps.length ? String(steps[steps.length - 1]) : '0' }),
        el('td', { class: 'num', text: km }),
        el('td', { class: 'num', text: fmtTime(r.duration) }),
        el('td', { class: 'num', text: fmt(r.examplesSeen, 0) }),
        el('td', { class: 'num', text: fmt(last(loss)) + ' / ' + fmt(last(smooth(loss || [], state.smoothing))) }),
        el('td', { class: 'num', text: fmt(last(vl)) + ' / ' + (bl ? fmt(bl.value) + ' @' + bl.step : '—') }),
        el('td', { class: 'num', text: pct(last(va)) + ' / ' + (ba ? pct(ba.value) + ' @' + ba.step : '—') }),
        el('td', { class: 'num', text: bp ? fmt(bp.value) + ' @' + bp.step : '—' }),
        el('td', { class: 'num', text: isFinite(peak) ? fmt(peak, 0) + ' MiB' : '—' }),
        el('td', { class: 'num', text: isNum(median(r.throughput || [])) ? fmt(median(r.throughput), 0) + ' ex/s' : '—' }),
        el('td', { class: 'num', text: String(skipped) }),
      ];
      table.append(el('tr', { 'data-run': r.name }, ...cells));
    });
    document.getElementById('summary').replaceChildren(el('div', { class: 'table-wrap' }, table));
  }

  function diffTable() {
    if (runs.length < 2) return;
    const keys = new Set();
    for (const r of runs) for (const k of Object.keys(r.recipe || {})) keys.add(k);
    const rows = [];
    let same = 0;
    for (const k of [...keys].sort()) {
      const vals = runs.map((r) => (r.recipe && k in r.recipe ? r.recipe[k] : null));
      if (vals.every((v) => v === vals[0])) { ++same; continue; }
      rows.push(el('tr', {}, el('td', { text: k }), ...vals.map((v) => el('td', { text: v === null ? '(not set)' : v }))));
    }
    const section = document.getElementById('diff-section');
    section.hidden = false;
    const table = el('table', {}, el('tr', {}, el('th', { text: 'recipe key' }), ...runs.map((r) => el('th', {}, el('span', { class: 'swatch', style: 'background:' + r.color }), r.name))));
    rows.forEach((row) => table.append(row));
    const note = el('p', { class: 'muted', text: rows.length + ' key' + (rows.length === 1 ? '' : 's') + ' differ; ' + same +
      ' are the same in every run (the resolved recipes, defaults included).' });
    document.getElementById('diff').replaceChildren(note, rows.length ? el('div', { class: 'table-wrap' }, table) : '');
  }

  function runBlocks() {
    const out = document.getElementById('runs');
    out.replaceChildren();
    for (const r of runs) {
      const s = r.status || {};
      const block = el('div', { class: 'run-block' },
        el('h3', {}, el('span', { class: 'swatch', style: 'background:' + r.color }), r.name, ' ', statusBadge(r)),
        el('div', { class: 'muted', text: r.path }));
      if (s.detail) block.append(el('p', { text: (s.status === 'failed' ? 'error: ' : '') + s.detail }));
      if (s.status === 'running') block.append(el('p', { text: 'in progress (process ' + s.pid + '): the report shows the steps recorded when it was made; make it again for more' }));
      for (const n of r.notes || []) block.append(el('p', { class: 'muted', text: n }));
      if (r.skipped_lines) block.append(el('p', { class: 'muted', text: r.skipped_lines + ' line(s) of metrics.jsonl were not records and were skipped' }));
      const events = r.events || [];
      if (events.length) {
        const t = el('table', {}, el('tr', {}, el('th', { text: 'step' }), el('th', { text: 'what' }), el('th', { text: 'note' })));
        events.slice(0, 50).forEach((e) => t.append(el('tr', {}, el('td', { class: 'num', text: String(e.step) }), el('td', { text: e.key }), el('td', { text: e.text }))));
        const d = el('details', {}, el('summary', { text: events.length + ' step note(s) (skipped steps, back-offs)' + (events.length > 50 ? ', the first 50' : '') }), t);
        block.append(d);
      }
      if (r.recipe_text != null)
        block.append(el('details', {}, el('summary', { text: 'resolved recipe (recipe.toml)' }), el('pre', { text: r.recipe_text })));
      out.append(block);
    }
  }

  function controls() {
    const toggles = document.getElementById('run-toggles');
    runs.forEach((r, i) => {
      const box = el('input', { type: 'checkbox' });
      box.checked = true;
      box.addEventListener('change', () => { if (box.checked) state.hidden.delete(i); else state.hidden.add(i); drawCharts(); });
      toggles.append(el('label', {}, box, el('span', { class: 'swatch', style: 'background:' + r.color }), r.name));
    });
    const x = document.getElementById('x-axis');
    x.addEventListener('change', () => { state.x = x.value; drawCharts(); });
    const sm = document.getElementById('smoothing'), smv = document.getElementById('smoothing-value');
    sm.addEventListener('input', () => { state.smoothing = Number(sm.value); smv.textContent = state.smoothing.toFixed(2); drawCharts(); summaryTable(); });
    const lg = document.getElementById('log-loss');
    lg.addEventListener('change', () => { state.logLoss = lg.checked; drawCharts(); });
    let pending = null;
    window.addEventListener('resize', () => { clearTimeout(pending); pending = setTimeout(drawCharts, 150); });
  }

  function problems() {
    const list = (data.warnings || []).concat(window.tkErrors || []);
    const box = document.getElementById('problems');
    if (!list.length) return;
    box.hidden = false;
    box.replaceChildren(el('strong', { text: 'While reading the runs:' }), el('ul', {}, ...list.map((w) => el('li', { text: w }))));
  }

  // What the page drew, for checking it in a browser: every chart's series and their points.
  function selfcheck() {
    document.getElementById('tk-selfcheck').textContent = JSON.stringify({
      errors: window.tkErrors || [],
      runs: runs.map((r) => ({ name: r.name, steps: stepCount(r), validations: (vcol(r, 'step') || []).length, status: (r.status || {}).status })),
      charts: rendered,
    });
  }

  try {
    runs.forEach(derive);
    const when = new Date((data.generated || 0) * 1000);
    document.getElementById('subtitle').textContent = runs.length + ' run' + (runs.length === 1 ? '' : 's') + ': ' +
      runs.map((r) => r.name).join(', ') + ' · made ' + when.toISOString().replace('T', ' ').slice(0, 19) + ' UTC';
    controls();
    summaryTable();
    drawCharts();
    diffTable();
    runBlocks();
  } catch (e) {
    (window.tkErrors = window.tkErrors || []).push('the report could not be drawn: ' + (e && e.stack ? e.stack : e));
    console.error(e);
  }
  problems();
  selfcheck();
})();
