// The console's only script of its own: copy buttons. Everything else is HTMX attributes.
document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-copy]");
  if (!button) return;
  const field = document.querySelector(button.dataset.copy);
  const note = button.parentElement.querySelector(".copied");
  field.select();
  const done = () => { if (note) note.textContent = "Copied."; };
  if (navigator.clipboard && window.isSecureContext) {
    navigator.clipboard.writeText(field.value).then(done, () => { document.execCommand("copy"); done(); });
  } else {
    document.execCommand("copy");
    done();
  }
});
