// Refreshes the page's live part (#live) in place: fetches the same URL
// with ?fragment=1 every N seconds, N chosen in #refresh-interval and kept
// in localStorage. Without JavaScript the page is complete as served.
// No refresh starts while the previous one is still waiting (a render that
// outlasts the interval must not pile requests up on the server), nor
// while the page is hidden (a background tab).
(function () {
  "use strict";
  var live = document.getElementById("live");
  var select = document.getElementById("refresh-interval");
  var status = document.getElementById("refresh-status");
  if (!live || !select) { return; }
  var stored = window.localStorage.getItem("anarchon-refresh");
  for (var i = 0; i < select.options.length; i++) {
    if (select.options[i].value === stored) { select.value = stored; }
  }
  var timer = null;
  var waiting = false;
  function fragmentUrl() {
    var url = new URL(window.location.href);
    url.searchParams.set("fragment", "1");
    return url.toString();
  }
  function refresh() {
    if (waiting || document.hidden) { return; }
    waiting = true;
    fetch(fragmentUrl(), { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (html) {
        live.innerHTML = html;
        status.textContent = "refreshed " + new Date().toLocaleTimeString();
        status.className = "";
      })
      .catch(function (error) {
        status.textContent = "refresh failed (" + error.message + "), retrying";
        status.className = "failed";
      })
      .then(function () { waiting = false; });
  }
  function schedule() {
    if (timer !== null) { window.clearInterval(timer); timer = null; }
    var seconds = parseInt(select.value, 10);
    // The select says the interval; the status says only when the page was
    // last rendered or refreshed.
    if (seconds > 0) { timer = window.setInterval(refresh, seconds * 1000); }
  }
  select.addEventListener("change", function () {
    window.localStorage.setItem("anarchon-refresh", select.value);
    schedule();
  });
  schedule();
})();
