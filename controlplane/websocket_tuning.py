"""autobahn (daphne's websocket layer) builds the arguments of its debug log lines on every connection
and every read, whether debug lines are written or not, since Python evaluates a call's arguments
before the logger can drop it. Two of them cost serve real time when thousands of agents connect at
once (a failover):

- every new websocket pretty-prints its thirty settings with `pprint.pformat` (8.6 % of the surviving
  process's GIL-holding samples in a 2,000-agent failover, about a millisecond of the reactor a
  connection on a loaded machine); `repr` states the same settings, on one line, in C;
- every read styles the peer and the method's name with click's terminal colours when click is
  installed. The runtime lock has no click (only the test tools bring it), so serve styles nothing in
  production; it styles nothing in the test venv either, so that benchmarks measure what production runs.

Only the debug lines' text changes; what autobahn does with a connection does not.
"""

from __future__ import annotations


def websocket_debug_arguments_cheapen() -> None:
    import autobahn.util
    import autobahn.websocket.protocol

    # Both names are autobahn's module globals (checked by tests/controlplane/test_websocket_tuning.py,
    # so that an upgrade that renames them is noticed rather than silently costing the time again).
    autobahn.websocket.protocol.pformat = repr
    autobahn.util._HAS_CLICK = False
