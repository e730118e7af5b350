/* Draws the Checkpoints page charts with uPlot from the JSON block #ckpt-data.
 * No inline script anywhere: the page's CSP is script-src 'self'. x = created time. */
(function () {
  "use strict";
  var COLORS = {
    "state size": "#1f77b4", "bytes uploaded": "#ff7f0e", "events/s": "#2ca02c",
    restore: "#8c564b", process: "#1f77b4", timers: "#9467bd", snapshot: "#17becf",
    upload: "#ff7f0e", commit: "#7f7f7f", total: "#d62728"
  };
  var EXTRA = ["#d62728", "#bcbd22", "#e377c2", "#2ca02c", "#8c564b", "#9467bd"];
  // chart -> value formatter and whether its series stack (parts of one total)
  var KINDS = {
    state_size: {fmt: bytes, stacked: false}, bytes_uploaded: {fmt: bytes, stacked: false},
    duration: {fmt: seconds, stacked: true}, events_per_s: {fmt: count, stacked: false},
    rejects: {fmt: count, stacked: true}
  };

  function bytes(v) {
    if (v == null) return "–";
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i === 0 ? v.toFixed(0) : v.toFixed(1)) + " " + units[i];
  }
  function seconds(v) {
    if (v == null) return "–";
    return v < 1 ? (v * 1000).toFixed(0) + " ms" : v < 120 ? v.toFixed(1) + " s"
      : (v / 60).toFixed(1) + " min";
  }
  function count(v) {
    if (v == null) return "–";
    return Math.abs(v) >= 1e6 ? (v / 1e6).toFixed(1) + "M" : Math.abs(v) >= 1e4 ?
      (v / 1e3).toFixed(1) + "k" : String(Math.round(v * 10) / 10);
  }
  function color(name, i) { return COLORS[name] || EXTRA[i % EXTRA.length]; }
  // Stacked bands are opaque (a lighter tint) so one band never shows through another.
  function fill(hex, stacked) {
    if (!stacked) return hex + "55";
    var n = parseInt(hex.slice(1), 16), out = "#";
    [16, 8, 0].forEach(function (s) {
      var v = Math.round(((n >> s) & 255) * 0.55 + 255 * 0.45);
      out += (v < 16 ? "0" : "") + v.toString(16);
    });
    return out;
  }

  // Stacked: series i shows the sum of parts 0..i, drawn top-down so each band is one part;
  // the legend shows the part's own value.
  function stack(names, cols) {
    var sums = [], acc = cols[names[0]].map(function () { return null; });
    names.forEach(function (n) {
      acc = acc.map(function (a, j) {
        var v = cols[n][j];
        return v == null ? a : (a == null ? 0 : a) + v;
      });
      sums.push(acc.slice());
    });
    return sums;
  }

  function draw(el, job, name, charts) {
    var cols = charts[name], kind = KINDS[name];
    var names = Object.keys(cols);
    var t = charts.t, labels = charts.labels;
    var values = kind.stacked && names.length > 1 ? stack(names, cols)
      : names.map(function (n) { return cols[n]; });
    var order = names.map(function (_, i) { return i; });
    if (kind.stacked && names.length > 1) order.reverse();
    var series = [{label: "checkpoint", value: function (u, v, si, i) {
      return i == null ? "–" : labels[i] + " " + new Date(v * 1000).toISOString()
        .slice(0, 16).replace("T", " ");
    }}];
    var data = [t];
    order.forEach(function (i) {
      var c = color(names[i], i);
      series.push({
        label: names[i], stroke: c, width: 2, fill: kind.stacked || names.length === 1 ?
          fill(c, kind.stacked && names.length > 1) : undefined, spanGaps: false, points: {show: t.length <= 40, size: 5},
        value: function (u, v, si, idx) {
          return idx == null ? "–" : kind.fmt(cols[names[i]][idx]);
        }
      });
      data.push(values[i]);
    });
    el.textContent = "";
    var width = Math.max(320, el.clientWidth || 440);
    var plot = new uPlot({
      width: width, height: 190, series: series, scales: {x: {time: true}},
      axes: [{}, {size: 64, values: function (u, vals) { return vals.map(kind.fmt); }}],
      legend: {live: true}, cursor: {drag: {x: true, y: false}}
    }, data, el);
    el.setAttribute("data-drawn", String(t.length));
    return plot;
  }

  function main() {
    var block = document.getElementById("ckpt-data");
    if (!block || typeof uPlot === "undefined") return;
    var data = JSON.parse(block.textContent);
    data.jobs.forEach(function (job) {
      Object.keys(KINDS).forEach(function (name) {
        var el = document.getElementById("chart-" + job.job + "-" + name);
        var cols = job.charts[name] || {};
        var any = Object.keys(cols).some(function (n) {
          return cols[n].some(function (v) { return v != null; });
        });
        if (el && any) draw(el, job.job, name, job.charts);  // else: "no data yet" stays
      });
    });
    document.body.setAttribute("data-charts", "ready");
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", main);
  else main();
})();
