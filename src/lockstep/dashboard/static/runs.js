// lockstep dashboard: the runs under the storage path, sortable and filterable, refreshed every 5 s.
"use strict";

(() => {
  const { el, getJSON, number, age, badge, runLink } = Lockstep;
  const state = { runs: [], sortKey: "created_at", descending: false, selected: new Set() };
  const COLUMNS = [
    { key: "select", label: "" },
    { key: "name", label: "run" },
    { key: "status", label: "status" },
    { key: "progress", label: "progress" },
    { key: "reports", label: "reports", num: true },
    { key: "last_report_at", label: "last report", num: true },
    { key: "created_at", label: "age", num: true },
    { key: "best", label: "best", num: true },
    { key: "checkpoints", label: "checkpoints", num: true },
    { key: "world_size", label: "workers", num: true },
  ];

  function bestMetric() { return document.getElementById("best-metric").value; }

  // The best value of the chosen metric for one run: min or max as chosen, or by the run's
  // checkpoint_score_order when the metric is its score attribute, else min for losses and errors.
  function best(run) {
    const metric = bestMetric();
    const figures = run.metrics[metric];
    if (!figures) return null;
    let mode = document.getElementById("best-mode").value;
    if (mode === "auto") {
      if (run.score_attribute === metric) mode = run.score_order === "min" ? "min" : "max";
      else mode = /loss|err|perplexity|time/i.test(metric) ? "min" : "max";
    }
    return figures[mode];
  }

  function sortValue(run, key) {
    if (key === "best") return best(run);
    if (key === "created_at") return -(run.created_at || 0);  // age: older is larger
    return run[key];
  }

  function shown() {
    const text = document.getElementById("filter").value.trim().toLowerCase();
    const status = document.getElementById("status-filter").value;
    const runs = state.runs.filter((run) => (!text || run.name.toLowerCase().includes(text)) && (!status || run.status === status));
    const sign = state.descending ? -1 : 1;
    return runs.sort((a, b) => {
      const x = sortValue(a, state.sortKey), y = sortValue(b, state.sortKey);
      if (x === y) return a.name.localeCompare(b.name);
      if (x === null || x === undefined) return 1;
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : 1) * sign;
    });
  }

  function header() {
    const row = el("tr", {}, COLUMNS.map((column) => {
      if (column.key === "select") return el("th", {});
      const arrow = state.sortKey === column.key ? (state.descending ? " ▼" : " ▲") : "";
      const label = column.key === "best" && bestMetric() ? `best ${bestMetric()}` : column.label;
      return el("th", { class: `sortable${column.num ? " num" : ""}`, "data-key": column.key, text: label + arrow,
        onclick: () => { state.descending = state.sortKey === column.key ? !state.descending : column.num; state.sortKey = column.key; render(); } });
    }));
    document.querySelector("#runs thead").replaceChildren(row);
  }

  function progressCell(run) {
    if (run.progress === null || run.progress === undefined) return el("td", { class: "muted", text: "—" });
    const fill = el("div", {}); fill.style.width = `${Math.round(100 * run.progress)}%`;
    return el("td", { title: `${Math.round(100 * run.progress)}%` }, el("span", { class: "bar" }, fill), ` ${Math.round(100 * run.progress)}%`);
  }

  function row(run) {
    const box = el("input", { type: "checkbox", "aria-label": `select ${run.name}`, checked: state.selected.has(run.name),
      onchange: (event) => { if (event.target.checked) state.selected.add(run.name); else state.selected.delete(run.name); updateCompare(); } });
    return el("tr", { "data-run": run.name, "data-status": run.status },
      el("td", {}, box),
      el("td", {}, el("a", { href: runLink(run.name), text: run.name }), run.error ? el("div", { class: "muted", text: run.error }) : null),
      el("td", {}, badge(run.status)),
      progressCell(run),
      el("td", { class: "num", text: number(run.reports) }),
      el("td", { class: "num", text: run.last_report_at ? `${age(run.last_report_at)} ago` : "—" }),
      el("td", { class: "num", text: age(run.created_at) }),
      el("td", { class: "num", text: number(best(run)) }),
      el("td", { class: "num", text: number(run.checkpoints) }),
      el("td", { class: "num", text: run.world_size ?? "—" }));
  }

  function updateCompare() {
    const button = document.getElementById("compare");
    button.disabled = state.selected.size < 1;
    button.textContent = state.selected.size ? `compare selected (${state.selected.size})` : "compare selected";
  }

  function render() {
    header();
    const runs = shown();
    document.querySelector("#runs tbody").replaceChildren(...(runs.length ? runs.map(row)
      : [el("tr", {}, el("td", { colspan: COLUMNS.length, class: "empty", text: state.runs.length ? "no run matches" : "no runs in this storage path yet" }))]));
    document.getElementById("count").textContent = `${runs.length} of ${state.runs.length} runs`;
    updateCompare();
  }

  function fillMetricChoices() {
    const select = document.getElementById("best-metric");
    const names = [...new Set(state.runs.flatMap((run) => Object.keys(run.metrics)))];
    const scored = state.runs.map((run) => run.score_attribute).find((name) => name && names.includes(name));
    const current = select.value || scored || Lockstep.defaultMetrics(names, 1)[0] || "";
    select.replaceChildren(...names.map((name) => el("option", { value: name, text: name, selected: name === current })));
  }

  async function refresh() {
    const listing = await getJSON("/api/runs");
    document.getElementById("where").textContent = listing.storage;
    state.runs = listing.runs;
    fillMetricChoices();
    render();
    document.body.dataset.loaded = "1";
  }

  window.addEventListener("DOMContentLoaded", () => {
    const statuses = document.getElementById("status-filter");
    statuses.append(...Lockstep.STATUSES.map((status) => el("option", { value: status, text: status })));
    for (const id of ["filter", "status-filter", "best-metric", "best-mode"]) {
      document.getElementById(id).addEventListener("input", render);
    }
    document.getElementById("compare").addEventListener("click", () => {
      location.href = `/compare?${[...state.selected].map((name) => `runs=${encodeURIComponent(name)}`).join("&")}`;
    });
    refresh().catch(Lockstep.showError);
    Lockstep.every(5000, refresh);
  });
})();
