"""agent/deny.py reads the deny rules of the documents policy/renderer.py writes: for every ported
connection its first matching deny line names the rule the classifier says refuses it, or none."""

from __future__ import annotations

import random

import pytest

from agent.deny import deny_lines
from policy.classify import Connection, classify
from policy.renderer import render
from tests.dataplane.test_classifier_against_kernel import PORTS, peer_addresses, random_policy

PROTOCOL_NUMBERS = {"tcp": 6, "udp": 17}


@pytest.mark.parametrize("seed", range(1, 31))
def test_the_agent_reads_the_deny_rules_the_classifier_applies(seed):
    rng = random.Random(seed)
    workload, rulesets, groups, fleet = random_policy(rng, "enforced", 0.4)
    lines = deny_lines(render(workload, rulesets, groups, fleet).document)
    peers = [a for i in (1, 2, 3) for a in sum(peer_addresses(i), [])] + ["10.78.200.1", "fd78::99"]
    for peer in peers:
        for protocol in ("tcp", "udp"):
            for port in PORTS:
                outcome = classify(workload, rulesets, groups, fleet, Connection(peer, protocol, port))
                want = outcome.rule if outcome.decision == "blocked" else None
                found = next(
                    (line.rule for line in lines if line.matches(peer, PROTOCOL_NUMBERS[protocol], port)),
                    None,
                )
                assert found == want, (seed, peer, protocol, port)


def test_a_document_without_deny_rules_has_no_deny_lines():
    workload, rulesets, groups, fleet = random_policy(random.Random(3), "enforced")
    assert deny_lines(render(workload, rulesets, groups, fleet).document) == []


def test_the_agent_reads_the_prefixes_the_renderer_logs():
    from agent.nflog import PREFIX_INBOUND, PREFIX_OUTBOUND, parse_prefix
    from policy.renderer import LOG_PREFIX_INBOUND, LOG_PREFIX_OUTBOUND, blocked_log_prefix, deny_log_prefix

    assert (PREFIX_INBOUND, PREFIX_OUTBOUND) == (LOG_PREFIX_INBOUND, LOG_PREFIX_OUTBOUND)
    assert parse_prefix(deny_log_prefix(4242).encode()) == ("inbound", 4242)
    assert parse_prefix(deny_log_prefix(4242, outbound=True).encode()) == ("outbound", 4242)
    assert parse_prefix(blocked_log_prefix(outbound=True).encode()) == ("outbound", None)
    # The inbound terminal drop has no prefix at all; the old deny form is no longer a rule.
    assert parse_prefix(b"") == ("inbound", None)
    assert parse_prefix(b"palisade deny 7") == ("inbound", None)


def test_a_connection_the_workload_opened_is_never_ended_by_its_inbound_deny_rules():
    """A deny rule "any -> tcp/22" on this workload ends the inbound connections to its port 22, not the
    workload's own connections out to another host's port 22 (marked outbound: 0x80, by the output chain
    of any outbound mode, the observe-only one of visibility included)."""
    from agent.conntrack import Entry
    from agent.deny import DenyLine, denied

    line = DenyLine(rule=7, family=None, intervals=(), services=((6, 22, 22),))

    def entry(mark: int, source: str, destination: str) -> Entry:
        return Entry(False, 1, 6, source, destination, 22, 40000, mark, None, None, None)

    inbound = entry((1 << 24), "10.0.0.9", "10.0.0.5")  # observed, inbound
    outbound = entry(((0x80 | 1) << 24), "10.0.0.5", "10.0.0.9")  # observed, outbound
    enforced_out = entry(((0x80 | 2) << 24) | 3, "10.0.0.5", "10.0.0.9")  # allowed by rule 3, outbound
    unmarked = entry(0, "10.0.0.9", "10.0.0.5")
    assert denied([inbound, outbound, enforced_out, unmarked], [line]) == [inbound]
