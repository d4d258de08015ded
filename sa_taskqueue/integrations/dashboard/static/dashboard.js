// The dashboard's only script: it asks before a destructive action.  Pages work without it.
"use strict";

document.addEventListener("submit", (event) => {
  const button = event.submitter;
  const question = button && button.getAttribute("data-confirm");
  if (question && !window.confirm(question)) {
    event.preventDefault();
  }
});
