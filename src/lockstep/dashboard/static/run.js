// lockstep dashboard: one run. Curves update while the run goes on (new reports every 2 s; the
// rest every 5 s); window.lockstepLoadedMs is the time from navigation to the first full render.
"use strict";

(() => {
  const { el, getJSON, number, seconds, bytes, when, age, badge } = Lockstep;
  const name = decodeURIComponent(location.pathname.split("/").pop());
  const api = `/api/runs/${encodeURIComponent(name)}`;
  const state = { detail: null, rows: { index: [], metrics: {} }, count: 0, chosen: [], charts: new Map(), logTab: null };

  function running() { return state.detail && state.detail.status === "running"; }

  function addRows(chunk) {
    const rows = state.rows;
    const before = rows.index.length;
    rows.index.push(...chunk.index);
    for (const [metric, values] of Object.entries(chunk.metrics)) {
      if (!rows.metrics[metric]) rows.metrics[metric] = new Array(before).fill(null);
      rows.metrics[metric].push(...values);
    }
    for (const values of Object.values(rows.metrics)) while (values.length < rows.index.length) values.push(null);
    state.count = chunk.count;
  }

  function renderHeader() {
    const d = state.detail;
    document.title = `${d.name} · lockstep`;
    document.getElementById("where").textContent = d.path;
    document.getElementById("title").replaceChildren(d.name, badge(d.status),
      el("a", { href: `/compare?runs=${encodeURIComponent(d.name)}`, class: "aside", text: "open in compare" }));
    const facts = [
      ["reports", number(state.count)], ["workers", `${d.world_size ?? "?"} (${d.executor ?? "local"})`],
      ["created", when(d.created_at)], ["updated", `${age(d.updated_at)} ago`],
      ["driver", d.driver ? `${d.driver.host} pid ${d.driver.pid}` : "—"],
      ["failures", number(d.num_failures || 0)], ["preemptions", number(d.num_preemptions || 0)],
    ];
    if (d.stop_reason) facts.push(["stopped because", d.stop_reason]);
    if (d.metrics_url) facts.push(["metrics", d.metrics_url]);
    document.getElementById("facts").replaceChildren(...facts.map(([k, v]) => el("div", {}, el("span", { text: k }), v)));
  }

  function renderFailure() {
    const error = state.detail.error;
    const box = document.getElementById("failure");
    if (!error) { box.replaceChildren(); return; }
    const failures = (error.failures || []).map((f) => el("div", { class: "failure", "data-rank": f.rank },
      el("h3", { text: `rank ${f.rank}: ${f.error_type}: ${f.message}` }),
      f.traceback ? el("pre", { class: "traceback", text: f.traceback }) : el("div", { class: "muted", text: "no traceback" })));
    box.replaceChildren(el("section", { class: "panel" }, el("h2", { text: `Failed: ${error.type}` }),
      el("pre", { class: "config", text: error.message }), ...failures));
  }

  function renderPicks() {
    const names = Object.keys(state.rows.metrics);
    if (!state.chosen.length) state.chosen = Lockstep.defaultMetrics(names);
    const picks = names.map((metric) => el("label", {},
      el("input", { type: "checkbox", value: metric, checked: state.chosen.includes(metric),
                    onchange: (event) => choose(metric, event.target.checked) }), ` ${metric}`));
    document.getElementById("metric-picks").replaceChildren(...(picks.length ? picks : [el("span", { class: "muted", text: "no numeric metrics reported yet" })]));
  }

  function choose(metric, on) {
    state.chosen = on ? [...state.chosen, metric] : state.chosen.filter((m) => m !== metric);
    renderCharts();
  }

  function renderCharts() {
    const container = document.getElementById("charts");
    const log = document.getElementById("log-scale").checked;
    for (const [metric, chart] of state.charts) if (!state.chosen.includes(metric)) { chart.remove(); state.charts.delete(metric); }
    state.chosen.forEach((metric, k) => {
      let chart = state.charts.get(metric);
      if (!chart) { chart = new LineChart(container, { title: metric, log }); state.charts.set(metric, chart); }
      chart.log = log;
      chart.setSeries([{ name: metric, x: state.rows.index, y: state.rows.metrics[metric] || [], color: Lockstep.PALETTE[k % 10] }]);
    });
  }

  function splitBar(shares) {
    if (!shares) return "—";
    return el("div", { class: "split", title: Object.entries(shares).map(([p, s]) => `${p} ${(100 * (s || 0)).toFixed(0)}%`).join(", ") },
      ...["data", "compute", "collective", "report"].map((part) => {
        const bar = el("div", { class: part }); bar.style.width = `${100 * (shares[part] || 0)}%`; return bar;
      }));
  }

  function renderRanks() {
    const d = state.detail;
    const pct = (value) => (value === null || value === undefined ? "—" : `${(100 * value).toFixed(0)}%`);
    const rows = d.ranks.map((r) => el("tr", { "data-rank": r.rank },
      el("td", { text: r.rank }), el("td", { text: r.status }), el("td", { text: r.host || "—" }),
      el("td", { class: "num", text: seconds(r.step_s) }), el("td", {}, splitBar(r.shares)),
      ...["data", "compute", "collective", "report"].map((p) => el("td", { class: "num", text: pct(r.shares && r.shares[p]) })),
      el("td", { class: r.slow ? "slow" : "muted", text: r.slow ? `slow (${d.slow_rank.cause})` : "" })));
    const legend = el("div", { class: "legend" }, ...["data", "compute", "collective", "report"].map((p) =>
      el("span", {}, el("i", { class: p }), p === "report" ? "report wait" : p)));
    document.getElementById("ranks").replaceChildren(
      el("div", { class: "muted", text: "Time between reports and where it went, over the latest reports." }), legend,
      el("table", {}, el("thead", {}, el("tr", {}, ...["rank", "status", "host", "step time", "split"].map((h) => el("th", { text: h })),
        ...["data", "compute", "collective", "report wait"].map((h) => el("th", { class: "num", text: h })), el("th", { text: "" }))),
      el("tbody", {}, rows)));
  }

  function renderCheckpoints() {
    const rows = state.detail.checkpoints;
    const box = document.getElementById("checkpoints");
    if (!rows.length) { box.replaceChildren(el("div", { class: "empty", text: "no checkpoints" })); return; }
    const withValidation = rows.some((c) => c.validation);
    box.replaceChildren(el("table", {}, el("thead", {}, el("tr", {},
      ...["checkpoint", "report", "kept", "", "scores", ...(withValidation ? ["validation"] : []), "size"].map((h) => el("th", { text: h })))),
      el("tbody", {}, rows.map((c) => el("tr", {},
        el("td", { text: c.dir_name }), el("td", { class: "num", text: c.report_index }),
        el("td", { text: c.kept ? "kept" : "deleted" }),
        el("td", { text: [c.latest ? "latest" : "", c.best ? "best" : ""].filter(Boolean).join(", ") }),
        el("td", { text: Object.entries(c.metrics).filter(([, v]) => typeof v === "number").slice(0, 6).map(([k, v]) => `${k}=${number(v)}`).join("  ") }),
        ...(withValidation ? [el("td", { text: c.validation || "—" })] : []),
        el("td", { class: "num", text: bytes(c.size_bytes) }))))));
  }

  function renderConfig() {
    const config = state.detail.config;
    document.getElementById("config").replaceChildren(config
      ? el("pre", { class: "config", text: JSON.stringify(config, null, 2) })
      : el("div", { class: "empty", text: "this run's record has no config (written by an older lockstep)" }));
  }

  async function refreshLogs() {
    const logs = (await getJSON(`${api}/logs`)).logs;
    const names = Object.keys(logs);
    const box = document.getElementById("logs");
    if (!names.length) { box.replaceChildren(el("div", { class: "empty", text: "no logs in storage yet" })); return; }
    if (!names.includes(state.logTab)) state.logTab = names[0];
    const tabs = el("div", { class: "tabs" }, names.map((file) => el("button", {
      class: file === state.logTab ? "active" : "", text: file, onclick: () => { state.logTab = file; refreshLogs(); } })));
    const tail = el("pre", { class: "log", "data-file": state.logTab, text: logs[state.logTab] || "(empty)" });
    box.replaceChildren(tabs, tail);
    tail.scrollTop = tail.scrollHeight;
  }

  function renderDetail() { renderHeader(); renderFailure(); renderRanks(); renderCheckpoints(); renderConfig(); }

  async function pollReports() {
    const chunk = await getJSON(`${api}/reports?since=${state.rows.index.length}`);
    if (chunk.start !== state.rows.index.length) { state.rows = { index: [], metrics: {} }; }
    const grew = chunk.index.length > 0;
    addRows(chunk);
    if (grew) { renderPicks(); renderCharts(); renderHeader(); }
  }

  async function start() {
    document.getElementById("log-scale").addEventListener("change", renderCharts);
    const [detail, chunk] = await Promise.all([getJSON(api), getJSON(`${api}/reports?since=0`)]);
    state.detail = detail;
    addRows(chunk);
    renderDetail(); renderPicks(); renderCharts();
    window.lockstepLoadedMs = performance.now();
    document.body.dataset.loaded = "1";
    refreshLogs().catch(console.warn);
    const live = () => running();
    Lockstep.every(2000, pollReports, live);
    Lockstep.every(5000, async () => { state.detail = await getJSON(api); renderDetail(); }, live);
    Lockstep.every(5000, refreshLogs, live);
    window.addEventListener("resize", () => state.charts.forEach((chart) => chart.draw()));
  }

  window.addEventListener("DOMContentLoaded", () => start().catch(Lockstep.showError));
})();
