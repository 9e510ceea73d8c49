// Runs page: rows update (and new runs appear) as the store changes.
"use strict";

(function () {
  const Q = window.Quorum;
  const table = document.getElementById("runs-table");
  if (!table || !window.EventSource) return;
  const filter = table.dataset.statusFilter;
  const firstPage = table.dataset.page === "1";  // new runs appear on the first page only
  // The task metric the page's columns are named after ("" when the runs listed mix tasks: each cell names its own).
  const shared = table.dataset.metric;
  const source = new EventSource("/api/events?since=" + encodeURIComponent(table.dataset.since));
  source.addEventListener("open", () => Q.live("live"));
  source.addEventListener("error", () => Q.live("stale"));
  source.addEventListener("run", (event) => {
    const message = JSON.parse(event.data);
    update(message.run, message.display);
  });
  source.addEventListener("counts", (event) => {
    const message = JSON.parse(event.data);
    document.querySelectorAll("[data-count-of]").forEach((chip) => {
      const status = chip.dataset.countOf;
      chip.textContent = String(status ? message.counts[status] || 0 : message.total);
    });
  });

  function update(run, display) {
    let row = table.querySelector('tr[data-run-id="' + CSS.escape(run.id) + '"]');
    if (filter && run.status !== filter) {
      if (row) row.remove();
      return;
    }
    if (!row) {
      if (!firstPage) return;
      row = buildRow(run, display);
      table.tBodies[0].prepend(row);
      table.closest(".table-wrap").hidden = false;
      document.getElementById("runs-empty").hidden = true;
    }
    Q.setFields(row, display);
    Q.statusBadge(row.querySelector('[data-field="status"]'), run.status);
    Q.setProgress(row.querySelector(".progress"), run.rounds_done, run.rounds_total);
  }

  function buildRow(run, display) {
    const row = Q.el("tr", { "data-run-id": run.id, className: "new-row" });
    const name = Q.el("td");
    name.appendChild(Q.el("a", { className: "run-name", href: "/runs/" + encodeURIComponent(run.id) }, run.name));
    name.appendChild(Q.el("div", { className: "mono muted small" }, run.id));
    const status = Q.el("td");
    status.appendChild(Q.el("span", { className: "badge", "data-field": "status" }));
    const rounds = Q.el("td");
    const cell = rounds.appendChild(Q.el("div", { className: "rounds-cell" }));
    cell.appendChild(Q.el("span", { "data-field": "rounds" }, display.rounds));
    cell.appendChild(Q.progress(run.rounds_done, run.rounds_total));
    const named = !shared || (run.metric && run.metric.name !== shared);
    const best = named ? "best_metric_named" : "best_metric";
    const last = named ? "last_metric_named" : "last_metric";
    row.append(name, status, Q.el("td", {}, run.strategy), rounds,
      Q.el("td", { className: "num strong", "data-field": best }, display[best]),
      Q.el("td", { className: "num", "data-field": last }, display[last]),
      Q.el("td", { className: "nowrap" }, display.started_at),
      Q.el("td", { className: "num nowrap", "data-field": "duration" }, display.duration));
    return row;
  }
})();
