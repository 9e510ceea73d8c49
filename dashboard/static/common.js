// Shared helpers. Text from the store is only ever set with textContent.
"use strict";

window.Quorum = (function () {
  const TERMINAL = new Set(["finished", "degraded", "failed", "stopped_budget", "interrupted"]);

  /** Create an element; `text` becomes its textContent, never markup. */
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "className") node.className = value;
      else node.setAttribute(name, value);
    }
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  /** Set every [data-field] under `root` whose name is a key of `values`. */
  function setFields(root, values) {
    for (const node of root.querySelectorAll("[data-field]")) {
      const key = node.dataset.field;
      if (key === "status" || !(key in values)) continue;
      if (node.textContent !== values[key]) {
        node.textContent = values[key];
        flash(node);
      }
    }
  }

  function statusBadge(badge, status) {
    badge.className = "badge status-" + status;
    badge.textContent = status.replace(/_/g, " ");
  }

  function progress(done, total) {
    const outer = el("span", { className: "progress", title: done + " of " + total + " rounds" });
    const bar = el("span", { className: "progress-bar" });
    bar.style.width = (total ? (100 * done) / total : 0) + "%";
    outer.appendChild(bar);
    return outer;
  }

  function setProgress(outer, done, total) {
    const bar = outer && outer.querySelector(".progress-bar");
    if (!bar) return;
    bar.style.width = (total ? (100 * done) / total : 0) + "%";
    outer.title = done + " of " + total + " rounds";
  }

  function flash(node) {
    node.classList.remove("flash");
    void node.offsetWidth; // restart the animation
    node.classList.add("flash");
  }

  /** The header's live indicator: "live", "stale" (reconnecting) or "off". */
  function live(state) {
    const node = document.getElementById("live-indicator");
    if (!node) return;
    node.hidden = state === "off";
    node.classList.toggle("stale", state === "stale");
    node.querySelector(".live-text").textContent = state === "stale" ? "reconnecting" : "live";
  }

  return { TERMINAL, el, setFields, statusBadge, progress, setProgress, flash, live };
})();
