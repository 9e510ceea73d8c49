// Run page: charts from the rounds committed so far, then new rounds pushed live.
"use strict";

(function () {
  const Q = window.Quorum;
  const data = JSON.parse(document.getElementById("run-data").textContent);
  const run = data.run;
  const rounds = data.rounds;
  const table = document.getElementById("rounds-table");
  const keys = Array.from(table.tHead.rows[0].cells, (th) => th.dataset.key);
  const plotly = window.Plotly;
  // The task's headline metric (accuracy, c_index, mae, ...): charted first, and beside the bytes moved.
  const metric = (run.metric && run.metric.name) || "accuracy";
  const isFraction = metric === "accuracy";
  const metricAxis = isFraction ? { tickformat: ".0%", rangemode: "tozero" } : {};

  const COLORS = {
    server: "#4f46e5", fed: "#0ea5e9", train: "#f59e0b", sampled: "#6b7280",
    ok: "#22c55e", dropped: "#f59e0b", rejected: "#ef4444", failed: "#991b1b", in: "#6366f1", out: "#14b8a6",
    duration: "#64748b", epsilon: "#a855f7",
  };
  const STAGE_COLORS = ["#4f46e5", "#0ea5e9", "#14b8a6", "#f59e0b", "#ef4444", "#a855f7", "#64748b"];
  const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d"] };

  draw();
  if (run.status === "running" && window.EventSource) connect();

  // -- live ----------------------------------------------------------------
  function connect() {
    const after = rounds.length ? rounds[rounds.length - 1].round : 0;
    const url = "/api/runs/" + encodeURIComponent(run.id) + "/events?after=" + after;
    const source = new EventSource(url);
    source.addEventListener("open", () => Q.live("live"));
    source.addEventListener("error", () => Q.live("stale"));
    source.addEventListener("round", (event) => {
      const message = JSON.parse(event.data);
      addRound(message.round, message.display);
    });
    source.addEventListener("run", (event) => {
      const message = JSON.parse(event.data);
      updateRun(message.run, message.display);
      if (Q.TERMINAL.has(message.run.status)) {
        source.close();
        Q.live("off");
      }
    });
    source.addEventListener("gone", () => { source.close(); Q.live("off"); });
  }

  function addRound(round, display) {
    if (rounds.length && round.round <= rounds[rounds.length - 1].round) return;
    rounds.push(round);
    table.tBodies[0].prepend(roundRow(round, display));
    document.getElementById("rounds-empty").hidden = true;
    document.getElementById("rounds-count").textContent = rounds.length + " committed";
    document.getElementById("download-checkpoint").hidden = false;
    scheduleDraw();
  }

  // The table shows a new round at once; charts redraw on the next frame, once per burst.
  let drawPending = false;
  function scheduleDraw() {
    if (drawPending) return;
    drawPending = true;
    requestAnimationFrame(() => { drawPending = false; draw(); });
  }

  function roundRow(round, display) {
    const row = Q.el("tr", { "data-round": round.round, className: "new-row" });
    for (const key of keys) {
      const cell = Q.el("td", { className: key === "round" || key === "started_at" ? "nowrap" : "num" });
      if (key === "round") {
        const href = "/runs/" + encodeURIComponent(run.id) + "/rounds/" + round.round;
        cell.appendChild(Q.el("a", { href: href }, "Round " + round.round));
      } else {
        cell.textContent = display[key];
      }
      if (key === "dropped" && round.dropped) cell.classList.add("warn");
      if (key === "rejected" && round.rejected) cell.classList.add("bad");
      if (key === "failed" && round.failed) cell.classList.add("bad");
      if (key === "server_metric") cell.classList.add("strong");
      if (key === "task_metrics") cell.className = "small mono";
      row.appendChild(cell);
    }
    return row;
  }

  function updateRun(next, display) {
    Q.setFields(document, display);
    Q.statusBadge(document.querySelector('.page-head [data-field="status"]'), next.status);
    Q.setProgress(document.querySelector(".run-progress .progress"), next.rounds_done, next.rounds_total);
    if (next.error && !document.querySelector(".alert.error")) {
      const alert = Q.el("div", { className: "alert error" });
      alert.appendChild(Q.el("strong", {}, next.status.replace(/_/g, " ") + ": "));
      alert.appendChild(Q.el("span", {}, next.error));
      document.querySelector(".run-progress").after(alert);
    }
  }

  // -- charts --------------------------------------------------------------
  function draw() {
    if (!plotly) {
      document.getElementById("charts-missing").hidden = false;
      return;
    }
    const x = rounds.map((r) => r.round);
    const col = (key) => rounds.map((r) => r[key]);
    // An asynchronous (FedBuff) run's steps carry their time, virtual or wall: accuracy and loss are drawn against it.
    const timed = (key) => {
      const values = rounds.map((r) => (r.metrics || {})[key]);
      return values.length > 0 && values.every((v) => typeof v === "number" && Number.isFinite(v)) ? values : null;
    };
    const virtualClock = timed("virtual-time-s");
    const clock = virtualClock || timed("wall-time-s");
    const tx = clock || x;
    const timeAxis = clock ? { xaxis: { title: { text: virtualClock ? "virtual time (s)" : "wall time (s)" },
                                        ticksuffix: " s", gridcolor: "#eef0f3", zeroline: false,
                                        rangemode: "tozero" } } : {};
    plot("chart-accuracy", [
      line("server", tx, score("server", metric), COLORS.server),
      line("federated", tx, score("federated", metric), COLORS.fed),
    ], { yaxis: metricAxis, ...timeAxis });
    plot("chart-loss", [
      line("train", tx, col("train_loss"), COLORS.train),
      line("federated", tx, col("fed_loss"), COLORS.fed),
      line("server", tx, col("server_loss"), COLORS.server),
    ], { yaxis: { rangemode: "tozero" }, ...timeAxis });
    plot("chart-clients", [
      bar("answered", x, col("answered"), COLORS.ok),
      bar("dropped", x, col("dropped"), COLORS.dropped),
      bar("rejected", x, col("rejected"), COLORS.rejected),
      bar("failed", x, col("failed"), COLORS.failed),
      line("sampled", x, col("sampled"), COLORS.sampled, { line: { dash: "dot", width: 2 } }),
    ], { barmode: "stack", legend: { traceorder: "normal" }, yaxis: { rangemode: "tozero", tickformat: "d" } });
    plot("chart-duration", [bar("round duration", x, col("duration_s"), COLORS.duration)],
      { showlegend: false, yaxis: { ticksuffix: " s", rangemode: "tozero" } });
    plot("chart-traffic", [
      bar("in (from clients)", x, col("bytes_in"), COLORS.in),
      bar("out (to clients)", x, col("bytes_out"), COLORS.out),
    ], { barmode: "group", yaxis: { tickformat: ".2s", ticksuffix: "B", rangemode: "tozero" } });
    drawBytes();
    drawOptional(x);
  }

  /** A task score of each round on one split ("server", "federated"); null where the round has none. */
  function score(split, name) {
    return rounds.map((r) => {
      const v = ((r.scores || {})[split] || {})[name];
      return typeof v === "number" && Number.isFinite(v) ? v : null;
    });
  }

  /** The headline metric against cumulative bytes on the wire (uplink, and uplink + downlink): what compression buys. */
  function drawBytes() {
    let up = 0, both = 0;
    const upX = [], bothX = [], acc = [];
    for (const r of rounds) {
      up += Number(r.bytes_in) || 0;
      both += (Number(r.bytes_in) || 0) + (Number(r.bytes_out) || 0);
      upX.push(up);
      bothX.push(both);
      acc.push(r.metric ?? null);
    }
    plot("chart-bytes", [
      line("vs uplink bytes", upX, acc, COLORS.in),
      line("vs total bytes", bothX, acc, COLORS.out, { line: { dash: "dot", width: 2 } }),
    ], { xaxis: { title: { text: "cumulative bytes" }, tickformat: ".2s", ticksuffix: "B", gridcolor: "#eef0f3",
                  zeroline: false, rangemode: "tozero" },
         yaxis: metricAxis });
  }

  /** An asynchronous run's staleness histogram: how many folded replies were s server steps old, over all steps. */
  function drawStaleness() {
    const totals = [];
    for (const r of rounds) {
      const counts = (r.metrics || {})["staleness-counts"];
      if (!Array.isArray(counts)) continue;
      counts.forEach((n, s) => { totals[s] = (totals[s] || 0) + (Number.isFinite(n) ? n : 0); });
    }
    if (!totals.length) return;
    document.getElementById("panel-staleness").hidden = false;
    const staleness = totals.map((_, s) => s);
    plot("chart-staleness", [bar("folded replies", staleness, totals.map((n) => n || 0), COLORS.in)],
      { showlegend: false, xaxis: { title: { text: "staleness (server steps behind)" }, tickformat: "d",
                                     dtick: 1, gridcolor: "#eef0f3" },
        yaxis: { rangemode: "tozero", tickformat: "d" } });
  }

  function drawOptional(x) {
    drawStaleness();
    const eps = rounds.map((r) => r.epsilon);
    if (eps.some((v) => v !== null)) {
      document.getElementById("panel-epsilon").hidden = false;
      plot("chart-epsilon", [line("ε", x, eps, COLORS.epsilon, { fill: "tozeroy" })],
        { showlegend: false, yaxis: { rangemode: "tozero" } });
    }
    const stages = secaggSeries();
    if (stages.length) {
      document.getElementById("panel-secagg").hidden = false;
      plot("chart-secagg", stages.map(([name, values], i) =>
        line(name, x, values, STAGE_COLORS[i % STAGE_COLORS.length])), { yaxis: { rangemode: "tozero" } });
    }
    const tasks = taskMetricSeries();
    if (tasks.length) {
      document.getElementById("panel-task-metrics").hidden = false;
      plot("chart-task-metrics", tasks.map(([name, values], i) =>
        line(name, x, values, STAGE_COLORS[i % STAGE_COLORS.length])), {});
    }
    const metrics = roundMetricSeries();
    if (metrics.length) {
      document.getElementById("panel-metrics").hidden = false;
      plot("chart-metrics", metrics.map(([name, values], i) =>
        line(name, x, values, STAGE_COLORS[i % STAGE_COLORS.length])), {});
    }
  }

  /** ["fed mae", value per round] for every task score besides the headline and the loss (they have charts). */
  function taskMetricSeries() {
    const series = [];
    for (const [split, short] of [["server", "server"], ["federated", "fed"]]) {
      const names = [];
      for (const r of rounds) {
        for (const k of Object.keys((r.scores || {})[split] || {})) {
          if (k !== metric && k !== "loss" && !names.includes(k)) names.push(k);
        }
      }
      for (const name of names.sort()) series.push([escapeLabel(short + " " + name), score(split, name)]);
    }
    return series;
  }

  /** Whether a round metric is one of the task's scores ("fed-mae", "server-r2": the task metrics chart has it). */
  function isTaskScore(r, key) {
    const scores = r.scores || {};
    if (key.startsWith("fed-")) return key.slice(4) in (scores.federated || {});
    if (key.startsWith("server-")) return key.slice(7) in (scores.server || {});
    return false;
  }

  /** [metric name, value per round] for every other numeric round metric (the strategy's, the evaluation's traffic). */
  function roundMetricSeries() {
    const names = [];
    const numeric = (v) => typeof v === "number" && Number.isFinite(v);
    for (const r of rounds) {
      for (const [k, v] of Object.entries(r.metrics || {})) {
        if (numeric(v) && !names.includes(k) && !isTaskScore(r, k)) names.push(k);
      }
    }
    return names.sort().map((name) => [escapeLabel(name), rounds.map((r) => {
      const v = (r.metrics || {})[name];
      return numeric(v) ? v : null;
    })]);
  }

  /** [stage name, completed per round] for whatever stages the rounds recorded. */
  function secaggSeries() {
    const names = [];
    const stagesOf = (r) => (r.secagg && Array.isArray(r.secagg.stages) ? r.secagg.stages : [])
      .filter((s) => s && typeof s === "object" && s.stage !== undefined && s.stage !== null);
    for (const r of rounds) {
      for (const s of stagesOf(r)) if (!names.includes(String(s.stage))) names.push(String(s.stage));
    }
    return names.map((name) => [escapeLabel(name), rounds.map((r) => {
      const stage = stagesOf(r).find((s) => String(s.stage) === name);
      return stage && typeof stage.completed === "number" ? stage.completed : null;
    })]);
  }

  /** Plotly reads a few HTML-like tags in labels; show recorded names literally. */
  function escapeLabel(text) {
    return text.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
  }

  function line(name, x, y, color, extra) {
    const trace = {
      type: "scatter", mode: "lines+markers", name: name, x: x, y: y, connectgaps: true,
      line: { color: color, width: 2 }, marker: { color: color, size: 6 },
    };
    const { line: lineStyle, ...rest } = extra || {};
    Object.assign(trace, rest);
    Object.assign(trace.line, lineStyle || {});
    return trace;
  }

  function bar(name, x, y, color) {
    return { type: "bar", name: name, x: x, y: y, marker: { color: color } };
  }

  function plot(id, traces, layout) {
    const last = rounds.length ? rounds[rounds.length - 1].round : 0;
    const base = {
      margin: { l: 56, r: 16, t: 8, b: 44 }, height: document.getElementById(id).clientHeight || 280,
      font: { family: "system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size: 12, color: "#374151" },
      paper_bgcolor: "rgba(0,0,0,0)", plot_bgcolor: "rgba(0,0,0,0)", hovermode: "x unified",
      legend: { orientation: "h", x: 0, y: 1.02, yanchor: "bottom" }, uirevision: id,
      xaxis: { title: { text: "round" }, gridcolor: "#eef0f3", zeroline: false, tickformat: "d",
               dtick: last > 12 ? undefined : 1, range: [0.5, Math.max(last, 1) + 0.5] },
    };
    const merged = Object.assign({}, base, layout);
    merged.legend = Object.assign({}, base.legend, layout.legend || {});
    merged.yaxis = Object.assign({ gridcolor: "#eef0f3", zeroline: false }, layout.yaxis || {});
    plotly.react(id, traces, merged, CONFIG);
  }
})();
