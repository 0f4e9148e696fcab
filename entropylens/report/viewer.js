// entropylens token viewer: one run's responses, token by token (entropylens/report/viewer.py writes the page).
// Reads the page data from <script id="el-data">; no library, nothing fetched.
(function () {
  "use strict";

  var D = JSON.parse(document.getElementById("el-data").textContent);
  var COLS = D.columns || [];
  var CI = {};
  COLS.forEach(function (c, i) { CI[c] = i; });
  var METRICS = D.metrics || [];
  var MET = {};
  METRICS.forEach(function (m) { MET[m.key] = m; });
  var STEPS = D.steps || [];
  var SHARE = D.forking_share == null ? 0.2 : D.forking_share;
  var MULTI_RANK = STEPS.some(function (st) { return st.responses.some(function (r) { return r.rank !== 0; }); });

  // ---------------------------------------------------------------- colours
  var SEQ = [[255, 252, 228], [254, 224, 139], [253, 174, 97], [244, 109, 67], [215, 48, 39], [140, 18, 56], [64, 8, 60]];
  var DIV = [[33, 102, 172], [103, 169, 207], [209, 229, 240], [247, 247, 247], [253, 219, 199], [239, 138, 98], [178, 24, 43]];
  var CAT = {
    quadrant: D.palette.quadrant, // palette.py: the report's figures use the same four colours
    clip: { "kept": "#e3e8ee", "low": "#9ecae1", "high": "#fdd0a2", "clipped low": "#2166ac", "clipped high": "#d9480f" },
    erc: { "kept": "#c7e9c0", "dropped": "#cb181d" }
  };
  var CAT_FALLBACK = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d"];
  var NULL_COLOR = "#dcdcdc";
  var LOG_FLOOR = Math.log(1.01); // the least half-width of a log scale's colours
  // the report's run palette (palette.py): no green or red, which name the quadrants
  var UPDATE_COLORS = D.palette.update;

  function ramp(stops, t) {
    if (!(t >= 0)) t = 0;
    if (t > 1) t = 1;
    var x = t * (stops.length - 1), i = Math.min(Math.floor(x), stops.length - 2), f = x - i;
    var a = stops[i], b = stops[i + 1];
    return [0, 1, 2].map(function (k) { return Math.round(a[k] + (b[k] - a[k]) * f); });
  }
  function css(rgb) { return "rgb(" + rgb[0] + "," + rgb[1] + "," + rgb[2] + ")"; }
  function hexRgb(h) { return [1, 3, 5].map(function (i) { return parseInt(h.substr(i, 2), 16); }); }
  function darkText(rgb) { // text colour readable on rgb
    var l = (0.2126 * rgb[0] + 0.7152 * rgb[1] + 0.0722 * rgb[2]) / 255;
    return l > 0.5 ? "#111" : "#fff";
  }
  function gradient(stops) {
    return "linear-gradient(to right, " + stops.map(function (s, i) {
      return css(s) + " " + Math.round(100 * i / (stops.length - 1)) + "%";
    }).join(", ") + ")";
  }

  // ---------------------------------------------------------------- values
  function num(v) { // an embedded value as a number (null when none)
    if (typeof v === "number") return v;
    if (v === "inf") return Infinity;
    if (v === "-inf") return -Infinity;
    if (typeof v === "boolean") return v ? 1 : 0;
    return null;
  }
  function show(v) { // an embedded value as the page prints it: JS's own number-to-string, null as "null"
    if (v === null || v === undefined) return "null";
    if (v === 0 && 1 / v < 0) return "-0"; // String(-0) is "0"
    return String(v);
  }
  function fmt(v, digits) { // a rounded number for lists and axes
    if (v === null || v === undefined) return "–";
    if (typeof v !== "number") return String(v);
    if (!isFinite(v)) return v > 0 ? "inf" : (v < 0 ? "-inf" : "nan");
    if (v === 0) return "0";
    var a = Math.abs(v), d = digits || 4;
    if (a >= 1e5 || a < 1e-3) return v.toExponential(d - 2).replace("e+", "e");
    return String(Number(v.toPrecision(d)));
  }
  // characters that draw nothing or change how their neighbours are drawn: C0 / C1 controls and DEL (Cc),
  // format characters (Cf: bidi overrides and isolates, zero-width spaces, U+FEFF, ...), line and paragraph
  // separators, lone surrogates. A user's text never reaches the page with them raw: each is written as its
  // code, in the form of entropylens/report/escape.py (\x85, \u202e, \U000e0001)
  var INVISIBLE = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}\p{Cs}]/u;
  var INVISIBLES = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}\p{Cs}]/gu;
  var IGNORABLE_ONLY = /^\p{Default_Ignorable_Code_Point}+$/u; // drawn as nothing even where not INVISIBLE
  var SHORT = { "\t": "\\t", "\n": "\\n", "\r": "\\r" };
  function hexCode(o, n) { var x = o.toString(16); while (x.length < n) x = "0" + x; return x; }
  function code(ch) { // one character as its escape
    if (SHORT[ch]) return SHORT[ch];
    var o = ch.codePointAt(0);
    return o < 0x100 ? "\\x" + hexCode(o, 2) : (o < 0x10000 ? "\\u" + hexCode(o, 4) : "\\U" + hexCode(o, 8));
  }
  function visible(s) { // a name or a sentence as plain text: each invisible character as its code
    return String(s).replace(INVISIBLES, code);
  }
  // ``s`` into ``parent`` as text nodes, each invisible character (but those in ``keep``; every character
  // where ``all``) as a mark: span.cc holding its code, titled with its code point
  function fillMarked(parent, s, keep, all) {
    var buf = "";
    Array.from(s).forEach(function (ch) { // by code point: a surrogate pair is one character
      if ((all || INVISIBLE.test(ch)) && keep.indexOf(ch) < 0) {
        if (buf) parent.appendChild(document.createTextNode(buf));
        buf = "";
        var m = document.createElement("span");
        m.className = "cc";
        m.textContent = code(ch);
        m.title = "U+" + hexCode(ch.codePointAt(0), 4).toUpperCase() +
          ": an invisible or control character, shown as its code";
        parent.appendChild(m);
      } else {
        buf += ch;
      }
    });
    if (buf) parent.appendChild(document.createTextNode(buf));
  }
  function esc(s) {
    return String(s).replace(/[&<>"']/g, function (c) {
      return { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c];
    });
  }
  // the categories of responses.category (entropylens/report/responses.py): the same rules
  function category(key, row) {
    if (key === "quadrant") return row[CI.quadrant];
    if (key === "clip") {
      var c = row[CI.clip], side = c === -1 ? "low" : (c === 1 ? "high" : null);
      if (side === null) return "kept";
      return row[CI.clipped] ? "clipped " + side : side;
    }
    if (key === "erc") {
      var k = row[CI.erc_kept];
      return k === null || k === undefined ? null : (k ? "kept" : "dropped");
    }
    return null;
  }
  function catColor(key, value) {
    if (value === null || value === undefined) return NULL_COLOR;
    var own = CAT[key] && CAT[key][value];
    if (own) return own;
    var cats = (MET[key] && MET[key].categories) || [];
    for (var i = 0; i < cats.length; i++) if (cats[i][0] === value) return CAT_FALLBACK[i % CAT_FALLBACK.length];
    return "#999999";
  }

  // one response's rows at one update, aligned with its positions (null where that update has none)
  var aligned = new WeakMap();
  function rowsAt(resp, update) {
    var per = aligned.get(resp);
    if (!per) { per = {}; aligned.set(resp, per); }
    var key = String(update);
    if (per[key]) return per[key];
    var rows = (resp.rows || {})[key] || [], at = {}, out = new Array(resp.pos.length);
    rows.forEach(function (r) { at[r[CI.pos]] = r; });
    for (var i = 0; i < resp.pos.length; i++) out[i] = at[resp.pos[i]] || null;
    per[key] = out;
    return out;
  }
  function respUpdates(resp) {
    return Object.keys(resp.rows || {}).map(Number).sort(function (a, b) { return a - b; });
  }

  // a colour scale over a response's values at an update: {color(i) -> [bg, fg] or null, legend parts}
  function scaleFor(metric, rows) {
    var key = metric.key;
    if (metric.scale === "categorical") {
      var vals = rows.map(function (r) { return r ? category(key, r) : undefined; });
      return { kind: "categorical", values: vals, at: function (i) {
        if (vals[i] === undefined) return null;
        var h = catColor(key, vals[i]);
        return [h, darkText(hexRgb(h))];
      } };
    }
    var xs = rows.map(function (r) { return r ? num(r[CI[key]]) : undefined; });
    var lo = Infinity, hi = -Infinity, n = 0;
    xs.forEach(function (v) {
      if (v === null || v === undefined || !isFinite(v)) return;
      if (metric.scale === "log" && !(v > 0)) return;
      n++; if (v < lo) lo = v; if (v > hi) hi = v;
    });
    var s = { kind: metric.scale, values: xs, min: n ? lo : null, max: n ? hi : null, n: n };
    var t; // value -> [0, 1]
    if (metric.scale === "diverging") {
      var c = metric.center || 0, m = n ? Math.max(Math.abs(lo - c), Math.abs(hi - c)) : 0;
      s.lo = c - m; s.hi = c + m; s.center = c; s.stops = DIV;
      t = function (v) { return m > 0 ? 0.5 + 0.5 * (v - c) / m : 0.5; };
    } else if (metric.scale === "log") {
      var lc = Math.log(metric.center || 1), ml = n ? Math.max(Math.abs(Math.log(lo) - lc), Math.abs(Math.log(hi) - lc)) : 0;
      // at least +-1% around the center: float32 rounding (a ratio of 1 - 1e-7 on-policy) is no colour
      s.floored = ml < LOG_FLOOR; ml = Math.max(ml, LOG_FLOOR);
      s.lo = Math.exp(lc - ml); s.hi = Math.exp(lc + ml); s.center = metric.center || 1; s.stops = DIV;
      t = function (v) { return v <= 0 ? 0 : (ml > 0 ? 0.5 + 0.5 * (Math.log(v) - lc) / ml : 0.5); };
    } else {
      s.lo = lo; s.hi = hi; s.stops = SEQ;
      t = function (v) { return hi > lo ? (v - lo) / (hi - lo) : 0.5; };
    }
    s.t = t;
    s.at = function (i) {
      var v = xs[i];
      if (v === undefined) return null;
      if (v === null || v !== v) return [NULL_COLOR, "#555"];
      var rgb = ramp(s.stops, t(v));
      return [css(rgb), darkText(rgb)];
    };
    return s;
  }

  // ---------------------------------------------------------------- state
  var state = { step: null, update: null, metric: MET.entropy ? "entropy" : (METRICS[0] || {}).key,
    resp: null, sortKey: null, sortDir: -1, pinned: null, note: "" };
  var view = null; // the shown response: {resp, spans, index: pos -> i}
  var el = {};

  function h(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function stepData(step) {
    for (var i = 0; i < STEPS.length; i++) if (STEPS[i].step === step) return STEPS[i];
    return null;
  }

  function build() {
    var app = document.getElementById("el-app");
    document.getElementById("el-method").textContent = D.method ? "(" + visible(D.method) + ")" : "";
    document.getElementById("el-selection").textContent = visible(D.selection || "");
    var src = document.getElementById("el-textsource");
    if (D.has_text) {
      src.textContent = "Token text: " + visible(D.text_source || "decoded") + ".";
    } else {
      src.className = "el-hint";
      src.textContent = "No token text (token ids are shown): " + visible(D.text_hint || "");
    }
    app.innerHTML =
      '<div class="el-controls">' +
      '<label>step <select id="el-step"></select></label>' +
      '<label>update <select id="el-update"></select></label>' +
      '<label>colour by <select id="el-metric"></select></label>' +
      '<span id="el-note" class="el-note"></span></div>' +
      '<div class="el-listbox"><table id="el-list"><thead></thead><tbody></tbody></table></div>' +
      '<p id="el-counts" class="el-muted">clipped, ERC-dropped: token rows summed over the updates of the step that ' +
      "trained the response (a token in 2 updates counts twice; the table under the response splits them by update). " +
      "\u2013: not applicable (the run has no ERC) or not recorded.</p>" +
      '<section id="el-response">' +
      '<div id="el-resp-head"></div>' +
      '<div id="el-legend"></div>' +
      '<div class="el-reading"><div id="el-text" class="' + (D.has_text ? "el-has-text" : "el-ids") + '"></div>' +
      '<aside id="el-details"><p class="el-muted">Hover or click a token to see all its values.</p></aside></div>' +
      '<h3>Chosen metric against position</h3><div id="el-chart"></div>' +
      '<h3>Across the updates of the step</h3><div id="el-updates"></div>' +
      '<details id="el-completion"><summary>decoded completion (sequences.text)</summary><pre></pre></details>' +
      "</section>";
    ["el-step", "el-update", "el-metric", "el-list", "el-text", "el-details", "el-chart", "el-updates",
      "el-legend", "el-resp-head", "el-note", "el-completion", "el-response"].forEach(function (id) {
      el[id.slice(3)] = document.getElementById(id);
    });
    STEPS.forEach(function (s) {
      el.step.appendChild(h("option", { value: String(s.step) }, "step " + s.step + " \u00b7 " + s.responses.length +
        " response" + (s.responses.length === 1 ? "" : "s")));
    });
    METRICS.forEach(function (m) {
      el.metric.appendChild(h("option", { value: m.key }, m.label));
    });
    el.metric.value = state.metric;
    var head = h("tr");
    LIST_COLS.forEach(function (c) {
      var th = h("th", { "data-key": c[0], title: "sort by " + c[1] }, c[1]);
      if (c[2]) th.className = "num";
      head.appendChild(th);
    });
    el.list.tHead.appendChild(head);

    el.step.addEventListener("change", function () { openStep(Number(el.step.value), {}); });
    el.update.addEventListener("change", function () { state.update = Number(el.update.value); recolor(); writeHash(); });
    el.metric.addEventListener("change", function () { state.metric = el.metric.value; recolor(); writeHash(); });
    el.list.tHead.addEventListener("click", function (ev) {
      var th = ev.target.closest("th");
      if (!th) return;
      var k = th.getAttribute("data-key");
      if (state.sortKey === k) state.sortDir = -state.sortDir;
      else { state.sortKey = k; state.sortDir = (k === "seq" || k === "rank" || k === "why") ? 1 : -1; }
      renderList();
    });
    el.list.tBodies[0].addEventListener("click", function (ev) {
      var tr = ev.target.closest("tr");
      if (!tr || !tr.hasAttribute("data-seq")) return;
      var sd = stepData(state.step);
      var r = findResp(sd, Number(tr.getAttribute("data-seq")), Number(tr.getAttribute("data-rank")));
      if (r) { state.note = ""; showResponse(r); }
    });
    el.text.addEventListener("mouseover", function (ev) {
      var sp = ev.target.closest ? ev.target.closest("span.tk") : null;
      if (sp && el.text.contains(sp)) detail(Number(sp.getAttribute("data-i")));
    });
    el.text.addEventListener("mouseleave", function () {
      if (state.pinned !== null) detail(state.pinned);
    });
    el.text.addEventListener("click", function (ev) {
      var sp = ev.target.closest ? ev.target.closest("span.tk") : null;
      if (!sp) return;
      var i = Number(sp.getAttribute("data-i"));
      if (view && state.pinned !== null && view.spans[state.pinned]) view.spans[state.pinned].classList.remove("pinned");
      state.pinned = i;
      sp.classList.add("pinned");
      detail(i);
    });
    el.chart.addEventListener("click", function (ev) {
      var svg = el.chart.querySelector("svg");
      if (!svg || !view || !view.xmap) return;
      var box = svg.getBoundingClientRect(), x = ev.clientX - box.left, best = -1, bd = Infinity;
      view.resp.pos.forEach(function (p, i) {
        var d = Math.abs(view.xmap(p) - x);
        if (d < bd) { bd = d; best = i; }
      });
      if (best >= 0 && view.spans[best]) view.spans[best].click();
    });
    var resizeTimer = null;
    window.addEventListener("resize", function () {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(function () { if (view) { drawChart(); drawUpdates(); } }, 150);
    });
    window.addEventListener("hashchange", function () { readHash(); });
  }

  // ---------------------------------------------------------------- the list
  var LIST_COLS = [ // key, header, numeric
    ["seq", "seq", true], ["rank", "rank", true], ["why", "chosen as", false], ["reward", "reward", true],
    ["advantage", "advantage", true], ["length", "length", true], ["mean_entropy", "mean entropy", true],
    ["clipped", "clipped", true], ["erc_dropped", "ERC-dropped", true], ["entropy_effect", "entropy effect", true]
  ].filter(function (c) { return c[0] !== "rank" || MULTI_RANK; }); // rank: only where the run has several
  function listValue(r, k) {
    if (k === "seq") return r.seq;
    if (k === "rank") return r.rank;
    if (k === "why") return (r.why || []).join(", ");
    return num((r.summary || {})[k]);
  }
  function findResp(sd, seq, rank) {
    if (!sd) return null;
    var hit = null;
    sd.responses.forEach(function (r) {
      if (r.seq === seq && (rank === null || rank === undefined || isNaN(rank) || r.rank === rank) && !hit) hit = r;
    });
    return hit;
  }
  function sortedResponses(sd) {
    var rs = sd.responses.slice();
    var k = state.sortKey;
    if (!k) return rs;
    rs.sort(function (a, b) {
      var x = listValue(a, k), y = listValue(b, k);
      var xn = x === null || x === undefined || x !== x, yn = y === null || y === undefined || y !== y;
      if (xn || yn) return xn === yn ? 0 : (xn ? 1 : -1); // no value: last, either way
      if (x < y) return -state.sortDir;
      if (x > y) return state.sortDir;
      return a.rank - b.rank || a.seq - b.seq;
    });
    return rs;
  }
  function renderList() {
    var sd = stepData(state.step), body = el.list.tBodies[0];
    body.textContent = "";
    Array.prototype.forEach.call(el.list.tHead.rows[0].cells, function (th) {
      var k = th.getAttribute("data-key");
      th.classList.toggle("sorted", k === state.sortKey);
      th.setAttribute("aria-sort", k !== state.sortKey ? "none" : (state.sortDir > 0 ? "ascending" : "descending"));
      th.setAttribute("data-arrow", k !== state.sortKey ? "" : (state.sortDir > 0 ? " \u25b2" : " \u25bc"));
    });
    if (!sd) return;
    var frag = document.createDocumentFragment();
    sortedResponses(sd).forEach(function (r) {
      var tr = h("tr", { "data-seq": String(r.seq), "data-rank": String(r.rank) });
      if (r === state.resp) tr.className = "sel";
      LIST_COLS.forEach(function (c) {
        var v = listValue(r, c[0]), raw = c[0] in (r.summary || {}) ? r.summary[c[0]] : v;
        var td = h("td", { "data-key": c[0] }, c[2] ? fmt(v) : v);
        if (c[2]) { td.className = "num"; td.title = show(raw); }
        tr.appendChild(td);
      });
      frag.appendChild(tr);
    });
    body.appendChild(frag);
  }

  // ---------------------------------------------------------------- navigation
  function openStep(step, want) {
    var sd = stepData(step);
    if (!sd) return;
    state.step = step;
    el.step.value = String(step);
    el.update.textContent = "";
    sd.updates.forEach(function (u) { el.update.appendChild(h("option", { value: String(u) }, "update " + u)); });
    if (want.update !== undefined && sd.updates.indexOf(want.update) >= 0) state.update = want.update;
    else if (sd.updates.indexOf(state.update) < 0) state.update = sd.updates.length ? sd.updates[sd.updates.length - 1] : null;
    var r = want.seq !== undefined ? findResp(sd, want.seq, want.rank) : null;
    if (want.seq !== undefined && !r) state.note = (state.note ? state.note + " " : "") +
      "Sequence " + want.seq + " has no embedded response at step " + step + ": showing another.";
    if (!r) r = sortedResponses(sd)[0] || null;
    state.resp = null;
    renderList();
    if (r) showResponse(r);
    else { el.response.hidden = true; writeHash(); }
  }

  function readHash() {
    var q = {};
    (location.hash || "").replace(/^#/, "").split("&").forEach(function (kv) {
      if (!kv) return;
      var i = kv.indexOf("=");
      var k = decodeURIComponent(i < 0 ? kv : kv.slice(0, i)), v = i < 0 ? "" : decodeURIComponent(kv.slice(i + 1));
      q[k] = v;
    });
    if (q.metric && MET[q.metric]) { state.metric = q.metric; el.metric.value = q.metric; }
    var want = {};
    if (q.seq !== undefined && q.seq !== "" && !isNaN(Number(q.seq))) want.seq = Number(q.seq);
    if (q.rank !== undefined && q.rank !== "" && !isNaN(Number(q.rank))) want.rank = Number(q.rank);
    if (q.update !== undefined && q.update !== "" && !isNaN(Number(q.update))) want.update = Number(q.update);
    state.note = "";
    var step = q.step !== undefined && q.step !== "" ? Number(q.step) : NaN;
    if (!STEPS.length) return;
    if (isNaN(step)) step = state.step !== null ? state.step : STEPS[0].step;
    if (!stepData(step)) { // the nearest step with responses
      var best = STEPS[0].step;
      STEPS.forEach(function (s) { if (Math.abs(s.step - step) < Math.abs(best - step)) best = s.step; });
      state.note = "Step " + step + " has no embedded responses: showing step " + best + ".";
      delete want.seq;
      step = best;
    }
    openStep(step, want);
  }

  var lastHash = null;
  function writeHash() {
    var parts = [];
    if (state.step !== null) parts.push("step=" + state.step);
    if (state.resp) {
      parts.push("seq=" + state.resp.seq);
      var sd = stepData(state.step), same = sd ? sd.responses.filter(function (r) { return r.seq === state.resp.seq; }).length : 1;
      if (state.resp.rank !== 0 || same > 1) parts.push("rank=" + state.resp.rank);
    }
    if (state.update !== null) parts.push("update=" + state.update);
    parts.push("metric=" + encodeURIComponent(state.metric));
    var hh = "#" + parts.join("&");
    if (hh === lastHash) return;
    lastHash = hh;
    try { history.replaceState(null, "", hh); } catch (e) { /* a page without history: keep going */ }
  }

  // ---------------------------------------------------------------- one response
  // a token's text into its span: a newline as \u23ce and the line break, a tab as \u21e5 and the tab, a lone
  // carriage return as \u240d, every other invisible character as a mark; a token of default-ignorable
  // characters only (a variation selector, a Hangul filler) is marked whole: no token is drawn as nothing
  var GLYPHS = { "\r\n": "\u23ce\n", "\n": "\u23ce\n", "\r": "\u240d", "\t": "\u21e5\t" };
  function fillToken(sp, s) {
    if (s === null || s === undefined || s === "") { sp.textContent = "\u2205"; return; }
    s = String(s);
    fillMarked(sp, s.replace(/\r\n|\n|\r|\t/g, function (m) { return GLYPHS[m]; }), "\n\t", IGNORABLE_ONLY.test(s));
  }

  function showResponse(resp) {
    state.resp = resp;
    state.pinned = null;
    el.response.hidden = false;
    var ups = respUpdates(resp);
    if (ups.indexOf(state.update) < 0 && ups.length) { // the response's update nearest the chosen one (later on a tie)
      var want = state.update === null ? ups[ups.length - 1] : state.update;
      state.update = ups.reduce(function (a, u) { return Math.abs(u - want) <= Math.abs(a - want) ? u : a; }, ups[0]);
    }
    Array.prototype.forEach.call(el.update.options, function (o) {
      var u = Number(o.value), has = ups.indexOf(u) >= 0;
      o.disabled = !has;
      o.textContent = "update " + u + (has ? "" : " (not this response's)");
    });
    el.update.value = String(state.update);
    Array.prototype.forEach.call(el.list.tBodies[0].rows, function (tr) {
      tr.classList.toggle("sel", Number(tr.getAttribute("data-seq")) === resp.seq &&
        Number(tr.getAttribute("data-rank")) === resp.rank);
    });

    // the spans: built once per response, recoloured on update / metric change
    var fork = {};
    (resp.forking || []).forEach(function (p) { fork[p] = true; });
    var frag = document.createDocumentFragment(), spans = new Array(resp.pos.length), index = {}, prev = null;
    for (var i = 0; i < resp.pos.length; i++) {
      var p = resp.pos[i];
      if (prev !== null && p > prev + 1) {
        var gap = h("span", { "class": "gap", title: "positions " + (prev + 1) + (p - 1 > prev + 1 ? "\u2013" + (p - 1) : "") +
           " have no token rows" }, "\u2026");
        frag.appendChild(gap);
      }
      if (i > 0 && D.separator) frag.appendChild(document.createTextNode(D.separator));
      var sp = document.createElement("span");
      sp.className = fork[p] ? "tk forking" : "tk";
      sp.setAttribute("data-pos", String(p));
      sp.setAttribute("data-i", String(i));
      var s = resp.tokens ? resp.tokens[i] : null;
      fillToken(sp, s);
      if (s === "" || s === null || s === undefined) sp.classList.add("empty");
      frag.appendChild(sp);
      spans[i] = sp;
      index[p] = i;
      prev = p;
    }
    el.text.textContent = "";
    el.text.appendChild(frag);
    view = { resp: resp, spans: spans, index: index };

    // the response's head
    var sm = resp.summary || {};
    var bits = [["seq", resp.seq], ["rank", resp.rank], ["group", resp.group], ["generated at step", resp.gen_step],
      ["reward", sm.reward], ["advantage", sm.advantage], ["length", sm.length], ["mean entropy", sm.mean_entropy],
      ["clipped (all updates)", sm.clipped], ["ERC-dropped (all updates)", sm.erc_dropped],
      ["entropy effect", sm.entropy_effect]];
    var hd = '<h2>Response: seq ' + esc(resp.seq) + (MULTI_RANK ? " (rank " + esc(resp.rank) + ")" : "") +
      " at step " + esc(state.step) + "</h2>";
    hd += '<p class="el-why">chosen as: ' + esc((resp.why || []).join(", ") || "(matching)") + "</p>";
    hd += '<dl class="el-summary">' + bits.map(function (b) {
      return "<div><dt>" + esc(b[0]) + "</dt><dd title=\"" + esc(show(b[1])) + "\">" + esc(fmt(num(b[1]) === null ? b[1] : num(b[1]))) + "</dd></div>";
    }).join("") + "</dl>";
    var recorded = resp.pos.length;
    if (sm.length !== null && sm.length !== undefined && recorded < sm.length) {
      hd += '<p class="el-muted">' + recorded + " of " + sm.length + " positions have token rows (the others were masked " +
        "out of the loss, or not sampled): each stretch without rows is shown as \u2026, nothing invented.</p>";
    }
    el["resp-head"].innerHTML = hd;
    var comp = el.completion;
    if (resp.text !== null && resp.text !== undefined) {
      comp.hidden = false;
      var pre = comp.querySelector("pre");
      pre.textContent = "";
      fillMarked(pre, String(resp.text), "\n\t", false);
    } else {
      comp.hidden = true;
    }
    drawUpdates();
    recolor();
  }

  function currentRows() { return view ? rowsAt(view.resp, state.update) : []; }

  function recolor() {
    if (!view) return;
    var metric = MET[state.metric], rows = currentRows();
    var s = scaleFor(metric, rows);
    view.scale = s;
    for (var i = 0; i < view.spans.length; i++) {
      var c = s.at(i), st = view.spans[i].style;
      if (c === null) { // no row at this update
        st.backgroundColor = ""; st.color = "";
        view.spans[i].classList.add("norow");
      } else {
        st.backgroundColor = c[0]; st.color = c[1];
        view.spans[i].classList.remove("norow");
      }
    }
    drawLegend(metric, s, rows);
    drawChart();
    el.note.textContent = state.note || "";
    if (state.pinned !== null) detail(state.pinned);
    else showDetailHint();
    writeHash();
  }

  function showDetailHint() {
    el.details.innerHTML = '<p class="el-muted">Hover or click a token to see all its values at update ' +
      esc(state.update) + ".</p>";
  }

  function drawLegend(metric, s, rows) {
    var nf = view.resp.forking ? view.resp.forking.length : 0, out = '<div class="lg-title">' + esc(metric.label) +
      ' <span class="el-muted">at update ' + esc(state.update) + "</span></div>";
    if (s.kind === "categorical") {
      var counts = {}, seen = [];
      s.values.forEach(function (v) {
        if (v === undefined) return;
        var k = v === null ? "\u0000null" : String(v);
        if (!(k in counts)) { counts[k] = 0; seen.push(v); }
        counts[k]++;
      });
      var cats = (metric.categories || []).slice();
      seen.forEach(function (v) { if (!cats.some(function (c) { return c[0] === v; })) cats.push([v, v === null ? "no value" : String(v)]); });
      out += '<div class="lg-cats">' + cats.map(function (c) {
        var k = c[0] === null ? "\u0000null" : String(c[0]), n = counts[k] || 0, col = catColor(metric.key, c[0]);
        return '<span class="lg-cat' + (n ? "" : " lg-zero") + '" data-cat="' + esc(c[0] === null ? "null" : c[0]) +
          '"><i style="background:' + col + '"></i>' + esc(c[1]) + ' <b>' + n + "</b></span>";
      }).join("") + "</div>";
    } else {
      var ends = s.n ? [s.lo, s.hi] : [null, null];
      out += '<div class="lg-scale"><span class="lg-end">' + esc(fmt(ends[0])) + '</span><span class="lg-bar" style="background:' +
        gradient(s.stops) + '"></span><span class="lg-end">' + esc(fmt(ends[1])) + "</span></div>";
      out += '<div class="lg-range">min <b data-role="min">' + esc(show(s.min)) + '</b> \u00b7 max <b data-role="max">' +
        esc(show(s.max)) + "</b> over " + s.n + " token" + (s.n === 1 ? "" : "s");
      if (s.kind === "diverging") out += " \u00b7 white at " + esc(fmt(s.center)) + ", symmetric";
      if (s.kind === "log") out += " \u00b7 white at " + esc(fmt(s.center)) + ", symmetric on a log scale" +
        (s.floored ? " (at least \u00b11%)" : "");
      out += ' \u00b7 <i class="lg-null"></i> no value</div>';
    }
    out += '<div class="lg-marks"><span class="tk forking lg-sample">abc</span> forking: the top ' +
      Math.round(100 * SHARE) + "% of the response by sampling entropy (" + nf + " token" + (nf === 1 ? "" : "s") + ")";
    if (D.has_text) out += ' \u00b7 <span class="tk lg-sample">\u23ce</span> newline';
    if (el.text.querySelector(".gap")) out += ' \u00b7 <span class="gap">\u2026</span> positions without token rows';
    if (el.text.querySelector(".norow")) out += ' \u00b7 <span class="tk norow lg-sample">abc</span> no row at this update';
    out += "</div>";
    el.legend.innerHTML = out;
  }

  function detail(i) {
    if (!view || !view.spans[i]) return;
    var resp = view.resp, row = currentRows()[i], p = resp.pos[i];
    var tok = resp.tokens ? resp.tokens[i] : null;
    var out = '<div class="dt-head"><code class="dt-tok" data-role="token">' + esc(visible(JSON.stringify(tok === undefined ? null : tok))) +
      '</code><div>position <b data-role="pos">' + esc(p) + "</b> \u00b7 update <b data-role=\"update\">" + esc(state.update) +
      "</b>" + (view.spans[i].classList.contains("forking") ? ' \u00b7 <b class="dt-fork">forking</b>' : "") + "</div></div>";
    if (!row) {
      out += '<p class="el-muted">No row of this token at update ' + esc(state.update) + ".</p>";
    } else {
      out += '<p class="dt-cats">clip status: <b>' + esc(show(category("clip", row))) + "</b> \u00b7 ERC: <b>" +
        esc(show(category("erc", row))) + "</b></p>";
      out += '<table class="dt-table">' + COLS.map(function (c, k) {
        return '<tr data-col="' + esc(c) + '"' + (c === state.metric ? ' class="cur"' : "") + "><th>" + esc(c) +
          '</th><td class="v">' + esc(show(row[k])) + "</td></tr>";
      }).join("") + "</table>";
    }
    el.details.innerHTML = out;
    var line = el.chart.querySelector(".ch-cursor");
    if (line && view.xmap) {
      var x = view.xmap(p);
      line.setAttribute("x1", x); line.setAttribute("x2", x); line.setAttribute("visibility", "visible");
    }
    Array.prototype.forEach.call(el.text.querySelectorAll(".hover"), function (e) { e.classList.remove("hover"); });
    view.spans[i].classList.add("hover");
  }

  // ---------------------------------------------------------------- charts (SVG markup)
  function niceTicks(lo, hi, n) {
    if (!(hi > lo)) return [lo];
    var step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n))), err = (hi - lo) / n / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var out = [];
    for (var v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return out;
  }
  function xScale(resp, x0, x1) {
    var p0 = resp.pos.length ? resp.pos[0] : 0, p1 = resp.pos.length ? resp.pos[resp.pos.length - 1] : 1;
    if (p1 === p0) p1 = p0 + 1;
    return function (p) { return x0 + (x1 - x0) * (p - p0) / (p1 - p0); };
  }
  function xAxis(resp, xm, y, x0, x1) {
    var p0 = resp.pos[0] || 0, p1 = resp.pos.length ? resp.pos[resp.pos.length - 1] : 0;
    var out = '<line class="ax" x1="' + x0 + '" x2="' + x1 + '" y1="' + y + '" y2="' + y + '"/>';
    niceTicks(p0, Math.max(p1, p0 + 1), Math.max(2, Math.floor((x1 - x0) / 80))).forEach(function (t) {
      if (t !== Math.round(t) || t > p1) return;
      var x = xm(t).toFixed(1);
      out += '<line class="ax" x1="' + x + '" x2="' + x + '" y1="' + y + '" y2="' + (y + 4) + '"/><text class="tl" x="' +
        x + '" y="' + (y + 15) + '" text-anchor="middle">' + t + "</text>";
    });
    return out + '<text class="tl" x="' + x1 + '" y="' + (y + 28) + '" text-anchor="end">position</text>';
  }
  // a y axis for a continuous scale: value -> pixel, ticks
  function yScaleFor(kind, lo, hi, center, y0, y1) {
    var f, ticks;
    if (kind === "log") {
      var a = Math.log(lo), b = Math.log(hi);
      if (!(b > a)) { a -= 0.05; b += 0.05; }
      f = function (v) { return y1 - (y1 - y0) * (Math.log(Math.max(v, 1e-300)) - a) / (b - a); };
      ticks = [a, (a + Math.log(center)) / 2, Math.log(center), (b + Math.log(center)) / 2, b].map(Math.exp);
    } else {
      if (!(hi > lo)) { lo -= 0.5; hi += 0.5; }
      f = function (v) { return y1 - (y1 - y0) * (v - lo) / (hi - lo); };
      ticks = niceTicks(lo, hi, 4);
    }
    var lim = function (v) { return Math.max(y0 - 2, Math.min(y1 + 2, f(v))); };
    var digits = 3;
    while (digits < 9 && new Set(ticks.map(function (t) { return fmt(t, digits); })).size < ticks.length) digits++;
    return { f: lim, ticks: ticks, lab: function (v) { return fmt(v, digits); } };
  }

  function drawChart() {
    if (!view) return;
    var resp = view.resp, metric = MET[state.metric], s = view.scale, rows = currentRows();
    var W = Math.max(360, el.chart.clientWidth || 900), L = 64, R = 12, T = 10;
    var title = function () {
      return '<text class="tl tt" x="' + L + '" y="13">' + esc(metric.label) + (metric.scale === "log" ? " (log scale)" : "") +
        " \u00b7 update " + esc(state.update) + "</text>";
    };
    var xm, out, n = resp.pos.length;
    if (s.kind === "categorical") {
      var cats = (metric.categories || []).map(function (c) { return c[0]; });
      s.values.forEach(function (v) { if (v !== undefined && cats.indexOf(v) < 0) cats.push(v); });
      T = 22;
      L = Math.max(L, 12 + 7 * Math.max.apply(null, cats.map(function (c) { return String(c === null ? "null" : c).length; })));
      var span = resp.pos.length ? resp.pos[resp.pos.length - 1] - resp.pos[0] + 1 : 1;
      var bw = Math.max(1.5, (W - L - R) / Math.max(span, 1) - 0.5);
      xm = xScale(resp, L + bw / 2, W - R - bw / 2);
      var lane = 18, H = T + lane * cats.length + 34;
      out = '<svg class="el-svg" width="' + W + '" height="' + H + '" role="img" aria-label="' + esc(metric.label) + ' by position">';
      cats.forEach(function (c, k) {
        var y = T + k * lane;
        out += '<rect class="lane" x="' + L + '" y="' + y + '" width="' + (W - L - R) + '" height="' + (lane - 2) + '"/>';
        out += '<text class="tl" x="' + (L - 6) + '" y="' + (y + lane - 6) + '" text-anchor="end">' + esc(c === null ? "null" : c) + "</text>";
      });
      s.values.forEach(function (v, i) {
        if (v === undefined) return;
        var k = cats.indexOf(v), x = xm(resp.pos[i]) - bw / 2;
        out += '<rect x="' + x.toFixed(1) + '" y="' + (T + k * lane) + '" width="' + bw.toFixed(1) + '" height="' + (lane - 2) +
          '" fill="' + catColor(metric.key, v) + '"><title>pos ' + resp.pos[i] + ": " + esc(show(v)) + "</title></rect>";
      });
      out += title() + xAxis(resp, xm, T + lane * cats.length + 2, L, W - R);
    } else {
      T = 24;
      xm = xScale(resp, L, W - R);
      var H2 = 240, B = 36, y0 = T, y1 = H2 - B;
      var lo = s.n ? s.min : 0, hi = s.n ? s.max : 1;
      if (s.kind === "log") { lo = s.lo; hi = s.hi; }
      if (s.kind === "diverging") { lo = Math.min(lo, s.center); hi = Math.max(hi, s.center); }
      var ys = yScaleFor(s.kind, lo, hi, s.center, y0, y1);
      out = '<svg class="el-svg" width="' + W + '" height="' + H2 + '" role="img" aria-label="' + esc(metric.label) + ' by position">';
      ys.ticks.forEach(function (t) {
        var y = ys.f(t).toFixed(1);
        out += '<line class="grid" x1="' + L + '" x2="' + (W - R) + '" y1="' + y + '" y2="' + y + '"/><text class="tl" x="' + (L - 6) +
          '" y="' + y + '" dy="4" text-anchor="end">' + esc(ys.lab(t)) + "</text>";
      });
      if (s.kind === "log" || s.kind === "diverging") {
        var yc = ys.f(s.center).toFixed(1);
        out += '<line class="ref" x1="' + L + '" x2="' + (W - R) + '" y1="' + yc + '" y2="' + yc + '"/>';
      }
      var d = "", pen = false, prev = null;
      s.values.forEach(function (v, i) {
        var p = resp.pos[i];
        var ok = v !== undefined && v !== null && isFinite(v) && !(s.kind === "log" && !(v > 0));
        if (!ok || (prev !== null && p > prev + 1)) pen = false;
        if (ok) {
          d += (pen ? "L" : "M") + xm(p).toFixed(1) + " " + ys.f(v).toFixed(1);
          pen = true;
        }
        prev = p;
      });
      out += '<path class="ln" d="' + d + '"/>';
      if (n <= 1500) {
        var rr = n > 400 ? 1.6 : 3;
        s.values.forEach(function (v, i) {
          if (v === undefined || v === null || !isFinite(v) || (s.kind === "log" && !(v > 0))) return;
          var c = s.at(i);
          out += '<circle cx="' + xm(resp.pos[i]).toFixed(1) + '" cy="' + ys.f(v).toFixed(1) + '" r="' + rr + '" fill="' + c[0] + '"/>';
        });
      }
      out += title();
      out += xAxis(resp, xm, y1, L, W - R);
      // forking tokens: ticks under the axis
      (resp.forking || []).forEach(function (p) {
        var x = xm(p).toFixed(1);
        out += '<path class="fk" d="M' + x + " " + (y1 + 1) + "l-3 6h6z\"/>";
      });
    }
    view.xmap = xm;
    out += '<line class="ch-cursor" x1="0" x2="0" y1="' + T + '" y2="' + (T + 1000) + '" visibility="hidden"/></svg>';
    if (s.kind !== "categorical") out += '<p class="el-muted ch-note">\u25b2 under the axis: forking tokens. Click the chart to pick the nearest token.</p>';
    el.chart.innerHTML = out;
    var cur = el.chart.querySelector(".ch-cursor"), svgH = el.chart.querySelector("svg").getAttribute("height");
    cur.setAttribute("y2", String(Number(svgH) - 34));
  }

  function mean(xs) {
    var s = 0, n = 0;
    xs.forEach(function (v) { if (v !== null && v !== undefined && isFinite(v)) { s += v; n++; } });
    return n ? s / n : null;
  }

  function drawUpdates() {
    if (!view) return;
    var resp = view.resp, ups = respUpdates(resp), sd = stepData(state.step);
    var W = Math.max(360, el.updates.clientWidth || 900), half = ups.length ? Math.floor((W - 10) / 2) : W;
    var panels = [["ratio", "importance ratio r"], ["entropy_ratio", "entropy ratio H / H_old"]];
    var out = '<div class="up-keys">' + ups.map(function (u, k) {
      return '<span class="up-key"><i style="background:' + UPDATE_COLORS[k % UPDATE_COLORS.length] + '"></i>update ' + u + "</span>";
    }).join("") + (sd && sd.updates.length > ups.length ? '<span class="el-muted">(this response is in ' + ups.length + " of the step's " +
      sd.updates.length + " updates)</span>" : "") + "</div>";
    out += '<div class="up-panels">';
    panels.forEach(function (pn) {
      var key = pn[0], per = ups.map(function (u) {
        return rowsAt(resp, u).map(function (r) { return r ? num(r[CI[key]]) : undefined; });
      });
      var lo = Infinity, hi = -Infinity;
      per.forEach(function (xs) { xs.forEach(function (v) { if (v > 0 && isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); } }); });
      var m = lo <= hi ? Math.max(Math.abs(Math.log(lo)), Math.abs(Math.log(hi)), LOG_FLOOR) : LOG_FLOOR;
      var L = 56, R = 8, T = 22, H = 200, B = 32, y0 = T, y1 = H - B;
      var xm = xScale(resp, L, half - R), ys = yScaleFor("log", Math.exp(-m), Math.exp(m), 1, y0, y1);
      var svg = '<svg class="el-svg" width="' + half + '" height="' + H + '" data-metric="' + key + '">';
      svg += '<text class="tl" x="' + L + '" y="14">' + esc(pn[1]) + " (log scale)</text>";
      ys.ticks.forEach(function (t) {
        var y = ys.f(t).toFixed(1);
        svg += '<line class="grid" x1="' + L + '" x2="' + (half - R) + '" y1="' + y + '" y2="' + y + '"/><text class="tl" x="' + (L - 6) +
          '" y="' + y + '" dy="4" text-anchor="end">' + esc(ys.lab(t)) + "</text>";
      });
      var yc = ys.f(1).toFixed(1);
      svg += '<line class="ref" x1="' + L + '" x2="' + (half - R) + '" y1="' + yc + '" y2="' + yc + '"/>';
      per.forEach(function (xs, k) {
        var d = "", pen = false, prev = null;
        xs.forEach(function (v, i) {
          var p = resp.pos[i], ok = v !== undefined && v !== null && v > 0 && isFinite(v);
          if (!ok || (prev !== null && p > prev + 1)) pen = false;
          if (ok) { d += (pen ? "L" : "M") + xm(p).toFixed(1) + " " + ys.f(v).toFixed(1); pen = true; }
          prev = p;
        });
        svg += '<path class="ln up" data-update="' + ups[k] + '" style="stroke:' + UPDATE_COLORS[k % UPDATE_COLORS.length] + '" d="' + d + '"/>';
      });
      svg += xAxis(resp, xm, y1, L, half - R) + "</svg>";
      out += svg;
    });
    out += "</div>";
    out += '<table class="up-table"><thead><tr><th>update</th><th class="num">tokens</th><th class="num">mean ratio</th>' +
      '<th class="num">min ratio</th><th class="num">max ratio</th><th class="num">mean entropy ratio</th>' +
      '<th class="num">mean entropy</th><th class="num">clipped</th><th class="num">ERC-dropped</th></tr></thead><tbody>';
    ups.forEach(function (u, k) {
      var rows = rowsAt(resp, u).filter(function (r) { return r; });
      var rat = rows.map(function (r) { return num(r[CI.ratio]); }), er = rows.map(function (r) { return num(r[CI.entropy_ratio]); });
      var fin = rat.filter(function (v) { return v !== null && isFinite(v); });
      var clipped = rows.filter(function (r) { return r[CI.clipped] === true; }).length;
      var dropped = rows.filter(function (r) { return r[CI.erc_kept] === false; }).length;
      var ercNull = rows.every(function (r) { return r[CI.erc_kept] === null; });
      out += '<tr data-update="' + u + '"><td><i class="up-sw" style="background:' + UPDATE_COLORS[k % UPDATE_COLORS.length] +
        '"></i>' + u + '</td><td class="num" data-key="tokens">' + rows.length + '</td><td class="num" data-key="mean_ratio">' +
        fmt(mean(rat), 5) + '</td><td class="num">' + fmt(fin.length ? Math.min.apply(null, fin) : null, 4) +
        '</td><td class="num">' + fmt(fin.length ? Math.max.apply(null, fin) : null, 4) +
        '</td><td class="num" data-key="mean_entropy_ratio">' + fmt(mean(er), 5) + '</td><td class="num">' +
        fmt(mean(rows.map(function (r) { return num(r[CI.entropy]); })), 4) + '</td><td class="num" data-key="clipped">' + clipped +
        '</td><td class="num" data-key="erc_dropped">' + (ercNull ? "\u2013" : dropped) + "</td></tr>";
    });
    out += "</tbody></table>";
    el.updates.innerHTML = out;
  }

  // ---------------------------------------------------------------- start
  build();
  if (!STEPS.length) {
    el.response.hidden = true;
    document.querySelector(".el-controls").hidden = true;
    document.querySelector(".el-listbox").hidden = true;
    var none = h("p", { id: "el-empty", "class": "el-hint" }, "No responses are embedded for this run" +
      (D.where ? " (none matches --where " + visible(D.where) + ")" : "") + ".");
    document.getElementById("el-app").insertBefore(none, document.getElementById("el-app").firstChild);
    document.body.setAttribute("data-ready", "1");
    return;
  }
  readHash();
  document.body.setAttribute("data-ready", "1");
})();
