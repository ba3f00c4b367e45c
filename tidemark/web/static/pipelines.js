// Tidemark pipelines: draws each [data-chart] element's series with uPlot (shipped with the
// package in this folder; nothing comes from a CDN). The data are the element's JSON
// attribute: {title, unit, kind: line|bars|points, x: [unix seconds], series: [{label, values}]}.
(function () {
  "use strict";
  var COLORS = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#0a7ea4",
                "#6e7781", "#e16f24", "#2da44e"];
  var dark = window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches;
  var AXIS = dark ? "#9198a1" : "#59636e";
  var GRID = dark ? "#3d444d" : "#e6e9ec";

  function compact(v) {
    if (v == null) return "";
    var a = Math.abs(v);
    if (a >= 1e9) return (v / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
    if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "k";
    if (a > 0 && a < 1) return v.toFixed(2);
    return String(Math.round(v * 10) / 10);
  }

  function pad(n) { return n < 10 ? "0" + n : String(n); }

  // A small chart's time labels on one line, in UTC like the rest of the page: seconds when
  // the axis spans minutes, hours and minutes when it spans up to two days, else the date.
  function smallTimes(range) {
    var span = range ? range[1] - range[0] : 86400;
    return function (u, splits) {
      return splits.map(function (ts) {
        var d = new Date(ts * 1000);
        var hm = pad(d.getUTCHours()) + ":" + pad(d.getUTCMinutes());
        if (span < 900) return hm + ":" + pad(d.getUTCSeconds());
        if (span <= 2 * 86400) return hm;
        return (d.getUTCMonth() + 1) + "/" + d.getUTCDate();
      });
    };
  }

  function empty(el, text) {
    var d = document.createElement("div");
    d.className = "empty";
    d.textContent = text;
    el.appendChild(d);
  }

  // One time axis for every chart of the page (small multiples compare only on the same
  // axis): from the first point of any chart to the last, at least 2 minutes wide.
  function pageRange(specs) {
    var lo = Infinity, hi = -Infinity;
    specs.forEach(function (s) {
      if (s && s.x.length) { lo = Math.min(lo, s.x[0]); hi = Math.max(hi, s.x[s.x.length - 1]); }
    });
    if (lo === Infinity) return null;
    if (hi - lo < 120) { var mid = (lo + hi) / 2; lo = mid - 60; hi = mid + 60; }
    var pad = (hi - lo) * 0.02;
    return [lo - pad, hi + pad];
  }

  function draw(el, spec, range) {
    if (!spec) return;
    var small = el.classList.contains("small");
    var hasData = spec.x.length && spec.series.some(function (s) {
      return s.values.some(function (v) { return v != null; });
    });
    if (!small) {
      var t = document.createElement("div");
      t.className = "title";
      t.textContent = spec.title;
      el.appendChild(t);
    }
    if (!hasData) {
      empty(el, spec.empty);
      return;
    }
    var bars = spec.kind === "bars" && uPlot.paths && uPlot.paths.bars;
    var series = [{}].concat(spec.series.map(function (s, i) {
      var c = COLORS[i % COLORS.length];
      var o = { label: s.label, stroke: c, width: 1.5, spanGaps: false,
                value: function (u, v) { return v == null ? "-" : compact(v) + " " + spec.unit; } };
      if (spec.kind === "points") {
        o.paths = function () { return null; };
        o.points = { show: true, size: 5, stroke: c, fill: c };
      } else if (bars) {
        o.paths = uPlot.paths.bars({ size: [0.8, 40], align: 0 });
        o.fill = c + "aa";
        o.points = { show: false };
      } else {
        o.points = { show: spec.x.length < 60, size: 4 };
      }
      return o;
    }));
    var data = [spec.x].concat(spec.series.map(function (s) { return s.values; }));
    var height = small ? 110 : (el.clientHeight || 230) - 22;
    var opts = {
      width: Math.max(el.clientWidth, 120),
      height: height,
      series: series,
      legend: { show: !small || spec.series.length > 1, live: !small },
      cursor: { show: true, points: { size: 6 } },
      scales: { x: { time: true, range: function () { return range; } }, y: { range: function (u, lo, hi) {
        return [Math.min(0, lo), hi > 0 ? hi * 1.1 : 1];
      } } },
      axes: [
        { stroke: AXIS, grid: { stroke: GRID, width: 1 }, ticks: { stroke: GRID },
          size: small ? 24 : 44, font: (small ? "10px" : "11px") + " system-ui, sans-serif" },
        { stroke: AXIS, grid: { stroke: GRID, width: 1 }, ticks: { stroke: GRID },
          size: small ? 38 : 52, font: (small ? "10px" : "11px") + " system-ui, sans-serif",
          values: function (u, vals) { return vals.map(compact); } }
      ]
    };
    // The page says "All times UTC": the axes too, whatever the browser's time zone.
    opts.tzDate = function (ts) { return uPlot.tzDate(new Date(ts * 1e3), "Etc/UTC"); };
    if (small) {
      opts.axes[0].values = smallTimes(range);
      opts.legend = { show: false };
      opts.title = undefined;
    }
    var plot = new uPlot(opts, data, el);
    el.tmPlot = plot;
    el.setAttribute("data-drawn", String(spec.x.length));
  }

  function resize() {
    document.querySelectorAll("[data-drawn]").forEach(function (el) {
      if (el.tmPlot) el.tmPlot.setSize({ width: Math.max(el.clientWidth, 120),
                                          height: el.tmPlot.height });
    });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var els = Array.prototype.slice.call(document.querySelectorAll("[data-chart]"));
    var specs = els.map(function (el) {
      try { return JSON.parse(el.getAttribute("data-chart")); } catch (e) { return null; }
    });
    var range = pageRange(specs);
    els.forEach(function (el, i) { draw(el, specs[i], range); });
    var pending;
    window.addEventListener("resize", function () {
      clearTimeout(pending);
      pending = setTimeout(resize, 150);
    });
  });
})();
