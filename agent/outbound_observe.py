"""The outgoing connections of a workload whose outbound mode is `visibility`: recorded, never judged.

The control plane renders an output chain only for an outbound mode other than visibility
(policy/renderer.py), so that a fleet that never uses outbound keeps the documents, and so the versions,
it always had. The agent records the connections every workload opens all the same (issue 34 item 5,
docs/flows.md "Directions"): to a document without an output chain it adds one when it applies it, in
the same batch, that marks each new outgoing connection `observed` with the outbound flag and accepts
every packet. It judges nothing, so the kernel's verdicts are those of the document alone.

Its baseline is the renderer's output chain's, word for word (defined here; the renderer imports it): what that
baseline admits before any mark (loopback, DHCP, neighbour discovery, and the control-plane gateways the
agent fills into the same two sets, agent/gateway_sets.py) is not evidence in simulation or enforced,
so it is not in visibility either, and visibility records exactly the connections the other modes judge.

Standard library only: the agent imports nothing of the control plane.
"""

from __future__ import annotations

from agent.gateway_sets import GATEWAY_SETS

OUTPUT_CHAIN = "\tchain output {"
# (flag OUTBOUND | decision observed) << 24, rule 0: agent/conntrack.py reads it.
OBSERVED_OUTBOUND_MARK = (0x80 | 1) << 24

# The output chain's head and baseline, and the gateway sets' definitions, as the renderer writes them
# too (policy/renderer.py imports these): what the workload sends that no outbound policy may stop.
OUTPUT_HEAD = "\tchain output {\n\t\ttype filter hook output priority filter; policy accept;\n"
ESTABLISHED = '\t\tct state established,related accept comment "baseline: replies to admitted connections"\n'
OUTPUT_BASELINE = (
    '\t\tct state invalid accept comment "not a new connection: the peer judges it"\n'
    '\t\toif "lo" accept comment "baseline: loopback"\n'
    "\t\ticmpv6 type { nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert, "
    "mld-listener-report, mld-listener-done, mld2-listener-report } "
    'accept comment "baseline: IPv6 neighbour/router discovery, multicast listeners"\n'
    '\t\tudp sport 68 udp dport 67 accept comment "baseline: DHCPv4 requests"\n'
    '\t\tudp sport 546 udp dport 547 accept comment "baseline: DHCPv6 requests"\n'
    f"\t\tip daddr . tcp dport @{GATEWAY_SETS[4]} accept "
    'comment "baseline: the control plane this agent uses"\n'
    f"\t\tip6 daddr . tcp dport @{GATEWAY_SETS[6]} accept "
    'comment "baseline: the control plane this agent uses"\n'
)
GATEWAY_SET_DEFINITIONS = "".join(
    f"\tset {name} {{\n\t\ttype {kind} . inet_service\n"
    '\t\tcomment "filled by the agent when it applies the table"\n\t}\n\n'
    for name, kind in ((GATEWAY_SETS[4], "ipv4_addr"), (GATEWAY_SETS[6], "ipv6_addr"))
)
_CHAIN = (
    OUTPUT_HEAD
    + ESTABLISHED
    + OUTPUT_BASELINE
    + f"\t\tct state new ct mark set {OBSERVED_OUTBOUND_MARK:#010x} accept "
    'comment "outbound visibility (added by the agent): recorded, not judged"\n'
    "\t}\n"
)


def with_output_observed(document: str) -> str:
    """`document` with the observe-only output chain and its gateway sets, when it has no output chain
    of its own (unchanged otherwise, and when it is not one table block ending in `}`)."""
    if OUTPUT_CHAIN in document:
        return document
    body = document.rstrip()
    if not body.endswith("}"):
        return document  # not a table the agent can extend: applied as it is, refused as it would be
    return f"{body[:-1].rstrip()}\n\n{GATEWAY_SET_DEFINITIONS}{_CHAIN}}}\n"


def added_text() -> str:
    """What `with_output_observed` adds before the table's closing brace (tests compare it)."""
    return GATEWAY_SET_DEFINITIONS + _CHAIN
