// Bulk selection on the dead-letter list: select all, a count, actions only with a selection.
(function () {
  "use strict";
  var all = document.getElementById("select-all");
  var rows = Array.prototype.slice.call(document.querySelectorAll("input.row-select"));
  var count = document.getElementById("selected-count");
  var buttons = document.querySelectorAll("[data-needs-selection]");

  function update() {
    var n = rows.filter(function (r) { return r.checked; }).length;
    if (count) { count.textContent = n + " selected"; }
    for (var i = 0; i < buttons.length; i++) { buttons[i].disabled = n === 0; }
    if (all) {
      all.checked = n > 0 && n === rows.length;
      all.indeterminate = n > 0 && n < rows.length;
    }
  }

  if (all) {
    all.addEventListener("change", function () {
      rows.forEach(function (r) { r.checked = all.checked; });
      update();
    });
  }
  rows.forEach(function (r) { r.addEventListener("change", update); });
  update();
})();
