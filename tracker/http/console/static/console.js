// The console's only script: selects marked data-autosubmit submit their form when changed.
document.addEventListener("change", function (ev) {
  var el = ev.target;
  if (el && el.hasAttribute && el.hasAttribute("data-autosubmit") && el.form) {
    el.form.submit();
  }
});
