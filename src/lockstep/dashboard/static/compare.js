// lockstep dashboard: several runs side by side (a sweep's curves overlaid): one chart per chosen
// metric, one line per run; running runs gain points every 3 s.
"use strict";

(() => {
  const { el, getJSON, badge, number, runLink } = Lockstep;
  const names = new URLSearchParams(location.search).getAll("runs");
  const runs = names.map((name, k) => ({ name, color: Lockstep.PALETTE[k % 10], detail: null, index: [], metrics: {} }));
  const state = { chosen: [], charts: new Map() };

  async function load(run) {
    const api = `/api/runs/${encodeURIComponent(run.name)}`;
    const [detail, chunk] = await Promise.all([getJSON(api), getJSON(`${api}/reports?since=${run.index.length}`)]);
    run.detail = detail;
    const before = run.index.length;
    run.index.push(...chunk.index);
    for (const [metric, values] of Object.entries(chunk.metrics)) {
      if (!run.metrics[metric]) run.metrics[metric] = new Array(before).fill(null);
      run.metrics[metric].push(...values);
    }
    for (const values of Object.values(run.metrics)) while (values.length < run.index.length) values.push(null);
  }

  function metricNames() { return [...new Set(runs.flatMap((run) => Object.keys(run.metrics)))]; }

  function renderLegend() {
    document.getElementById("legend").replaceChildren(
      el("thead", {}, el("tr", {}, ...["", "run", "status", "reports", "last metrics"].map((h) => el("th", { text: h })))),
      el("tbody", {}, runs.map((run) => {
        const swatch = el("i"); swatch.style.cssText = `display:inline-block;width:14px;height:4px;background:${run.color}`;
        const last = Object.entries(run.metrics).map(([k, v]) => `${k}=${number(v[v.length - 1])}`).slice(0, 5).join("  ");
        return el("tr", { "data-run": run.name }, el("td", {}, swatch), el("td", {}, el("a", { href: runLink(run.name), text: run.name })),
          el("td", {}, badge(run.detail ? run.detail.status : "?")), el("td", { class: "num", text: number(run.index.length) }),
          el("td", { class: "muted", text: last }));
      })));
  }

  function renderPicks() {
    const all = metricNames();
    if (!state.chosen.length) state.chosen = Lockstep.defaultMetrics(all);
    document.getElementById("metric-picks").replaceChildren(...all.map((metric) => el("label", {},
      el("input", { type: "checkbox", value: metric, checked: state.chosen.includes(metric), onchange: (event) => {
        state.chosen = event.target.checked ? [...state.chosen, metric] : state.chosen.filter((m) => m !== metric);
        renderCharts();
      } }), ` ${metric}`)));
  }

  function renderCharts() {
    const container = document.getElementById("charts");
    const log = document.getElementById("log-scale").checked;
    for (const [metric, chart] of state.charts) if (!state.chosen.includes(metric)) { chart.remove(); state.charts.delete(metric); }
    for (const metric of state.chosen) {
      let chart = state.charts.get(metric);
      if (!chart) { chart = new LineChart(container, { title: metric, log }); state.charts.set(metric, chart); }
      chart.log = log;
      chart.setSeries(runs.filter((run) => run.metrics[metric]).map((run) => ({ name: run.name, x: run.index, y: run.metrics[metric], color: run.color })));
    }
  }

  async function refresh(onlyRunning) {
    await Promise.all(runs.filter((run) => !onlyRunning || (run.detail && run.detail.status === "running")).map(load));
    renderLegend(); renderPicks(); renderCharts();
  }

  window.addEventListener("DOMContentLoaded", async () => {
    if (!runs.length) { Lockstep.showError("No runs chosen: pick some on the runs list, then press compare."); return; }
    document.getElementById("log-scale").addEventListener("change", renderCharts);
    document.getElementById("title").textContent = `${runs.length} runs side by side`;
    try { await refresh(false); } catch (error) { Lockstep.showError(error); return; }
    document.body.dataset.loaded = "1";
    Lockstep.every(3000, () => refresh(true), () => runs.some((run) => run.detail && run.detail.status === "running"));
    window.addEventListener("resize", () => state.charts.forEach((chart) => chart.draw()));
  });
})();
