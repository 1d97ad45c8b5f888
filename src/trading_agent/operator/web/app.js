// The operator's web page: desks, a desk's live chat, approvals, an equity chart, the desk's
// own books (positions, open orders with a cancel button, trades, profit by day), and the
// operator's controls (pause and resume, cancel a turn, the kill switch, spend caps).
// Plain JS, no build step. Talks to the operator API on the same origin; over TCP the token
// comes from the URL fragment (#token=...), is kept in sessionStorage, and is sent as a
// bearer header; the EventSource, which cannot set headers, opens the stream with a ticket
// from POST /api/stream-ticket (valid a minute), never the token. The page shows only the
// controls the operator's role allows (GET /api/me; elements marked data-needs).
"use strict";

(() => {
  const state = {
    token: null,
    operator: "web",
    desks: new Map(),         // name -> status
    selected: null,           // desk name
    turns: new Map(),         // turn id -> {el, body, lastText, steps: Map(call_id -> el)}
    approvals: new Map(),     // approval id -> approval
    source: null,             // EventSource
    equity: [],               // the selected desk's stored samples: [[time, equity], ...]
    equityDesk: null,         // the desk they belong to
    refreshTimer: null,
    halts: [],                // the kill switches that are on: [{scope, by, at, reason, text}]
    lastEventId: null,        // the newest event seen, to resume the stream from
    role: "viewer",           // the operator's role, from /api/me
  };

  const $ = (id) => document.getElementById(id);

  // ------------------------------------------------------------------ helpers

  function readAuth() {
    const fragment = new URLSearchParams(location.hash.slice(1));
    if (fragment.get("token")) sessionStorage.setItem("trading-agent-token", fragment.get("token"));
    if (fragment.get("operator")) sessionStorage.setItem("trading-agent-operator", fragment.get("operator"));
    if (location.hash) history.replaceState(null, "", location.pathname + location.search);
    state.token = sessionStorage.getItem("trading-agent-token");
    state.operator = sessionStorage.getItem("trading-agent-operator") || "web";
  }

  async function api(path, options = {}) {
    const headers = { "X-Operator-Surface": "web" };
    if (state.token) headers.Authorization = "Bearer " + state.token;
    const init = { method: options.method || "GET", headers };
    if (options.body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(options.body);
    }
    const response = await fetch(path, init);
    let data = null;
    try { data = await response.json(); } catch (_) { data = null; }
    if (!response.ok) {
      const error = new Error(data && data.error ? data.error.message : response.statusText);
      error.status = response.status;
      if (data && data.error && "kept" in data.error) error.kept = data.error.kept;
      throw error;
    }
    return data;
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function money(value) {
    if (value === null || value === undefined || Number.isNaN(Number(value))) return "–";
    return Number(value).toLocaleString("en-US", { minimumFractionDigits: 2, maximumFractionDigits: 2 });
  }

  function ago(seconds) {
    if (typeof seconds !== "number") return "never";
    const s = Math.max(0, Date.now() / 1000 - seconds);
    if (s < 60) return `${Math.round(s)}s ago`;
    if (s < 3600) return `${Math.round(s / 60)}m ago`;
    if (s < 86400) return `${(s / 3600).toFixed(1)}h ago`;
    return `${(s / 86400).toFixed(1)}d ago`;
  }

  function clock(seconds) {
    const date = seconds ? new Date(seconds * 1000) : new Date();
    return date.toLocaleTimeString("en-GB", { hour12: false });
  }

  function utc(seconds) {
    return new Date(seconds * 1000).toISOString().slice(0, 16).replace("T", " ") + " UTC";
  }

  // One spend cap's use today, as "tokens 81% of 1,000,000" (the daemon's cap says so).
  function spendText(row) {
    const percent = Math.floor(Number(row.share) * 100 + 1e-9);  // 100% only once used up
    const cap = row.measure === "tokens" ? Number(row.cap).toLocaleString("en-US") : money(row.cap);
    return `${row.scope === "daemon" ? "daemon " : ""}${row.measure} ${percent}% of ${cap}`;
  }

  function spendLevel(row) {
    return row.share >= 1 ? "bad" : row.share >= 0.8 ? "warn" : "ok";
  }

  function shortArgs(raw) {
    let value = raw;
    if (typeof raw === "string") {
      try { value = JSON.parse(raw); } catch (_) { return raw.slice(0, 160); }
    }
    if (value && typeof value === "object" && !Array.isArray(value)) {
      return Object.entries(value).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ").slice(0, 160);
    }
    return JSON.stringify(value).slice(0, 160);
  }

  const OPERATOR_PREFIX = /^\[Message from ([^\]]*?), a human operator[^\]]*\]\n/;

  function setConnection(kind, text) {
    $("connection").dataset.state = kind;
    $("connection-text").textContent = text;
    document.body.dataset.live = kind === "live" ? "true" : "false";
  }

  // ------------------------------------------------------------------ desks

  async function loadDesks() {
    let data;
    let kills;
    try {
      // The switches are a detail of the desks: without them the desks still show.
      [data, kills] = await Promise.all([api("/api/desks"), api("/api/kill-switch").catch(() => null)]);
    } catch (error) {
      if (error.status === 401) {
        $("auth-note").hidden = false;
        setConnection("error", "token needed");
      }
      throw error;
    }
    $("auth-note").hidden = true;
    state.desks = new Map(data.desks.map((d) => [d.name, d]));
    if (kills) state.halts = kills.halts;
    renderDeskList();
    renderKillSwitch($("kill-all"), "*");
    if (!state.selected || !state.desks.has(state.selected)) {
      const wanted = new URLSearchParams(location.search).get("desk");
      const first = data.desks.length ? data.desks[0].name : null;
      await selectDesk(state.desks.has(wanted) ? wanted : first);
    } else {
      renderDeskHead();
      drawEquity();  // the chart ends with the equity the header now shows
    }
  }

  function scheduleRefresh() {
    if (state.refreshTimer) return;
    state.refreshTimer = setTimeout(() => {
      state.refreshTimer = null;
      loadDesks().catch(() => {});
    }, 250);
  }

  function renderDeskList() {
    const list = $("desks");
    list.replaceChildren();
    for (const desk of state.desks.values()) {
      const item = el("li", "desk-card");
      item.dataset.desk = desk.name;
      item.dataset.state = desk.state;
      if (desk.name === state.selected) item.classList.add("selected");
      const top = el("div", "desk-card-top");
      top.append(el("span", "desk-card-name", desk.name), el("span", `badge badge-${desk.state}`, desk.state));
      if (desk.reduce_only) top.append(el("span", "badge badge-reduce-only", "reduce-only"));
      const figures = el("div", "desk-card-figures");
      figures.append(el("span", "equity", money(desk.equity)), el("span", "muted", `${desk.mode} · ${ago(desk.last_turn_at)}`));
      item.append(top, figures);
      if (desk.pending_approvals > 0) {
        item.append(el("div", "chip chip-warn", `${desk.pending_approvals} approval${desk.pending_approvals > 1 ? "s" : ""} waiting`));
      }
      if (desk.kill_switch) {
        item.dataset.kill = "on";
        item.append(el("div", "desk-card-kill", `⛔ ${desk.kill_switch}`));
      }
      if (desk.paused_reason) item.append(el("div", "desk-card-note", desk.paused_reason));
      for (const row of desk.spend || []) {
        const line = el("div", `spend spend-${spendLevel(row)}`);
        const bar = el("span", "spend-bar");
        const fill = el("i");
        fill.style.width = `${Math.min(100, Number(row.share) * 100)}%`;
        bar.append(fill);
        line.append(bar, el("span", null, spendText(row)));
        item.append(line);
      }
      item.addEventListener("click", () => selectDesk(desk.name));
      list.append(item);
    }
  }

  // The share of today's prompt tokens the model's server served from its prompt cache.
  function cacheShare(cached, prompt) {
    if (!(Number(prompt) > 0)) return "–";
    const share = (100 * Math.min(Number(cached) || 0, Number(prompt))) / Number(prompt);
    return share > 0 && share < 1 ? "<1%" : `${Math.round(share)}%`;
  }

  function renderDeskHead() {
    const desk = state.desks.get(state.selected);
    if (!desk) return;
    $("desk-name").textContent = desk.name;
    const badge = $("desk-state");
    badge.hidden = false;
    badge.className = `badge badge-${desk.state}`;
    badge.textContent = desk.state;
    const mode = $("desk-mode");
    mode.hidden = false;
    mode.className = `badge badge-mode mode-${desk.mode}`;
    mode.textContent = desk.mode;
    const reduce = $("desk-reduce-only");
    reduce.hidden = !desk.reduce_only;
    reduce.title = desk.reduce_only ? desk.reduce_only.text : "";
    $("desk-model").textContent = [desk.model, (desk.symbols || []).join(", ")].filter(Boolean).join(" · ");
    const figures = [
      ["Equity", money(desk.equity)],
      ["Realized today", money(desk.realized_today)],
      ["Unrealized", money(desk.unrealized)],
      ["Open orders", String(desk.open_orders ?? 0)],
      ["Tokens today", Number(desk.tokens_today || 0).toLocaleString("en-US")],
      ["Cached prompt", cacheShare(desk.cached_tokens_today, desk.prompt_tokens_today)],
      ["Cost today", typeof desk.cost_today === "number" ? "$" + desk.cost_today.toFixed(2) : "–"],
      ["Last turn", ago(desk.last_turn_at)],
      ["Queued", String(desk.queued_triggers ?? 0)],
    ];
    const list = $("desk-figures");
    list.replaceChildren();
    for (const [name, value] of figures) {
      const box = el("div", "figure");
      box.append(el("dt", null, name), el("dd", null, value));
      list.append(box);
    }
    for (const row of desk.spend || []) {
      const box = el("div", `figure figure-wide spend-${spendLevel(row)}`);
      box.append(el("dt", null, `Spend cap · ${row.scope}`), el("dd", null, spendText(row)));
      list.append(box);
    }
    renderBanners(desk);
    renderControls(desk);
  }

  // What holds the desk back, in words: its kill switch (red) and why it is paused.
  function renderBanners(desk) {
    const box = $("desk-banners");
    box.replaceChildren();
    if (desk.kill_switch) {
      const everyDesk = !halt(desk.name) && halt("*");
      const banner = el("div", "banner banner-kill");
      banner.append(el("strong", null, `⛔ Kill switch on${everyDesk ? " (every desk)" : ""}: `),
        el("span", null, `${desk.kill_switch}. Every new order is refused before any exchange sees it.`));
      box.append(banner);
    }
    if (desk.reduce_only) {
      const banner = el("div", "banner banner-reduce-only");
      banner.append(el("strong", null, "⇲ Reduce-only: "),
        el("span", null, `${desk.reduce_only.text}. Orders that would open, grow or reverse a position are refused; orders that shrink one pass.`));
      box.append(banner);
    }
    if (desk.paused_reason) {
      const dropped = desk.dropped_triggers > 0 ? ` · ${desk.dropped_triggers} trigger${desk.dropped_triggers > 1 ? "s" : ""} dropped meanwhile` : "";
      box.append(el("div", "banner banner-paused", `⏸ ${desk.paused_reason}${dropped}`));
    }
  }

  async function selectDesk(name) {
    if (!name) return;
    if (name !== state.selected) {
      dismissConfirm($("desk-controls"));
      dismissConfirm($("books"));
    }
    state.selected = name;
    const url = new URL(location.href);
    url.searchParams.set("desk", name);
    history.replaceState(null, "", url.pathname + url.search);
    renderDeskList();
    renderDeskHead();
    state.turns.clear();
    $("log").replaceChildren();
    renderApprovals();
    await Promise.all([loadTranscript(name), loadEquity(), loadBooks(), loadPins()]);
  }

  // ------------------------------------------------------------------ standing instructions

  async function loadPins() {
    const name = state.selected;
    if (!name) return;
    let result;
    try {
      result = await api(`/api/desks/${encodeURIComponent(name)}/pins`);
    } catch (error) {
      $("pins").hidden = true;  // a daemon of a fleet keeps none yet
      return;
    }
    if (name !== state.selected) return;
    const list = $("pin-list");
    list.replaceChildren();
    for (const text of result.configured || []) {
      const item = el("li", "pin");
      item.append(el("span", "pin-text", text), el("span", "pin-meta", "from the config"));
      list.append(item);
    }
    for (const pin of result.pins) {
      const item = el("li", "pin");
      item.dataset.pinId = String(pin.id);
      const remove = el("button", "button ghost", "Remove");
      remove.type = "button";
      remove.addEventListener("click", () => unpin(name, pin.id, remove));
      item.append(el("span", "pin-text", pin.text),
        el("span", "pin-meta", `#${pin.id} by ${pin.by}, ${when(pin.at)} UTC`), remove);
      list.append(item);
    }
    const count = result.pins.length + (result.configured || []).length;
    $("pins-summary").textContent = count ? `${count} sent in every request` : "none";
    $("pins").hidden = false;
  }

  async function addPin(event) {
    event.preventDefault();
    const name = state.selected;
    const input = $("pin-text");
    if (!name || !input.value.trim()) return;
    $("pin-add").disabled = true;
    try {
      await api(`/api/desks/${encodeURIComponent(name)}/pins`, {
        method: "POST", body: { text: input.value, operator: state.operator },
      });
      input.value = "";
      await loadPins();
    } catch (error) {
      addNote(`Not pinned: ${error.message}`, "error");
    } finally {
      $("pin-add").disabled = false;
    }
  }

  async function unpin(name, id, button) {
    button.disabled = true;
    try {
      await api(`/api/desks/${encodeURIComponent(name)}/pins/${id}`, {
        method: "DELETE", body: { operator: state.operator },
      });
    } catch (error) {
      addNote(`Not unpinned: ${error.message}`, "error");
    }
    await loadPins();
  }

  // ------------------------------------------------------------------ the desk's books

  // Events after which the selected desk's positions, orders and trades are read again.
  const BOOK_EVENTS = new Set(["order_filled", "kill_switch", "reconciliation", "order_cancelled", "order_placed"]);
  // Tools whose result changes the books without a fill (an order left resting, a cancel).
  const ORDER_TOOLS = new Set(["place_order", "cancel_order"]);

  function signed(value) {
    const n = Number(value);
    return value === null || value === undefined || Number.isNaN(n) ? "" : n > 0 ? "up" : n < 0 ? "down" : "";
  }

  function cell(text, className) {
    return el("td", className || null, text === null || text === undefined || text === "" ? "–" : text);
  }

  function fillRows(table, rows, empty, columns) {
    const body = $(table).tBodies[0];
    body.replaceChildren();
    if (!rows.length) {
      const row = el("tr");
      const only = el("td", "empty", empty);
      only.colSpan = columns;
      row.append(only);
      body.append(row);
      return;
    }
    body.append(...rows);
  }

  function when(iso) {
    return iso ? String(iso).slice(0, 16).replace("T", " ") : "";
  }

  let booksTimer = null;
  function scheduleBooks() {
    if (booksTimer) return;
    booksTimer = setTimeout(() => { booksTimer = null; loadBooks().catch(() => {}); }, 250);
  }

  async function loadBooks() {
    const desk = state.selected;
    if (!desk) return;
    const path = `/api/desks/${encodeURIComponent(desk)}`;
    let positions, orders, trades, profit;
    try {
      [positions, orders, trades, profit] = await Promise.all([
        api(`${path}/positions`), api(`${path}/orders`), api(`${path}/trades`), api(`${path}/profit?period=daily`)]);
    } catch (_) {
      return;  // the next event or refresh reads them again
    }
    if (desk !== state.selected) return;
    $("books").hidden = false;
    $("books-none").hidden = positions.books;
    const s = profit.summary;
    $("books-summary").textContent = `realized today ${money(s.realized_today)} · all time ${money(s.realized_total)} · ` +
      `unrealized ${money(s.unrealized)} · ${s.trades_closed} closed, ${s.wins} won, ${s.open_trades} open`;
    fillRows("positions-table", positions.positions.map((p) => {
      const row = el("tr");
      row.dataset.symbol = p.symbol;
      row.append(cell(p.symbol), cell(p.side), cell(p.amount, "num"), cell(p.entry_price, "num"),
        cell(p.mark, "num"), cell(money(p.unrealized), `num ${signed(p.unrealized)}`));
      return row;
    }), "No open positions.", 6);
    fillRows("orders-table", orders.orders.map((o) => {
      const row = el("tr");
      const id = o.order_id || o.client_order_id;
      row.dataset.order = id;
      const action = el("td");
      if (o.order_id) {
        const cancel = el("button", "button ghost", "Cancel");
        cancel.type = "button";
        cancel.dataset.action = "cancel-order";
        cancel.dataset.needs = "trader";
        cancel.title = "Cancel this order on the exchange (asks first)";
        cancel.addEventListener("click", () => cancelOrder(desk, o));
        action.append(cancel);
      }
      row.append(cell(id), cell(o.symbol), cell(o.side), cell(o.type), cell(o.amount, "num"),
        cell(o.price, "num"), cell(o.filled, "num"), action);
      return row;
    }), "No open orders.", 8);
    fillRows("trades-table", trades.trades.slice().reverse().map((t) => {
      const row = el("tr");
      row.dataset.trade = String(t.id);
      row.append(cell(String(t.id)), cell(t.symbol), cell(t.side), cell(when(t.opened_at)),
        cell(t.open ? "open" : when(t.closed_at)), cell(t.amount, "num"), cell(t.entry_price, "num"),
        cell(t.exit_price, "num"), cell(money(t.profit), `num ${signed(t.profit)}`),
        cell(t.profit_percent, `num ${signed(t.profit_percent)}`));
      return row;
    }), "No trades yet.", 10);
    fillRows("profit-table", profit.rows.slice().reverse().map((r) => {
      const row = el("tr");
      row.dataset.day = r.day;
      row.append(cell(r.day), cell(money(r.realized), `num ${signed(r.realized)}`), cell(money(r.fees), "num"),
        cell(String(r.fills), "num"), cell(String(r.trades_closed), "num"));
      return row;
    }), "No fills yet.", 5);
  }

  // Asks, in the page, before an order is cancelled on the exchange (as flattening does).
  function confirmCancelOrder(order) {
    const box = $("books");
    dismissConfirm(box);
    const strip = $("order-confirm");
    const id = order.order_id;
    const yes = el("button", "button bad", `Cancel order ${id}`);
    yes.type = "button";
    yes.dataset.action = "confirm-cancel-order";
    const no = el("button", "button ghost", "Keep the order");
    no.type = "button";
    no.dataset.action = "keep-order";
    const actions = el("div", "confirm-actions");
    actions.append(yes, no);
    const price = order.price ? ` @ ${order.price}` : "";
    strip.replaceChildren(
      el("p", null, `Cancel ${order.side} ${order.type} ${order.amount} ${order.symbol}${price} ` +
        `(filled ${order.filled}) on the exchange now? What filled already stays filled.`),
      actions);
    strip.hidden = false;
    return new Promise((resolve) => {
      box.answerConfirm = (answer) => {
        box.answerConfirm = null;
        strip.hidden = true;
        strip.replaceChildren();
        resolve(answer);
      };
      yes.addEventListener("click", () => box.answerConfirm(true));
      no.addEventListener("click", () => box.answerConfirm(false));
      no.focus();
    });
  }

  async function cancelOrder(desk, order) {
    if (!(await confirmCancelOrder(order))) {
      addNote(`Order ${order.order_id} not cancelled: it was not confirmed.`, "note");
      return;
    }
    try {
      const result = await api(`/api/desks/${encodeURIComponent(desk)}/orders/${encodeURIComponent(order.order_id)}/cancel`,
        { method: "POST", body: { operator: state.operator } });
      const o = result.order;
      addNote(`✋ order ${o.order_id} (${o.side} ${o.type} ${o.amount} ${o.symbol}) is ${o.status}; filled ${o.filled}`, "warn");
    } catch (error) {
      addNote(`Order ${order.order_id} not cancelled: ${error.message}`, "error");
    }
    await loadBooks();
  }

  // ------------------------------------------------------------------ the log

  function log() { return $("log"); }

  function stickToBottom(action) {
    const box = log();
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
    action();
    if (atBottom) box.scrollTop = box.scrollHeight;
  }

  function addNote(text, kind = "note", at) {
    stickToBottom(() => {
      const note = el("div", `entry note note-${kind}`);
      note.append(el("time", null, clock(at)), el("span", null, text));
      log().append(note);
    });
  }

  // A note about a turn (steering delivered, an approval) goes inside that turn's block, in
  // order with its text and tool steps; without one it is a line of its own.
  function addTurnNote(turnId, text, kind, at, callId) {
    const turn = state.turns.get(turnId);
    if (!turn) {
      addNote(text, kind, at);
      return;
    }
    stickToBottom(() => {
      const step = callId ? turn.steps.get(callId) : null;
      if (step) {
        step.append(el("div", `step-note note-${kind}`, text));  // before the call's result
      } else {
        turn.body.append(el("div", `turn-note note-${kind}`, text));
        turn.lastText = null;
      }
    });
  }

  // pictures: [{url, label}], a thumbnail when the page has the picture (one just sent),
  // else a chip naming it (one from the stored transcript).
  function addOperatorMessage(text, who, tag, at, pictures = []) {
    let label = null;
    stickToBottom(() => {
      const entry = el("div", "entry you");
      const meta = el("div", "meta");
      meta.append(el("span", "who", who || "you"), el("time", null, clock(at)));
      if (tag) {
        label = el("span", "tag", tag);
        meta.append(label);
      }
      entry.append(meta);
      if (pictures.length) {
        const row = el("div", "bubble-pictures");
        for (const picture of pictures) {
          if (picture.url) {
            const img = el("img");
            img.src = picture.url;
            img.alt = picture.label;
            img.title = picture.label;
            row.append(img);
          } else {
            row.append(el("span", "picture-chip", `🖼 ${picture.label}`));
          }
        }
        entry.append(row);
      }
      if (text || !pictures.length) entry.append(el("div", "bubble bubble-you", text));
      log().append(entry);
    });
    return label;
  }

  function turnBlock(turnId, label, at) {
    let turn = state.turns.get(turnId);
    if (turn) return turn;
    const entry = el("div", "entry desk");
    entry.dataset.turn = turnId || "";
    const meta = el("div", "meta");
    meta.append(el("span", "who", state.selected), el("time", null, clock(at)));
    if (label) meta.append(el("span", "tag", label));
    const body = el("div", "bubble bubble-desk");
    entry.append(meta, body);
    stickToBottom(() => log().append(entry));
    turn = { el: entry, meta, body, lastText: null, steps: new Map() };
    state.turns.set(turnId, turn);
    return turn;
  }

  // The model's reasoning: dimmed, folded (a click opens it), one fold per stretch of it.
  function appendThinking(turn, text) {
    stickToBottom(() => {
      if (!turn.lastThinking) {
        const fold = el("details", "thinking");
        fold.append(el("summary", "thinking-head", "Thinking"), el("div", "thinking-text"));
        turn.body.append(fold);
        turn.lastThinking = fold;
        turn.lastText = null;
      }
      turn.lastThinking.querySelector(".thinking-text").textContent += text;
      turn.el.classList.add("streaming");
    });
  }

  function appendText(turn, text) {
    stickToBottom(() => {
      turn.lastThinking = null;
      if (!turn.lastText) {
        turn.lastText = el("div", "text");
        turn.body.append(turn.lastText);
      }
      turn.lastText.textContent += text;
      turn.el.classList.add("streaming");
    });
  }

  function addStep(turn, callId, name, args) {
    stickToBottom(() => {
      const step = el("div", "step");
      step.dataset.call = callId;
      const head = el("div", "step-head");
      head.append(el("span", "step-arrow", "→"), el("span", "step-name", name), el("span", "step-args", shortArgs(args)));
      step.append(head);
      turn.body.append(step);
      turn.steps.set(callId, step);
      turn.lastText = null;
      turn.lastThinking = null;
    });
  }

  function finishStep(turn, callId, name, text, isError, duration) {
    let step = turn.steps.get(callId);
    if (!step) {
      addStep(turn, callId, name, "");
      step = turn.steps.get(callId);
    }
    stickToBottom(() => {
      step.classList.add(isError ? "step-error" : "step-done");
      const result = el("div", "step-result");
      const first = String(text || "").trim().split("\n")[0];
      const seconds = typeof duration === "number" ? `${duration.toFixed(2)}s · ` : "";
      result.textContent = `${isError ? "✗" : "←"} ${seconds}${first.slice(0, 240)}`;
      step.append(result);
    });
  }

  function renderMessage(message) {
    const text = message.text || "";
    const at = message.created_at;
    if (message.kind === "operator" || message.kind === "steering") {
      const match = OPERATOR_PREFIX.exec(text);
      const pictures = (message.content || []).filter((b) => b.type === "image")
        .map((b) => ({ label: b.description || "picture" }));
      addOperatorMessage(match ? text.slice(match[0].length) : text, match ? match[1] : "operator",
        message.kind === "steering" ? "steered mid-turn" : null, at, pictures);
    } else if (message.kind === "summary") {
      addNote("Earlier conversation compacted into a summary.", "compact", at);
    } else if (message.kind === "trigger" || message.kind === "notice") {
      addNote(text.split("\n")[0].slice(0, 200), "trigger", at);
    } else if (message.role === "assistant") {
      const turn = turnBlock(`history-${message.seq}`, null, at);
      // An answer an operator's retry took out of what the desk is sent: kept, struck out.
      if (message.retracted) turn.el.classList.add("retracted");
      for (const block of message.content || [{ type: "text", text }]) {
        if (block.type === "text" && block.text) appendText(turn, block.text);
        if (block.type === "tool_use") addStep(turn, block.id, block.name, block.arguments);
      }
      turn.el.classList.remove("streaming");
      state.lastHistoryTurn = turn;
    } else if (message.kind === "tool_results" && state.lastHistoryTurn) {
      for (const block of message.content || []) {
        if (block.type !== "tool_result") continue;
        const inner = (block.content || []).filter((b) => b.type === "text").map((b) => b.text).join("\n");
        finishStep(state.lastHistoryTurn, block.tool_use_id, "", inner, block.is_error);
      }
    }
  }

  async function loadTranscript(name) {
    try {
      const data = await api(`/api/desks/${encodeURIComponent(name)}/transcript?limit=60`);
      if (state.selected !== name) return;
      state.lastHistoryTurn = null;
      for (const message of data.messages) renderMessage(message);
      const box = log();
      box.scrollTop = box.scrollHeight;
    } catch (error) {
      addNote(`Could not load the transcript: ${error.message}`, "error");
    }
  }

  // ------------------------------------------------------------------ live events

  function onEvent(data) {
    if (data.type && data.type.startsWith("approval_")) {
      handleApproval(data);
    }
    if (data.type === "turn_start" || data.type === "turn_end" || CONTROL_EVENTS.has(data.type)) scheduleRefresh();
    const booksChanged = BOOK_EVENTS.has(data.type) || (data.type === "tool_result" && ORDER_TOOLS.has(data.name));
    if (booksChanged && (data.desk === state.selected || data.desk === "*")) scheduleBooks();
    // A daemon-wide control event (desk "*") concerns every desk: each desk's log shows it.
    if (data.desk !== state.selected && !(data.desk === "*" && CONTROL_EVENTS.has(data.type))) return;
    const turnId = data.turn || "none";
    switch (data.type) {
      case "turn_start":
        if (data.silent) addNote("Memory flush: the desk saves what it needs before compacting.", "compact", data.at);
        else turnBlock(turnId, data.trigger_kind === "operator" ? null : data.trigger_kind, data.at);
        break;
      case "text_delta":
        appendText(turnBlock(turnId, null, data.at), data.text);
        break;
      case "thinking_delta":
        appendThinking(turnBlock(turnId, null, data.at), data.text);
        break;
      case "tool_call":
        addStep(turnBlock(turnId, null, data.at), data.call_id, data.name, data.arguments);
        break;
      case "tool_result":
        finishStep(turnBlock(turnId, null, data.at), data.call_id, data.name, data.text, data.is_error, data.duration);
        break;
      case "steering_delivered":
        if (data.started_turn) {
          addTurnNote(turnId, `✉ your message came as the desk finished its answer, so it opened this turn`, "steer", data.at);
        } else {
          addTurnNote(turnId, `✉ your message reached the desk after round ${data.after_round}: “${data.text.slice(0, 120)}”`, "steer", data.at);
        }
        break;
      case "turn_end": {
        const turn = state.turns.get(turnId);
        if (turn && !data.silent) {
          turn.el.classList.remove("streaming");
          const tokens = (data.input_tokens || 0) + (data.output_tokens || 0);
          const cost = typeof data.cost === "number" ? ` · $${data.cost.toFixed(4)}` : "";
          const cached = data.cached_input_tokens > 0 ? ` · ${cacheShare(data.cached_input_tokens, data.input_tokens)} cached` : "";
          turn.meta.append(el("span", "tag tag-dim", `${data.rounds} round${data.rounds === 1 ? "" : "s"} · ${tokens.toLocaleString("en-US")} tokens${cached}${cost}`));
          if (!turn.body.childNodes.length) {
            // An empty bubble reads "thinking…" (style.css): once the turn has ended it must say
            // that no answer came, or it looks busy forever.
            if (data.final_text) appendText(turn, data.final_text);
            else turn.body.append(el("div", "text no-answer", "The turn ended without an answer."));
          }
        }
        break;
      }
      case "context_cleared":
        addNote(`Old tool results cleared: ${Number(data.tokens_before).toLocaleString("en-US")} → ${Number(data.tokens_after).toLocaleString("en-US")} tokens${data.enough ? "" : "; not enough, summarizing next"}.`, "compact", data.at);
        break;
      case "compaction_end":
        addNote(`Compacted: ${Number(data.tokens_before).toLocaleString("en-US")} → ${Number(data.tokens_after).toLocaleString("en-US")} tokens, ${data.messages_summarized} messages summarized.`, "compact", data.at);
        break;
      case "hook_failed":
        addNote(`Hook ${data.hook}.${data.method} failed and was left out: ${data.error}`, "warn", data.at);
        break;
      case "retry":
        addNote(`Model retry ${data.attempt} in ${Number(data.delay).toFixed(1)} s: ${data.reason}`, "warn", data.at);
        break;
      case "error":
        addNote(`${data.error_type}: ${data.message}`, "error", data.at);
        break;
      case "approval_requested":
        addTurnNote(turnId, `⚠ waits for an operator's decision (${data.reason})`, "warn", data.at, data.call_id);
        break;
      case "approval_resolved":
        addTurnNote(turnId, `${data.outcome === "approved" ? "✓" : "✗"} ${data.outcome.replace("_", " ")}${data.operator ? " by " + data.operator : ""}${data.note ? ": " + data.note : ""}`, data.outcome === "approved" ? "good" : "error", data.at, data.call_id);
        break;
      default:
        onControlEvent(data, turnId);
        break;
    }
  }

  // The operator's controls and what the daemon says about money, as lines of the log.
  const CONTROL_EVENTS = new Set(["kill_switch", "reduce_only", "model_switched", "desk_paused", "desk_resumed", "turn_cancelled", "turn_retried",
    "spend_alert", "config_reloaded", "reconciliation", "order_filled", "storage", "pins_changed"]);

  function onControlEvent(data, turnId) {
    switch (data.type) {
      case "kill_switch":
        addNote(`⛔ ${data.text}`, data.on ? "kill" : "good", data.at);
        break;
      case "reduce_only":
        addNote(`⇲ ${data.text}`, data.on ? "warn" : "good", data.at);
        scheduleRefresh();
        break;
      case "model_switched":
        addNote(`⇄ now on model ${data.model} (was ${data.previous}): ${data.reason}`, "warn", data.at);
        break;
      case "desk_paused": {
        const until = typeof data.until === "number" ? ` until ${utc(data.until)}` : " until resumed";
        addNote(`⏸ paused by ${data.by}${until}: ${data.reason}`, "warn", data.at);
        break;
      }
      case "desk_resumed":
        addNote(`▶ resumed by ${data.by}${data.waiting ? `; ${data.waiting} trigger${data.waiting > 1 ? "s" : ""} waited` : ""}`, "good", data.at);
        break;
      case "turn_cancelled":
        addTurnNote(turnId, `✋ turn cancelled by ${data.by} (${data.now ? "at once" : "at its next safe point"})`, "warn", data.at);
        break;
      case "turn_retried":
        addNote(`↻ ${data.by} retried the last turn: its answer (${data.dropped} message${data.dropped === 1 ? "" : "s"}) left what the desk is sent; it runs again from “${data.trigger_text.slice(0, 120)}”`, "warn", data.at);
        break;
      case "spend_alert":
        addNote(`$ ${data.text}`, data.share >= 1 ? "error" : "warn", data.at);
        break;
      case "order_filled":
        addNote(`✓ ${data.text}`, "good", data.at);
        break;
      case "pins_changed":
        addNote(`⚑ ${data.text}`, "warn", data.at);
        if (data.desk === state.selected) loadPins();
        break;
      case "storage":
        addNote(`⛁ ${data.text}`, data.full ? "error" : "good", data.at);
        break;
      case "config_reloaded": {
        const changes = (data.changes || []).join("; ");
        if (data.ok) addNote(`Config reloaded: ${changes || "nothing changed"}`, "good", data.at);
        else addNote(`Config reload refused, nothing changed: ${changes}`, "error", data.at);
        break;
      }
      case "reconciliation": {
        const differences = data.differences || [];
        const adopted = (data.adopted || []).length ? ` · adopted: ${data.adopted.join(", ")}` : "";
        addNote(`⚖ ${data.exchange} differs from the journal (${differences.length}): ${differences.join("; ")}${adopted}`, "warn", data.at);
        break;
      }
      default:
        break;
    }
  }

  async function connect(after) {
    const params = new URLSearchParams();
    if (after !== null && after !== undefined) params.set("after", String(after));
    if (state.token) {
      // A ticket valid a minute, for this stream alone: the token never goes in a URL.
      try {
        const ticket = await api("/api/stream-ticket", { method: "POST" });
        params.set("ticket", ticket.ticket);
      } catch (error) {
        setConnection("connecting", "reconnecting…");
        setTimeout(() => connect(state.lastEventId ?? after), 2000);
        return;
      }
    }
    const source = new EventSource("/api/events?" + params.toString());
    state.source = source;
    source.onopen = () => setConnection("live", "live");
    source.onerror = () => {
      setConnection("connecting", "reconnecting…");
      // The browser reconnects by itself while the ticket is valid; once it has expired
      // the stream is refused and closed: open it again with a new ticket.
      if (source.readyState === EventSource.CLOSED && state.source === source) {
        setTimeout(() => connect(state.lastEventId ?? after), 1000);
      }
    };
    source.onmessage = (message) => {
      if (message.lastEventId) state.lastEventId = message.lastEventId;
      let data;
      try { data = JSON.parse(message.data); } catch (_) { return; }
      onEvent(data);
    };
  }

  // ------------------------------------------------------------------ who, and the audit

  async function loadMe() {
    const me = await api("/api/me");
    state.role = me.role;
    document.body.dataset.role = me.role;
    $("whoami").textContent = `${me.name} · ${me.role}`;
  }

  async function loadAudit() {
    const data = await api("/api/audit?limit=30");
    const list = $("audit-list");
    list.replaceChildren();
    for (const entry of data.actions.slice().reverse()) {
      const when = new Date(entry.at).toLocaleTimeString();
      const where = entry.desk ? ` ${entry.desk}` : "";
      const outcome = entry.outcome === "ok" ? "" : ` (${entry.outcome}: ${entry.detail})`;
      list.append(el("li", entry.outcome, `${when} ${entry.who} ${entry.action}${where} · ${entry.surface}${outcome}`));
    }
  }

  // ------------------------------------------------------------------ approvals

  async function loadApprovals() {
    const data = await api("/api/approvals");
    state.approvals = new Map(data.approvals.map((a) => [a.id, a]));
    renderApprovals();
  }

  function handleApproval(data) {
    if (data.type === "approval_requested") {
      let args = data.arguments;
      try { args = JSON.parse(data.arguments); } catch (_) { /* keep the text */ }
      state.approvals.set(data.approval_id, {
        id: data.approval_id, desk: data.desk, tool: data.tool, arguments: args,
        reason: data.reason, notional: data.notional, expires_at: data.expires_at,
      });
    } else {
      state.approvals.delete(data.approval_id);
    }
    renderApprovals();
    scheduleRefresh();
  }

  function renderApprovals() {
    const list = $("approval-list");
    list.replaceChildren();
    const mine = [...state.approvals.values()].filter((a) => a.desk === state.selected);
    $("approvals").hidden = mine.length === 0;
    for (const approval of mine) {
      const item = el("li", "approval");
      item.dataset.approval = approval.id;
      const head = el("div", "approval-head");
      head.append(el("span", "approval-tool", approval.tool), el("span", "approval-args", shortArgs(approval.arguments)));
      const details = el("div", "approval-details");
      const notional = approval.notional !== null && approval.notional !== undefined ? ` · notional ${money(approval.notional)}` : "";
      details.append(el("span", null, `${approval.reason}${notional}`), el("span", "countdown", ""));
      details.lastChild.dataset.expires = String(approval.expires_at);
      const actions = el("div", "approval-actions");
      actions.dataset.needs = "trader";
      const reason = el("input", "approval-reason");
      reason.placeholder = "Reason (the desk reads it)";
      const approve = el("button", "button good", "Approve");
      approve.type = "button";
      approve.dataset.action = "approve";
      const deny = el("button", "button bad", "Deny");
      deny.type = "button";
      deny.dataset.action = "deny";
      approve.addEventListener("click", () => decide(approval.id, "approve", reason.value, item));
      deny.addEventListener("click", () => decide(approval.id, "deny", reason.value, item));
      actions.append(reason, approve, deny);
      item.append(head, details, actions);
      list.append(item);
    }
    tickCountdowns();
  }

  function tickCountdowns() {
    for (const node of document.querySelectorAll(".countdown")) {
      const left = Math.max(0, Number(node.dataset.expires) - Date.now() / 1000);
      const minutes = Math.floor(left / 60);
      const seconds = String(Math.floor(left % 60)).padStart(2, "0");
      node.textContent = `denied in ${minutes}:${seconds} unless you answer`;
    }
  }

  async function decide(id, action, reason, item) {
    for (const button of item.querySelectorAll("button")) button.disabled = true;
    try {
      await api(`/api/approvals/${encodeURIComponent(id)}/${action}`, {
        method: "POST", body: { operator: state.operator, reason },
      });
      state.approvals.delete(id);
      renderApprovals();
    } catch (error) {
      addNote(`Could not ${action} ${id}: ${error.message}`, "error");
      for (const button of item.querySelectorAll("button")) button.disabled = false;
      if (error.status === 409 || error.status === 404) {
        state.approvals.delete(id);
        renderApprovals();
      }
    }
  }

  // ------------------------------------------------------------------ operator controls

  // The kill switch of a scope (a desk's name, or "*" for every desk), when it is on.
  function halt(scope) {
    return state.halts.find((h) => h.scope === scope) || null;
  }

  // A desk an operator (or a spend cap) holds, as opposed to one that waits for its model:
  // only a hold can be resumed. The daemon words a hold "paused by NAME at TIME: ...".
  function isHeld(desk) {
    return /^paused by /.test(desk.paused_reason || "");
  }

  function renderControls(desk) {
    $("desk-controls").hidden = false;
    const pause = $("pause");
    pause.textContent = isHeld(desk) ? "Resume" : "Pause";
    pause.dataset.action = isHeld(desk) ? "resume" : "pause";
    pause.className = isHeld(desk) ? "button good" : "button";
    $("cancel-turn").disabled = desk.state !== "working";
    $("retry-turn").disabled = desk.state === "working";
    const reduce = $("reduce-only");
    reduce.dataset.action = desk.reduce_only ? "reduce-only-off" : "reduce-only-on";
    reduce.textContent = desk.reduce_only ? "Lift reduce-only" : "Reduce-only";
    reduce.className = desk.reduce_only ? "button good" : "button";
    renderKillSwitch($("desk-controls"), desk.name);
  }

  // The kill switch button of a box: on (with its options) while the switch is off, off while on.
  function renderKillSwitch(box, scope) {
    const on = halt(scope);
    const whose = scope === "*" ? "every desk" : scope;
    const button = box.querySelector("[data-action=kill]");
    button.dataset.on = on ? "true" : "false";
    button.className = on ? "button good" : "button bad";
    button.textContent = on ? `Switch off (${whose})` : scope === "*" ? "Halt every desk" : "Kill switch";
    box.querySelector(".kill-options").hidden = Boolean(on);
    const text = box.querySelector(".kill-state");
    if (text) {
      text.hidden = !on;
      text.textContent = on ? `⛔ ${on.text}` : "";
    }
  }

  // Asks, in the page, before positions are closed at market; resolves true or false.
  function confirmFlatten(box, whose, cancelOrders) {
    dismissConfirm(box);
    const strip = box.querySelector(".confirm");
    const yes = el("button", "button bad", `Flatten ${whose} now`);
    yes.type = "button";
    yes.dataset.action = "confirm-flatten";
    const no = el("button", "button ghost", "Keep the positions");
    no.type = "button";
    no.dataset.action = "keep-positions";
    const actions = el("div", "confirm-actions");
    actions.append(yes, no);
    strip.replaceChildren(
      el("p", null, `Flatten closes every open position of ${whose} at market, now, at whatever ` +
        `price the book gives; it cannot be undone. The kill switch then refuses every new order` +
        `${cancelOrders ? ", and open orders are cancelled" : ""}.`),
      actions);
    strip.hidden = false;
    return new Promise((resolve) => {
      box.answerConfirm = (answer) => {
        box.answerConfirm = null;
        strip.hidden = true;
        strip.replaceChildren();
        resolve(answer);
      };
      yes.addEventListener("click", () => box.answerConfirm(true));
      no.addEventListener("click", () => box.answerConfirm(false));
      no.focus();
    });
  }

  function dismissConfirm(box) {
    if (box.answerConfirm) box.answerConfirm(false);
  }

  async function toggleKillSwitch(box, scope, reasonInput) {
    if (!scope) return;
    const on = !halt(scope);
    const whose = scope === "*" ? "every desk" : `desk ${scope}`;
    const body = { on, operator: state.operator, reason: reasonInput.value.trim() };
    if (scope !== "*") body.desk = scope;
    if (on && !body.reason) {
      reasonInput.classList.add("invalid");
      reasonInput.focus();
      addNote(`Say why the kill switch goes on for ${whose}: every refused order quotes the reason.`, "error");
      return;
    }
    const button = box.querySelector("[data-action=kill]");
    button.disabled = true;
    try {
      if (on) {
        body.cancel_orders = box.querySelector("[data-option=cancel_orders]").checked;
        body.flatten = box.querySelector("[data-option=flatten]").checked;
        if (body.flatten && !(await confirmFlatten(box, whose, body.cancel_orders))) {
          addNote(`Kill switch not switched: flattening ${whose} was not confirmed.`, "note");
          return;
        }
      }
      const result = await api("/api/kill-switch", { method: "POST", body });
      for (const line of result.cancelled || []) addNote(line, "warn");
      for (const line of result.flattened || []) addNote(line, "warn");
      for (const line of result.failed || []) addNote(`FAILED: ${line}`, "error");
      if (!on && !result.was) addNote(`The kill switch of ${whose} was not on.`, "note");
      reasonInput.value = "";
      for (const option of box.querySelectorAll("[data-option]")) option.checked = false;
      await loadDesks();
    } catch (error) {
      addNote(`Kill switch not switched for ${whose}: ${error.message}`, "error");
    } finally {
      button.disabled = false;
    }
  }

  async function pauseOrResume() {
    const desk = state.desks.get(state.selected);
    if (!desk) return;
    const action = $("pause").dataset.action;
    const body = { operator: state.operator };
    if (action === "pause") body.reason = $("control-reason").value.trim();
    $("pause").disabled = true;
    try {
      const result = await api(`/api/desks/${encodeURIComponent(desk.name)}/${action}`, { method: "POST", body });
      if (!result.changed) {
        addNote(action === "pause" ? `${desk.name} was paused already: ${result.status.paused_reason}`
          : `${desk.name} was not paused${desk.paused_reason ? ` by anyone: ${desk.paused_reason}` : ""}.`, "warn");
      } else if (action === "pause") {
        $("control-reason").value = "";
      }
      state.desks.set(desk.name, result.status);
      renderDeskList();
      renderDeskHead();
    } catch (error) {
      addNote(`Could not ${action} ${desk.name}: ${error.message}`, "error");
    } finally {
      $("pause").disabled = false;
    }
  }

  async function toggleReduceOnly() {
    const desk = state.desks.get(state.selected);
    if (!desk) return;
    const on = $("reduce-only").dataset.action === "reduce-only-on";
    const body = { on, operator: state.operator, reason: $("control-reason").value.trim() };
    $("reduce-only").disabled = true;
    try {
      const result = await api(`/api/desks/${encodeURIComponent(desk.name)}/reduce_only`, { method: "POST", body });
      if (!on && !result.was) addNote(`${desk.name} was not in reduce-only.`, "note");
      if (on) $("control-reason").value = "";
      state.desks.set(desk.name, result.status);
      renderDeskList();
      renderDeskHead();
    } catch (error) {
      addNote(`Reduce-only not changed for ${desk.name}: ${error.message}`, "error");
    } finally {
      $("reduce-only").disabled = false;
    }
  }

  async function cancelTurn() {
    const name = state.selected;
    if (!name) return;
    const now = $("cancel-now").checked;
    $("cancel-turn").disabled = true;
    try {
      const result = await api(`/api/desks/${encodeURIComponent(name)}/cancel`, {
        method: "POST", body: { operator: state.operator, now },
      });
      if (!result.cancelled) addNote(`No turn of ${name} was running: nothing to cancel.`, "note");
      $("cancel-now").checked = false;
    } catch (error) {
      addNote(`Could not cancel the turn of ${name}: ${error.message}`, "error");
    } finally {
      scheduleRefresh();
    }
  }

  async function retryTurn() {
    const name = state.selected;
    if (!name) return;
    $("retry-turn").disabled = true;
    try {
      // What was dropped comes back as a turn_retried event, then the turn runs again.
      await api(`/api/desks/${encodeURIComponent(name)}/retry`, {
        method: "POST", body: { operator: state.operator },
      });
    } catch (error) {
      addNote(`Could not retry the last turn of ${name}: ${error.message}`, "error");
    } finally {
      scheduleRefresh();
    }
  }

  async function reloadConfig() {
    $("reload").disabled = true;
    try {
      // What changed (or why nothing did) comes back as a config_reloaded event.
      await api("/api/reload", { method: "POST", body: { operator: state.operator } });
      await loadDesks();
    } catch (error) {
      if (error.status !== 400) addNote(`Config not reloaded: ${error.message}`, "error");
    } finally {
      $("reload").disabled = false;
    }
  }

  function setupControls() {
    $("reload").addEventListener("click", reloadConfig);
    $("pause").addEventListener("click", pauseOrResume);
    $("reduce-only").addEventListener("click", toggleReduceOnly);
    $("cancel-turn").addEventListener("click", cancelTurn);
    $("retry-turn").addEventListener("click", retryTurn);
    const desk = $("desk-controls");
    const all = $("kill-all");
    const allReason = all.querySelector("[data-field=reason]");
    desk.querySelector("[data-action=kill]").addEventListener("click", () => toggleKillSwitch(desk, state.selected, $("control-reason")));
    all.querySelector("[data-action=kill]").addEventListener("click", () => toggleKillSwitch(all, "*", allReason));
    for (const input of [$("control-reason"), allReason]) {
      input.addEventListener("input", () => input.classList.remove("invalid"));
    }
  }

  // ------------------------------------------------------------------ equity chart

  async function loadEquity() {
    const desk = state.selected;
    if (!desk) return;
    try {
      const data = await api(`/api/desks/${encodeURIComponent(desk)}/equity`);
      if (desk !== state.selected) return;  // another desk was chosen meanwhile
      state.equity = data.points;
      state.equityDesk = desk;
      drawEquity();
    } catch (_) { /* the chart waits for the next poll */ }
  }

  // The points drawn: the desk's samples, ending with the equity its status reports, the
  // figure the header shows (the status refreshes more often than the samples), so the
  // chart and the header never disagree.
  function equityPoints() {
    if (state.equityDesk !== state.selected) return [];
    const points = state.equity.slice();
    const desk = state.desks.get(state.selected);
    const now = desk && desk.equity !== null && desk.equity !== undefined ? Number(desk.equity) : NaN;
    if (Number.isFinite(now)) {
      const last = points[points.length - 1];
      if (!last || last[1] !== now) points.push([Math.max(Date.now() / 1000, last ? last[0] : 0), now]);
    }
    return points;
  }

  function drawEquity() {
    const canvas = $("equity-chart");
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 360;
    const height = canvas.clientHeight || 92;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const points = equityPoints();
    const caption = $("equity-caption");
    if (!points.length) {
      g.fillStyle = "#5d6b82";
      g.font = "12px system-ui, sans-serif";
      g.fillText("No equity samples yet", 12, height / 2 + 4);
      caption.textContent = "Equity";
      return;
    }
    const values = points.map((p) => p[1]);
    let low = Math.min(...values);
    let high = Math.max(...values);
    if (high - low < 1e-9) { low -= 1; high += 1; }
    const pad = 8;
    const x = (i) => pad + (points.length === 1 ? 0 : (i * (width - 2 * pad)) / (points.length - 1));
    const y = (v) => pad + (1 - (v - low) / (high - low)) * (height - 2 * pad);
    const up = values[values.length - 1] >= values[0];
    const colour = up ? "#3ddc97" : "#ff6b6b";
    const fill = g.createLinearGradient(0, 0, 0, height);
    fill.addColorStop(0, up ? "rgba(61,220,151,0.28)" : "rgba(255,107,107,0.28)");
    fill.addColorStop(1, "rgba(0,0,0,0)");
    g.beginPath();
    points.forEach((p, i) => (i ? g.lineTo(x(i), y(p[1])) : g.moveTo(x(i), y(p[1]))));
    if (points.length === 1) g.lineTo(width - pad, y(values[0]));
    g.lineTo(points.length === 1 ? width - pad : x(points.length - 1), height);
    g.lineTo(x(0), height);
    g.closePath();
    g.fillStyle = fill;
    g.fill();
    g.beginPath();
    points.forEach((p, i) => (i ? g.lineTo(x(i), y(p[1])) : g.moveTo(x(i), y(p[1]))));
    if (points.length === 1) g.lineTo(width - pad, y(values[0]));
    g.strokeStyle = colour;
    g.lineWidth = 2;
    g.stroke();
    g.beginPath();  // the newest sample
    g.arc(points.length === 1 ? width - pad : x(points.length - 1), y(values[values.length - 1]), 3, 0, 2 * Math.PI);
    g.fillStyle = colour;
    g.fill();
    const last = values[values.length - 1];
    const change = values[0] ? ((last - values[0]) / values[0]) * 100 : 0;
    caption.textContent = `Equity ${money(last)}  ${change >= 0 ? "+" : ""}${change.toFixed(2)}%  ·  range ${money(Math.min(...values))} – ${money(Math.max(...values))}`;
    const first = points[0][0];
    caption.title = `${points.length} samples since ${Date.now() / 1000 - first < 86400 ? clock(first) : utc(first)}`;
    caption.className = up ? "up" : "down";
  }

  // ------------------------------------------------------------------ sending

  // Pictures pasted or dropped into the composer wait here until the message is sent.
  const PICTURE_TYPES = ["image/png", "image/jpeg", "image/gif", "image/webp"];
  const MAX_PICTURES = 4;  // the API's limit per message: the model sees only the 4 newest
  const attachments = [];  // {name, media_type, data (base64), url (data: URL)}

  function readDataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(String(reader.result));
      reader.onerror = () => reject(reader.error);
      reader.readAsDataURL(file);
    });
  }

  async function attach(files) {
    for (const file of files) {
      const name = file.name || "pasted picture";
      if (!PICTURE_TYPES.includes(file.type)) {
        addNote(`Not attached: ${name} is not a PNG, JPEG, GIF or WebP picture${file.type ? ` (${file.type})` : ""}.`, "error");
        continue;
      }
      if (attachments.length >= MAX_PICTURES) {
        addNote(`Not attached: ${name}; a message carries at most ${MAX_PICTURES} pictures.`, "error");
        continue;
      }
      let url;
      try { url = await readDataUrl(file); } catch (error) {
        addNote(`Not attached: ${name} could not be read (${error && error.message}).`, "error");
        continue;
      }
      attachments.push({ name, media_type: file.type, data: url.slice(url.indexOf(",") + 1), url });
    }
    renderAttachments();
  }

  function renderAttachments() {
    const box = $("attachments");
    box.replaceChildren();
    box.hidden = attachments.length === 0;
    attachments.forEach((picture, index) => {
      const chip = el("div", "attachment");
      const img = el("img");
      img.src = picture.url;
      img.alt = picture.name;
      const remove = el("button", "attachment-remove", "×");
      remove.type = "button";
      remove.title = `Remove ${picture.name}`;
      remove.addEventListener("click", () => {
        attachments.splice(index, 1);
        renderAttachments();
      });
      chip.append(img, el("span", "attachment-name", picture.name), remove);
      box.append(chip);
    });
  }

  function setupPictures() {
    const composer = $("composer");
    $("message").addEventListener("paste", (event) => {
      const files = [...((event.clipboardData && event.clipboardData.files) || [])];
      if (!files.length) return;  // plain text pastes as usual
      event.preventDefault();
      attach(files);
    });
    composer.addEventListener("dragover", (event) => {
      if (!event.dataTransfer || ![...event.dataTransfer.types].includes("Files")) return;
      event.preventDefault();
      composer.classList.add("dropping");
    });
    composer.addEventListener("dragleave", () => composer.classList.remove("dropping"));
    composer.addEventListener("drop", (event) => {
      composer.classList.remove("dropping");
      const files = [...((event.dataTransfer && event.dataTransfer.files) || [])];
      if (!files.length) return;
      event.preventDefault();
      attach(files);
    });
  }

  let unsent = null;  // the message last tried and not sent: { text, desk, key }

  function newKey() {
    if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  async function send(event) {
    event.preventDefault();
    const box = $("message");
    const text = box.value;
    const pictures = attachments.slice();
    if ((!text.trim() && !pictures.length) || !state.selected) return;
    const button = $("send");
    button.disabled = true;
    // Shown before the request: the desk's answer can stream in before the reply arrives.
    const label = addOperatorMessage(text, state.operator, "sending…", undefined,
      pictures.map((p) => ({ url: p.url, label: p.name })));
    box.value = "";
    attachments.length = 0;
    renderAttachments();
    // One key per message, kept while it is not sent: sending the same text again after a
    // failure reuses it, so a message the daemon kept after all is read once.
    if (!unsent || unsent.text !== text || unsent.desk !== state.selected) {
      unsent = { text, desk: state.selected, key: newKey() };
    }
    const body = { text, source: state.operator, idempotency_key: unsent.key };
    if (pictures.length) {
      body.images = pictures.map((p) => ({ media_type: p.media_type, data: p.data, name: p.name }));
    }
    try {
      const result = await api(`/api/desks/${encodeURIComponent(state.selected)}/messages`, {
        method: "POST", body,
      });
      unsent = null;
      label.textContent = result.delivery === "steering" ? "steers the running turn" : "starts a turn";
      if (result.shortened) {
        label.textContent += " · shortened";
        addNote(`Shortened: ${result.shortened.note}`, "warn");
      }
      scheduleRefresh();
    } catch (error) {
      if (error.kept === true) {  // kept, will be read once: not back in the composer
        unsent = null;
        label.textContent = "kept";
        addNote(error.message, "warn");
        return;
      }
      label.textContent = error.kept === null ? "not confirmed" : "not sent";
      label.classList.add("tag-bad");
      if (!box.value) box.value = text;
      if (!attachments.length) {  // back in the composer, to fix and send again
        attachments.push(...pictures);
        renderAttachments();
      }
      addNote(`Not sent: ${error.message}`, "error");
    } finally {
      button.disabled = false;
      box.focus();
    }
  }

  async function compact() {
    if (!state.selected) return;
    const button = $("compact");
    button.disabled = true;
    addNote("Compacting (waits for a running turn to finish)…", "compact");
    try {
      const result = await api(`/api/desks/${encodeURIComponent(state.selected)}/compact`, { method: "POST" });
      addNote(result.compacted ? "Compacted." : "Nothing to compact yet: the conversation is short.", "compact");
    } catch (error) {
      addNote(`/compact failed: ${error.message}`, "error");
    } finally {
      button.disabled = false;
    }
  }

  // ------------------------------------------------------------------ start

  async function start() {
    readAuth();
    $("composer").addEventListener("submit", send);
    $("message").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("compact").addEventListener("click", compact);
    $("pin-form").addEventListener("submit", addPin);
    setupPictures();
    setupControls();
    window.addEventListener("resize", drawEquity);
    let health;
    try {
      health = await api("/api/health");
    } catch (error) {
      if (error.status === 401) {
        $("auth-note").hidden = false;
        setConnection("error", "token needed");
      } else {
        setConnection("error", `daemon unreachable: ${error.message}`);
      }
      return;
    }
    await loadMe();
    // Subscribe before loading the rest: nothing that happens meanwhile is missed.
    await connect(health.last_event_id);
    await Promise.all([loadDesks(), loadApprovals(), loadAudit().catch(() => {})]);
    setInterval(() => loadAudit().catch(() => {}), 10000);
    setInterval(() => loadDesks().catch(() => {}), 5000);
    setInterval(loadEquity, 5000);
    setInterval(() => loadBooks().catch(() => {}), 15000);  // the marks move
    setInterval(tickCountdowns, 1000);
  }

  document.addEventListener("DOMContentLoaded", () => { start(); });
})();
