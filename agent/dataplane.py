"""The agent's nftables dataplane: the one table it owns, replaced whole.

Standard library and the ``nftables`` binding (libnftables through ctypes) only; the agent
never imports Django or the control plane.

``apply`` sends ``add table`` + ``delete table`` + the document as ONE libnftables batch:
the kernel commits it as one transaction, so no packet ever meets a half-built table or
no table, and a refused batch leaves the previous table exactly as it was. The batch goes
through an in-memory file (memfd) because libnftables reports real line and column
positions only for files; positions in errors are rewritten to lines of the document.

An ``Nftables`` context is not safe to share between threads: each NftablesDataplane owns
its own, so use one instance per thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import re

from agent.tablewatch import NFPROTO_INET, table_exists

TABLE_FAMILY = "inet"
TABLE_NAME = "palisade"
TABLE = f"{TABLE_FAMILY} {TABLE_NAME}"
BATCH_HEADER = f"add table {TABLE}\ndelete table {TABLE}\n"
_HEADER_LINES = BATCH_HEADER.count("\n")
# Errors quote whole lines of the document; keep a refusal report a reasonable size.
_MAX_ERROR_CHARS = 16_000


def _find_malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: freed memory simply stays with the process
        return None


_malloc_trim = _find_malloc_trim()

_POSITION = re.compile(r"^/proc/self/fd/\d+:(\d+):", re.MULTILINE)
# Braces count only outside strings and comments; matching those whole skips what they hold.
_STRUCTURE = re.compile(r'"[^"\n]*"|#[^\n]*|[{}]')
# Statements that could reach beyond the table (read files, or define text for elsewhere).
_FOREIGN_STATEMENT = re.compile(r"^\s*(include|define|redefine|undefine)\b", re.MULTILINE)


class ApplyError(Exception):
    """libnftables (or the kernel) refused a document; the previous table is unchanged."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NftablesDataplane:
    def __init__(self) -> None:
        # Imported here, not at the top: the agent's other parts (simulated agents, status,
        # enrolment) must work on hosts without libnftables, and its absence must surface as
        # an error the CLI can explain (ImportError here, OSError when loading the library).
        import nftables

        self._nftables = nftables
        self._nft = self._new_context()

    def _new_context(self):
        context = self._nftables.Nftables()
        context.set_json_output(False)
        return context

    def _release_batch_memory(self) -> None:
        """A context that applied a large batch keeps its parse and cache (tens of MB for 10,000
        rules): swap it for a fresh one, and hand the freed heap back to the system."""
        self._nft = self._new_context()
        gc.collect()
        if _malloc_trim is not None:
            _malloc_trim(0)

    def apply(self, document: str) -> None:
        """Replace the owned table with ``document`` (the text of ``table inet palisade {...}``)."""
        problem = owned_table_problem(document)
        if problem is not None:
            raise ApplyError(problem)
        try:
            rc, _output, error = self._run_batch(BATCH_HEADER + document)
        finally:
            self._release_batch_memory()
        if rc != 0:
            raise ApplyError(_explain(error, rc))

    def dry_run_check(self, document: str) -> str | None:
        """The error apply() would raise, found without changing anything; None if it would apply.

        Dry runs go through the kernel, so they catch most of what only the kernel refuses (a
        set over its size, say) but not all: on kernel 6.18 a jump loop between chains new in
        the batch passed a dry run and was refused only by apply().
        """
        problem = owned_table_problem(document)
        if problem is not None:
            return problem
        self._nft.set_dry_run(True)
        try:
            rc, _output, error = self._run_batch(BATCH_HEADER + document)
        finally:
            self._nft.set_dry_run(False)
        return None if rc == 0 else _explain(error, rc)

    def remove(self) -> bool:
        """Delete the owned table (the local kill switch). False when it was not there."""
        if not self.table_present():
            return False
        rc, _output, error = self._nft.cmd(f"delete table {TABLE}")
        if rc != 0:
            if not self.table_present():  # deleted by someone else in between
                return False
            raise ApplyError(_explain(error, rc))
        return True

    def end_denied(self, document: str) -> int:
        """End the open connections that the applied `document`'s deny rules refuse (agent/deny.py)."""
        from agent.deny import end_denied_connections

        return end_denied_connections(document)

    def table_present(self) -> bool:
        try:
            return table_exists(NFPROTO_INET, TABLE_NAME)
        except OSError as error:
            raise ApplyError(f"cannot ask the kernel for table {TABLE}: {error.strerror or error}") from None

    def _run_batch(self, text: str) -> tuple[int, str, str]:
        fd = os.memfd_create("palisade-batch", os.MFD_CLOEXEC)
        try:
            data = text.encode()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            return self._nft.cmd_from_file(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)


def owned_table_problem(document: str) -> str | None:
    """Why ``document`` is not just the owned table, or None.

    The agent touches no other table, so anything outside ``table inet palisade { ... }``
    (another table, a flush, an include) is refused before libnftables sees it.
    """
    text = document.strip()
    header = re.match(rf"table\s+{TABLE_FAMILY}\s+{TABLE_NAME}\s*\{{", text)
    if header is None:
        return f"document must be exactly one 'table {TABLE} {{ ... }}' block"
    if _FOREIGN_STATEMENT.search(text):
        return "document must not include files or define variables"
    depth = 0
    for token in _STRUCTURE.finditer(text):
        char = token.group()
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                if text[token.end() :].strip():
                    return f"document has text after the 'table {TABLE}' block"
                return None
    return f"the 'table {TABLE}' block is not closed"


def _explain(error: str, rc: int) -> str:
    def relocate(match: re.Match[str]) -> str:
        line = int(match.group(1))
        if line <= _HEADER_LINES:
            return f"batch:{line}:"
        return f"document:{line - _HEADER_LINES}:"

    message = _POSITION.sub(relocate, error.strip()) or f"libnftables failed with code {rc} and no message"
    if len(message) > _MAX_ERROR_CHARS:
        message = message[:_MAX_ERROR_CHARS] + "\n[... truncated]"
    return message
