// ppoflow explore: the page. Every value from the run is put on the page as text (textContent,
// never HTML), so a prompt or a response that holds markup is shown, not run.
"use strict";

const REFRESH_MS = 3000;
const TOKEN = new URLSearchParams(location.hash.slice(1)).get("token") || "";
const state = {
  overview: null,
  metrics: [],
  sort: "score",
  order: "asc",
  page: 0,
  total: 0,
  sample: null,
  refreshing: false,
  metricsChosen: false,
  asked: 0,
};

const $ = (id) => document.getElementById(id);

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function fmt(value, digits = 4) {
  if (value === null || value === undefined) return "—";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value) || Math.abs(value) >= 1e6 || (value !== 0 && Math.abs(value) < 1e-4)) {
    return Number.isInteger(value) ? String(value) : value.toPrecision(digits);
  }
  return String(Number(value.toFixed(digits)));
}

async function api(path, params) {
  const query = new URLSearchParams();
  for (const [k, v] of Object.entries(params || {})) {
    for (const item of Array.isArray(v) ? v : [v]) if (item !== "" && item !== null) query.append(k, item);
  }
  const response = await fetch(`/api/${path}?${query}`, { headers: { "X-Ppoflow-Token": TOKEN } });
  const body = response.headers.get("content-type")?.includes("json") ? await response.json() : null;
  if (!response.ok) throw new Error(body?.error || `${response.status} ${await response.text()}`);
  return body;
}

function showError(error, from = "action") {
  const box = $("error");
  if (!error && box.dataset.from !== from) return;  // a refresh clears its own error only
  box.textContent = error ? String(error.message || error) : "";
  box.dataset.from = from;
  box.hidden = !error;
}

function fillSelect(select, values, labels, keep) {
  const previous = keep ? select.value : null;
  select.replaceChildren(...values.map((v, i) => el("option", labels ? labels[i] : v, { value: v })));
  if (previous !== null && values.map(String).includes(previous)) select.value = previous;
}

// -- the run and its metrics ------------------------------------------------------------------

function largest(values, start) {
  let best = start;
  for (const v of values) if (v !== null && v > best) best = v;
  return best;
}

async function loadOverview() {
  const overview = await api("run");
  const before = state.overview;
  state.overview = overview;
  $("run-name").textContent = overview.run;
  const trainIters = overview.train_iterations, valIters = overview.val_iterations;
  const last = largest(valIters, largest(trainIters, -1));
  $("status").textContent =
    `${trainIters.length} training iterations, ${valIters.length} validated` +
    (last >= 0 ? ` · latest ${last}` : "") + ` · updated ${new Date().toLocaleTimeString()}`;
  renderFlowRuns(overview.flow_runs);
  $("left-out").textContent = overview.left_out.join("\n");  // files that cannot be read: less to show
  $("left-out").hidden = !overview.left_out.length;
  const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
  fillSelect($("source"), ["", ...overview.data_sources], ["all", ...overview.data_sources], true);
  if (!before || !same(before.metrics, overview.metrics)) {
    fillSelect($("metric-picker"), ["", ...overview.metrics], ["—", ...overview.metrics]);
  }
  if (!state.metricsChosen && overview.default_metrics.length) {  // the first metrics of a run
    state.metrics = overview.default_metrics.slice();
    state.metricsChosen = true;
  }
  const noSamplesYet = $("iteration").value === "";
  if (noSamplesYet && !trainIters.length && valIters.length) $("kind").value = "val";
  const changed = !before || !same(before.train_iterations, trainIters) || !same(before.val_iterations, valIters);
  if (changed) {
    fillIterations(noSamplesYet);
    await Promise.all([loadMetrics(), noSamplesYet ? loadSamples() : null]);
  }
}

function renderFlowRuns(runs) {
  const box = $("flow-runs");
  box.replaceChildren();
  for (const run of runs.slice(-3)) {
    const label = `flow run ${run.name || run.id}`;
    if (run.ui_url && !run.temporary_server) {
      box.append(el("a", label, { href: run.ui_url, target: "_blank", rel: "noopener noreferrer" }));
    } else {
      box.append(el("span", `${label} (temporary Prefect server: no UI)`, { class: "dim" }));
    }
    box.append(" ");
  }
}

function iterationsOf(kind) {
  const o = state.overview;
  return kind === "val" ? o.val_iterations : o.train_iterations;
}

function fillIterations(first) {
  const iters = iterationsOf($("kind").value);
  fillSelect($("iteration"), iters, null, !first);
  if (first && iters.length) $("iteration").value = String(iters[iters.length - 1]);
}

async function loadMetrics() {
  const data = await api("metrics", { names: state.metrics });
  const charts = $("charts");
  charts.replaceChildren();
  for (const name of state.metrics) charts.append(chart(name, data.iterations, data.series[name]));
}

function chart(name, iterations, values) {
  const width = 340, height = 150, pad = { l: 46, r: 10, t: 22, b: 22 };
  const box = el("figure", null, { class: "chart", "data-metric": name });
  const close = el("button", "×", { type: "button", title: "remove", class: "remove" });
  close.addEventListener("click", () => {
    state.metrics = state.metrics.filter((m) => m !== name);
    loadMetrics().catch(showError);
  });
  box.append(el("figcaption", name), close);
  const points = iterations.map((it, i) => [it, values[i]]).filter(([, v]) => v !== null);
  const plot = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}` });
  box.append(plot);
  if (!points.length) return box;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const smallest = (values) => -largest(values.map((v) => -v), -Infinity);
  let [x0, x1, y0, y1] = [smallest(xs), largest(xs, -Infinity), smallest(ys), largest(ys, -Infinity)];
  if (x0 === x1) x1 = x0 + 1;
  if (y0 === y1) { y0 -= 0.5; y1 += 0.5; }
  const X = (x) => pad.l + ((x - x0) / (x1 - x0)) * (width - pad.l - pad.r);
  const Y = (y) => height - pad.b - ((y - y0) / (y1 - y0)) * (height - pad.t - pad.b);
  for (const [y, anchor] of [[y0, "end"], [y1, "end"]]) {
    const label = svg("text", { x: pad.l - 4, y: Y(y) + 4, "text-anchor": anchor, class: "axis" });
    label.textContent = fmt(y, 3);
    plot.append(label);
  }
  for (const x of [x0, x1]) {
    const label = svg("text", { x: X(x), y: height - 6, "text-anchor": "middle", class: "axis" });
    label.textContent = String(x);
    plot.append(label);
  }
  plot.append(svg("polyline", { points: points.map(([x, y]) => `${X(x)},${Y(y)}`).join(" "), class: "line" }));
  for (const [x, y] of points) {
    const dot = svg("circle", { cx: X(x), cy: Y(y), r: 3.5, class: "point", "data-iter": x, "data-value": y });
    const tip = svg("title");
    tip.textContent = `iteration ${x}: ${y}`;
    dot.append(tip);
    dot.addEventListener("click", () => openIteration(x));
    plot.append(dot);
  }
  return box;
}

function openIteration(iteration) {
  let kind = $("kind").value;
  if (!iterationsOf(kind).includes(iteration)) kind = kind === "val" ? "train" : "val";
  if (!iterationsOf(kind).includes(iteration)) return;
  $("kind").value = kind;
  fillIterations(false);
  $("iteration").value = String(iteration);
  state.page = 0;
  loadSamples().catch(showError);
}

// -- the sample table --------------------------------------------------------------------------

function filters() {
  return {
    kind: $("kind").value,
    iter: $("iteration").value,
    source: $("source").value,
    min_score: $("min-score").value,
    max_score: $("max-score").value,
    min_length: $("min-length").value,
    max_length: $("max-length").value,
    truncated: $("truncated").value,
    sort: state.sort,
    order: state.order,
    page: state.page,
    page_rows: $("page-rows").value,
  };
}

async function loadSamples() {
  if ($("iteration").value === "") {
    $("samples").tBodies[0].replaceChildren();
    $("page-info").textContent = "no samples yet";
    return;
  }
  const wanted = filters();
  const asked = ++state.asked;
  let data;
  try {
    data = await api("samples", wanted);
  } catch (error) {
    if (asked !== state.asked) return;  // a newer request has the table
    $("samples").tBodies[0].replaceChildren();
    $("page-info").textContent = "no rows: see the message above";
    throw error;
  }
  if (asked !== state.asked) return;  // answered after a newer request: its rows are not wanted
  showError(null);
  state.total = data.total;
  const rows = data.rows.map((row) => {
    const tr = el("tr", null, {
      "data-prompt-id": row.prompt_id, "data-sample-idx": row.sample_idx, class: "sample-row",
    });
    tr.append(
      el("td", row.prompt_id), el("td", row.sample_idx), el("td", row.data_source),
      el("td", fmt(row.score), { class: "num score", "data-value": String(row.score) }),
      el("td", row.response_length, { class: "num" }), el("td", row.finish_reason),
      el("td", row.prompt_end, { class: "text" }), el("td", row.response_start, { class: "text" }),
    );
    tr.addEventListener("click", () =>
      openSample(wanted.kind, Number(wanted.iter), row.prompt_id, row.sample_idx).catch(showError));
    return tr;
  });
  $("samples").tBodies[0].replaceChildren(...rows);
  const first = data.total ? data.page * data.page_rows + 1 : 0;
  const last = Math.min(data.total, (data.page + 1) * data.page_rows);
  $("page-info").textContent = `rows ${first}–${last} of ${data.total}`;
  if (!performance.getEntriesByName("first-samples").length) performance.mark("first-samples");
  $("samples").dataset.shown = String(asked);  // which request the rows answer (tests wait on it)
  $("prev").disabled = data.page === 0;
  $("next").disabled = last >= data.total;
  for (const th of document.querySelectorAll("#samples th[data-sort]")) {
    th.classList.toggle("sorted", th.dataset.sort === state.sort);
    th.dataset.order = th.dataset.sort === state.sort ? state.order : "";
  }
}

// -- one sample --------------------------------------------------------------------------------

async function openSample(kind, iteration, promptId, sampleIdx) {
  const sample = await api("sample", { kind, iter: iteration, prompt_id: promptId, sample_idx: sampleIdx });
  state.sample = sample;
  showError(null);
  $("sample-title").textContent =
    `iteration ${sample.iter} · ${kind === "val" ? "validation" : "training"} · ${sample.prompt_id} #${sample.sample_idx}`;
  const facts = [
    ["score", sample.score], ...Object.entries(sample.components).map(([k, v]) => [k, v]),
    ["data source", sample.data_source], ["ground truth", sample.ground_truth],
    ["finish", sample.finish_reason], ["length", sample.response_length],
  ];
  if (sample.policy_version !== undefined) facts.push(["policy version", sample.policy_version]);
  if (sample.num_turns !== undefined && sample.num_turns !== null) facts.push(["turns", sample.num_turns]);
  if (sample.error) facts.push(["error", sample.error]);
  $("sample-facts").replaceChildren(...facts.flatMap(([k, v]) => [
    el("dt", k), el("dd", fmt(v), { "data-name": k, "data-value": String(v) }),
  ]));
  $("sample-prompt").textContent = sample.prompt_text;
  $("sample-response").textContent = sample.response_text;
  const columns = Object.keys(sample.token_columns || {});
  for (const id of ["colour-controls", "tokens-title", "tokens"]) $(id).hidden = !sample.tokens;
  const labels = columns.map((c) => state.overview.token_columns[c] || c);
  fillSelect($("colour-by"), columns, labels, true);
  renderTokens();
  renderTurns(sample.turns || []);
  const iters = iterationsOf(kind);
  fillSelect($("compare-left"), iters);
  fillSelect($("compare-right"), iters);
  const found = (await api("across", { kind, prompt_id: promptId })).iterations;
  $("compare-left").value = String(found.find((it) => it !== sample.iter) ?? sample.iter);
  $("compare-right").value = String(sample.iter);
  $("compare-view").replaceChildren(el("p", `${promptId} is in iterations ${found.join(", ")}`, { class: "dim" }));
  const section = $("sample-section");
  section.dataset.sample = `${kind}/${sample.iter}/${sample.prompt_id}/${sample.sample_idx}`;  // (tests wait on it)
  section.hidden = false;
  section.scrollIntoView({ block: "start" });
}

function colour(value, centre, scale) {
  if (value === null || scale === 0) return "transparent";
  const share = Math.min(1, Math.abs(value - centre) / scale) * 0.85;
  return value >= centre ? `rgba(38, 110, 210, ${share})` : `rgba(214, 48, 39, ${share})`;
}

function renderTokens() {
  const sample = state.sample, box = $("tokens");
  box.replaceChildren();
  $("token-detail").replaceChildren();
  $("legend").replaceChildren();
  if (!sample || !sample.tokens) return;
  const column = $("colour-by").value;
  const values = column ? sample.token_columns[column] : null;
  const mask = sample.response_mask;
  const centre = column === "ratio_old_to_rollout" ? 1 : 0;
  const scale = values
    ? largest(values.map((v, i) => (v === null || (mask && !mask[i]) ? null : Math.abs(v - centre))), 0)
    : 0;
  if (values) {
    $("legend").append(
      el("span", fmt(centre - scale, 3), { class: "swatch low" }),
      el("span", fmt(centre, 3), { class: "swatch" }),
      el("span", fmt(centre + scale, 3), { class: "swatch high" }),
    );
  }
  sample.tokens.forEach((token, i) => {
    const tool = mask && !mask[i];
    const span = el("span", token, { class: tool ? "tok tool" : "tok", "data-index": i });
    if (values) {
      span.dataset.value = String(values[i]);
      if (!tool) span.style.backgroundColor = colour(values[i], centre, scale);
    }
    span.title = `${i}: ${JSON.stringify(token)}${values ? ` · ${values[i]}` : ""}${tool ? " · tool" : ""}`;
    span.addEventListener("click", () => tokenDetail(i));
    box.append(span);
  });
}

function tokenDetail(i) {
  const sample = state.sample;
  const rows = [["token", `${i}: ${JSON.stringify(sample.tokens[i])}`]];
  if (sample.response_mask) rows.push(["from", sample.response_mask[i] ? "model" : "tool"]);
  for (const [name, values] of Object.entries(sample.token_columns)) rows.push([state.overview.token_columns[name] || name, values[i]]);
  $("token-detail").replaceChildren(...rows.map(([k, v]) => {
    const tr = el("tr");
    tr.append(el("th", k), el("td", typeof v === "number" ? fmt(v, 6) : v, { "data-name": k }));
    return tr;
  }));
}

function renderTurns(turns) {
  const box = $("turns");
  box.replaceChildren();
  if (!turns.length) return;
  box.append(el("h3", "turns"));
  for (const turn of turns) {
    const line = el("div", null, { class: `turn ${turn.role}` });
    if (turn.role === "assistant") {
      line.append(el("strong", `turn ${turn.turn} assistant `), el("span", turn.text), el("span", `  [${turn.turn_end}]`, { class: "dim" }));
    } else {
      line.append(el("strong", `turn ${turn.turn} tool `), el("span", `${turn.tool_name || "(malformed call)"} ${turn.arguments ?? ""}`));
      line.append(turn.error ? el("span", ` error: ${turn.error}`, { class: "error" }) : el("span", ` → ${turn.result}`));
    }
    box.append(line);
  }
}

async function compare() {
  const sample = state.sample;
  const iters = [$("compare-left").value, $("compare-right").value];
  const data = await api("across", { kind: sample.kind, prompt_id: sample.prompt_id, iters });
  const view = $("compare-view");
  view.replaceChildren();
  const note = el("p", `${sample.prompt_id} is in iterations ${data.iterations.join(", ")}`, { class: "dim" });
  const columns = el("div", null, { class: "columns" });
  for (const iteration of iters) {
    const column = el("div", null, { class: "column", "data-iter": iteration });
    const responses = data.responses[iteration] || [];
    column.append(el("h4", `iteration ${iteration}` + (responses.length ? "" : " (not in this iteration)")));
    for (const r of responses) {
      const item = el("div", null, { class: "response", "data-sample-idx": r.sample_idx });
      item.append(
        el("span", `#${r.sample_idx} `, { class: "dim" }),
        el("span", fmt(r.score), { class: "score", "data-value": String(r.score) }),
        el("span", ` · ${r.response_length} tokens · ${r.finish_reason}`, { class: "dim" }),
        el("pre", r.response_text),
      );
      column.append(item);
    }
    columns.append(column);
  }
  view.append(note, columns);
}

// -- wiring ------------------------------------------------------------------------------------

function reload() {
  state.page = 0;
  loadSamples().catch(showError);
}

function wire() {
  $("kind").addEventListener("change", () => { fillIterations(true); reload(); });
  for (const id of ["iteration", "source", "truncated", "page-rows"]) $(id).addEventListener("change", reload);
  for (const id of ["min-score", "max-score", "min-length", "max-length"]) $(id).addEventListener("change", reload);
  $("prev").addEventListener("click", () => { state.page = Math.max(0, state.page - 1); loadSamples().catch(showError); });
  $("next").addEventListener("click", () => { state.page += 1; loadSamples().catch(showError); });
  for (const th of document.querySelectorAll("#samples th[data-sort]")) {
    th.addEventListener("click", () => {
      state.order = state.sort === th.dataset.sort && state.order === "asc" ? "desc" : "asc";
      state.sort = th.dataset.sort;
      reload();
    });
  }
  $("metric-picker").addEventListener("change", () => {
    const name = $("metric-picker").value;
    if (name && !state.metrics.includes(name)) state.metrics.push(name);
    $("metric-picker").value = "";
    loadMetrics().catch(showError);
  });
  $("colour-by").addEventListener("change", renderTokens);
  $("compare").addEventListener("click", () => compare().catch(showError));
}

async function refresh() {
  if (state.refreshing || document.hidden) return;
  state.refreshing = true;
  try {
    await loadOverview();
    showError(null, "refresh");
  } catch (error) {
    showError(error, "refresh");
  } finally {
    state.refreshing = false;
  }
}

wire();
refresh().then(() => setInterval(refresh, REFRESH_MS));
