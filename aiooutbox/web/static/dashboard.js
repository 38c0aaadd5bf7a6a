// aiooutbox dashboard: live updates. Served as a file (the Content-Security-Policy
// forbids inline script). The server pushes a "pulse" (server-sent events) when the
// outbox changed; this page then fetches its own content again and swaps <main>.
// Between pulses, the ages on the page tick on by the server's clock: lags
// ([data-since], how long since) and relative times (<time data-at>). The HTML comes
// from our server, rendered with every stored value escaped.
(function () {
  "use strict";
  var body = document.body;
  var main = document.getElementById("live");
  if (!body || !main) { return; }
  // the server's clock minus ours (seconds), from the page and each refetch
  var offset = (parseFloat(body.getAttribute("data-now")) || Date.now() / 1000) - Date.now() / 1000;

  function age(seconds) {  // as aiooutbox.web._data.age
    var s = Math.floor(Math.abs(seconds));
    var text;
    if (s < 60) { text = s + "s"; }
    else if (s < 3600) { text = Math.floor(s / 60) + "m " + ("0" + s % 60).slice(-2) + "s"; }
    else if (s < 86400) { text = Math.floor(s / 3600) + "h " + ("0" + Math.floor(s % 3600 / 60)).slice(-2) + "m"; }
    else { text = Math.floor(s / 86400) + "d " + Math.floor(s % 86400 / 3600) + "h"; }
    return seconds < 0 && s > 0 ? "in " + text : text;
  }

  function tick() {
    var now = Date.now() / 1000 + offset;
    var i, el, at;
    var lags = main.querySelectorAll("[data-since]");
    for (i = 0; i < lags.length; i++) {
      el = lags[i];
      at = parseFloat(el.getAttribute("data-since"));
      if (!isNaN(at)) { el.textContent = age(now - at); }
    }
    var times = main.querySelectorAll("time[data-at]");
    for (i = 0; i < times.length; i++) {
      el = times[i];
      at = parseFloat(el.getAttribute("data-at"));
      if (!isNaN(at)) { el.textContent = now >= at ? age(now - at) + " ago" : age(now - at); }
    }
  }
  window.setInterval(tick, 1000);

  var state = document.getElementById("live-state");
  // no data-live: the answer to a POST, whose URL takes no GET (nothing to refetch)
  if (!window.EventSource || !body.getAttribute("data-live")) { return; }
  var shown = body.getAttribute("data-pulse");  // what the page's data is current to
  var latest = shown;  // the newest pulse the server pushed
  var interval = parseInt(body.getAttribute("data-refresh"), 10) || 2000;
  var busy = false;
  var again = false;
  var later = null;

  function interacting() {
    // don't replace a page the operator is working on: ticked boxes, focused fields,
    // an open <details>
    if (main.querySelector("input[type=checkbox]:checked, details[open]")) { return true; }
    var active = document.activeElement;
    return !!(active && main.contains(active) && /^(INPUT|SELECT|TEXTAREA)$/.test(active.tagName));
  }

  function refresh() {
    if (busy) { again = true; return; }
    if (interacting()) { return; }
    busy = true;
    fetch(window.location.href, {
      headers: { "X-Dashboard-Partial": "1" },
      credentials: "same-origin",
      cache: "no-store"
    }).then(function (response) {
      if (!response.ok) { throw new Error(String(response.status)); }
      var current = response.headers.get("X-Dashboard-Pulse");
      var clock = parseFloat(response.headers.get("X-Dashboard-Now"));
      if (!isNaN(clock)) { offset = clock - Date.now() / 1000; }
      return response.text().then(function (html) { return [html, current]; });
    }).then(function (result) {
      var html = result[0];
      shown = result[1];
      if (shown !== latest && later === null) {
        // the server read this view before the latest change (views are shared for an
        // interval, longer when slow to read): ask again after an interval
        later = window.setTimeout(function () { later = null; refresh(); }, interval);
      }
      if (!interacting()) {
        var doc = new DOMParser().parseFromString("<main>" + html + "</main>", "text/html");
        var fresh = doc.querySelector("main");
        main.replaceChildren.apply(main, Array.prototype.slice.call(fresh.childNodes));
        body.setAttribute("data-refreshed", String(Date.now()));
        tick();
      }
    }).catch(function () { /* the next pulse tries again */ }).then(function () {
      busy = false;
      if (again) { again = false; refresh(); }
    });
  }

  var source = new EventSource(body.getAttribute("data-live"));
  source.onopen = function () { if (state) { state.className = "live on"; } };
  source.onerror = function () { if (state) { state.className = "live off"; } };
  source.onmessage = function (message) {
    latest = message.data;
    if (latest !== shown) { refresh(); }
  };
})();
