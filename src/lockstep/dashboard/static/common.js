// lockstep dashboard: helpers shared by the pages (no library; nothing is fetched from elsewhere).
"use strict";

const Lockstep = (() => {
  const STATUSES = ["running", "finished", "failed", "interrupted", "preempted", "pruned", "stopped", "lost"];
  const PALETTE = ["#3559e0", "#e8590c", "#1a7f37", "#c92a2a", "#7a5af8", "#0b7285", "#d6336c", "#5c940d",
                   "#364fc7", "#a61e4d"];

  async function getJSON(url) {
    const response = await fetch(url, { headers: { accept: "application/json" } });
    if (!response.ok) throw new Error(`${url}: ${response.status} ${await response.text()}`);
    return response.json();
  }

  function el(tag, attributes = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attributes)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "text") node.textContent = value;
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function badge(status) { return el("span", { class: `badge ${status}`, text: status }); }

  function number(value, digits = 4) {
    if (value === null || value === undefined || Number.isNaN(value)) return "—";
    if (Number.isInteger(value)) return value.toLocaleString("en-US");
    const size = Math.abs(value);
    if (size !== 0 && (size >= 1e6 || size < 1e-3)) return value.toExponential(2);
    return Number(value.toPrecision(digits)).toString();
  }

  function seconds(value) {
    if (value === null || value === undefined) return "—";
    if (value < 1) return `${(value * 1000).toFixed(value < 0.01 ? 2 : 0)} ms`;
    return `${value.toFixed(value < 10 ? 2 : 1)} s`;
  }

  function age(epochSeconds) {
    if (!epochSeconds) return "—";
    const span = Math.max(0, Date.now() / 1000 - epochSeconds);
    if (span < 60) return `${Math.round(span)} s`;
    if (span < 3600) return `${Math.round(span / 60)} min`;
    if (span < 86400) return `${(span / 3600).toFixed(1)} h`;
    return `${(span / 86400).toFixed(1)} d`;
  }

  function bytes(value) {
    if (value === null || value === undefined) return "—";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let size = value, unit = 0;
    while (size >= 1024 && unit < units.length - 1) { size /= 1024; unit += 1; }
    return `${size.toFixed(unit ? 1 : 0)} ${units[unit]}`;
  }

  function when(epochSeconds) {
    return epochSeconds ? new Date(epochSeconds * 1000).toLocaleString() : "—";
  }

  function runLink(name) { return `/runs/${encodeURIComponent(name)}`; }

  // Runs fn now and then every periodMs while keepGoing() says so (a failed call is retried).
  function every(periodMs, fn, keepGoing = () => true) {
    let timer = null;
    const tick = async () => {
      try { await fn(); } catch (error) { console.warn(error); }
      if (keepGoing()) timer = setTimeout(tick, periodMs);
    };
    timer = setTimeout(tick, periodMs);
    return () => clearTimeout(timer);
  }

  function showError(error) {
    const main = document.querySelector("main");
    main.prepend(el("section", { class: "panel failure" }, el("h3", { text: "Could not load this page" }),
                    el("pre", { text: String(error) })));
  }

  // Metrics that look like counters (step, epoch) are not drawn by default.
  const COUNTERS = new Set(["step", "epoch", "global_step", "training_iteration", "iteration", "report_index"]);
  function defaultMetrics(names, limit = 4) {
    const chosen = names.filter((name) => !COUNTERS.has(name)).slice(0, limit);
    return chosen.length ? chosen : names.slice(0, limit);
  }

  return { STATUSES, PALETTE, getJSON, el, badge, number, seconds, age, bytes, when, runLink, every, showError,
           defaultMetrics };
})();
