// lockstep dashboard: a small line chart on a <canvas> (hand-written; no library).
// Series are {name, x: [numbers], y: [numbers or null], color}; a null is a gap. With log scale,
// values <= 0 are left out. canvas.dataset.points holds the number of points drawn (tests read it).
"use strict";

class LineChart {
  constructor(container, { title = "", xLabel = "report", log = false } = {}) {
    this.title = title;
    this.xLabel = xLabel;
    this.log = log;
    this.series = [];
    this.canvas = Lockstep.el("canvas", { "aria-label": `${title} chart`, "data-metric": title });
    this.tip = Lockstep.el("div", { class: "tip" });
    this.box = Lockstep.el("div", { class: "chart" }, this.canvas, this.tip);
    container.append(this.box);
    this.canvas.addEventListener("mousemove", (event) => this.hover(event));
    this.canvas.addEventListener("mouseleave", () => { this.tip.style.display = "none"; });
  }

  setSeries(series) { this.series = series; this.draw(); }
  setLog(log) { this.log = log; this.draw(); }
  remove() { this.box.remove(); }

  // The points of each series as they are drawn: [[x, y], ...] with y on the chart's scale.
  visible(series) {
    const points = [];
    for (let i = 0; i < series.x.length; i += 1) {
      const y = series.y[i];
      if (y === null || y === undefined || !Number.isFinite(y)) { points.push(null); continue; }
      if (this.log && y <= 0) { points.push(null); continue; }
      points.push([series.x[i], this.log ? Math.log10(y) : y]);
    }
    return points;
  }

  ranges(all) {
    let x0 = Infinity, x1 = -Infinity, y0 = Infinity, y1 = -Infinity;
    for (const points of all) for (const point of points) {
      if (!point) continue;
      x0 = Math.min(x0, point[0]); x1 = Math.max(x1, point[0]);
      y0 = Math.min(y0, point[1]); y1 = Math.max(y1, point[1]);
    }
    if (!Number.isFinite(x0)) return null;
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { const pad = Math.abs(y0) * 0.1 || 1; y0 -= pad; y1 += pad; }
    const pad = (y1 - y0) * 0.05;
    return { x0, x1, y0: y0 - pad, y1: y1 + pad };
  }

  draw() {
    const ratio = window.devicePixelRatio || 1;
    const width = this.canvas.clientWidth || 420, height = this.canvas.clientHeight || 240;
    this.canvas.width = Math.round(width * ratio); this.canvas.height = Math.round(height * ratio);
    const g = this.canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    g.font = "12px system-ui, sans-serif";
    const area = { left: 58, right: width - 12, top: 24, bottom: height - 30 };
    g.fillStyle = "#1d2433"; g.fillText(this.title + (this.log ? " (log scale)" : ""), area.left, 15);
    const all = this.series.map((series) => this.visible(series));
    const range = this.ranges(all);
    this.canvas.dataset.points = String(all.reduce((sum, points) => sum + points.filter(Boolean).length, 0));
    this.layout = null;
    if (!range) { g.fillStyle = "#667085"; g.fillText("no values yet", area.left, area.top + 30); return; }
    const sx = (x) => area.left + (x - range.x0) / (range.x1 - range.x0) * (area.right - area.left);
    const sy = (y) => area.bottom - (y - range.y0) / (range.y1 - range.y0) * (area.bottom - area.top);
    this.layout = { area, range, sx, all };
    this.axes(g, area, range, sx, sy);
    all.forEach((points, k) => this.line(g, points, this.series[k].color, sx, sy));
    if (this.series.length > 1) this.legend(g, area);
  }

  axes(g, area, range, sx, sy) {
    g.strokeStyle = "#e4e7ec"; g.fillStyle = "#667085"; g.lineWidth = 1;
    for (const y of ticks(range.y0, range.y1, 5)) {
      const py = Math.round(sy(y)) + 0.5;
      g.beginPath(); g.moveTo(area.left, py); g.lineTo(area.right, py); g.stroke();
      const label = this.log ? Lockstep.number(10 ** y, 3) : Lockstep.number(y, 3);
      g.textAlign = "right"; g.fillText(label, area.left - 6, py + 4);
    }
    g.textAlign = "center";
    for (const x of ticks(range.x0, range.x1, 6).filter(Number.isInteger)) {
      const px = Math.round(sx(x)) + 0.5;
      g.beginPath(); g.moveTo(px, area.bottom); g.lineTo(px, area.bottom + 4); g.stroke();
      g.fillText(Lockstep.number(x), px, area.bottom + 16);
    }
    g.fillText(this.xLabel, (area.left + area.right) / 2, area.bottom + 28);
    g.strokeStyle = "#98a2b3";
    g.beginPath(); g.moveTo(area.left, area.top); g.lineTo(area.left, area.bottom); g.lineTo(area.right, area.bottom);
    g.stroke();
    g.textAlign = "left";
  }

  line(g, points, color, sx, sy) {
    g.strokeStyle = color; g.fillStyle = color; g.lineWidth = 1.6;
    g.beginPath();
    let drawing = false;
    for (const point of points) {
      if (!point) { drawing = false; continue; }
      if (drawing) g.lineTo(sx(point[0]), sy(point[1])); else g.moveTo(sx(point[0]), sy(point[1]));
      drawing = true;
    }
    g.stroke();
    const shown = points.filter(Boolean);
    if (shown.length <= 80) for (const point of shown) {
      g.beginPath(); g.arc(sx(point[0]), sy(point[1]), 2.4, 0, 2 * Math.PI); g.fill();
    }
  }

  legend(g, area) {
    let y = area.top + 4;
    g.textAlign = "right";
    for (const series of this.series) {
      g.fillStyle = series.color; g.fillRect(area.right - 10, y, 10, 3);
      g.fillStyle = "#1d2433"; g.fillText(series.name, area.right - 14, y + 5);
      y += 15;
    }
    g.textAlign = "left";
  }

  hover(event) {
    if (!this.layout) return;
    const { area, range, sx } = this.layout;
    const box = this.canvas.getBoundingClientRect();
    const px = event.clientX - box.left;
    if (px < area.left || px > area.right) { this.tip.style.display = "none"; return; }
    const x = range.x0 + (px - area.left) / (area.right - area.left) * (range.x1 - range.x0);
    const lines = [];
    this.series.forEach((series) => {
      const i = nearest(series.x, x);
      if (i >= 0 && series.y[i] !== null && series.y[i] !== undefined) {
        lines.push(`${this.series.length > 1 ? series.name + ": " : ""}${Lockstep.number(series.y[i], 6)} @ ${series.x[i]}`);
      }
    });
    if (!lines.length) { this.tip.style.display = "none"; return; }
    this.tip.textContent = lines.join("\n");
    this.tip.style.display = "block";
    this.tip.style.left = `${Math.min(sx(x) + 12, area.right - 150)}px`;
    this.tip.style.top = `${event.clientY - box.top + 10}px`;
  }
}

// Round numbers between lo and hi, about `count` of them (steps of 1, 2 or 5 times a power of 10).
function ticks(lo, hi, count) {
  const raw = (hi - lo) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => raw <= s) || 10 * power;
  const found = [];
  for (let value = Math.ceil(lo / step) * step; value <= hi + step * 1e-9; value += step) {
    found.push(Math.abs(value) < step * 1e-9 ? 0 : Number(value.toPrecision(12)));
  }
  return found;
}

// The position in sorted xs nearest to x (-1 when empty).
function nearest(xs, x) {
  if (!xs.length) return -1;
  let lo = 0, hi = xs.length - 1;
  while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (xs[mid] < x) lo = mid; else hi = mid; }
  return Math.abs(xs[lo] - x) <= Math.abs(xs[hi] - x) ? lo : hi;
}
