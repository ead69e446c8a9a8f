"""The draft a suggestion proposes (suggestions.py), built scope by scope from the evidence sorted
out: rules of the sources seen on the same services, cut at every limit of a write
(suggest_shape.py), each with its own address group named for it and its evidence and breadth. An
outbound proposal's rules name their peers `destinations` and its rulesets say `direction: outbound`;
an inbound one's bodies are as they always were."""

from __future__ import annotations

import functools
import ipaddress
from collections import defaultdict
from dataclasses import dataclass

from controlplane.clock import rfc3339
from flows.policy_drafts.suggest_shape import (
    PortRun,
    addresses_admitted,
    breadth,
    member_chunks,
    port_runs,
    service_chunks,
    source_chunks,
)
from policy.grammar import parse_selector
from policy.models import AddressGroup, Ruleset, Service
from policy.render_inputs import FleetIndex
from policy.validation import MAX_DESCRIPTION, MAX_NAME, MAX_RULES_PER_RULESET, peers_key

DESCRIPTION = "Suggested from observed traffic."


class _Names:
    """Names for the draft's objects that no stored object (nor an earlier one of the draft) has."""

    def __init__(self, model) -> None:
        self.taken = set(model.objects.values_list("name", flat=True))

    def take(self, wanted: str) -> str:
        base, n = wanted[: MAX_NAME - 4], 1
        name = base
        while name in self.taken:
            n += 1
            name = f"{base} {n}"
        self.taken.add(name)
        return name


def _aggregated(addresses: list[str], prefix: int | None, prefix_v6: int | None) -> dict[str, int]:
    """The members for `addresses`, each with how many of them it holds: the addresses themselves, or
    the networks of the prefix lengths asked for that hold them; in address order."""
    members: dict[str, int] = defaultdict(int)
    if prefix is None and prefix_v6 is None:
        # The addresses themselves, in the order they came (address order): nothing to parse again.
        for text in addresses:
            members[text] += 1
        return dict(members)
    for text in addresses:
        address = parsed_address(text)
        length = prefix if address.version == 4 else prefix_v6
        if length is None or length >= address.max_prefixlen:
            members[str(address)] += 1
        else:
            members[str(ipaddress.ip_network(f"{address}/{length}", strict=False))] += 1
    networks = {m: ipaddress.ip_network(m) for m in members}
    order = sorted(members, key=lambda m: (networks[m].version, networks[m]))
    return {m: members[m] for m in order}


def _spans(rows: list[dict]) -> tuple[dict, dict, dict]:
    """The rows' connections and first and last instants in all, per (peer, peer workload) and per
    (protocol, port) (in the order first seen): in one pass (a fleet's rule may hold thousands of
    peers), each instant's text made once."""
    whole: list | None = None  # the rows in all
    by_peer: dict = {}
    by_service: dict = {}
    for row in rows:
        count, first, last = row["connection_count"], row["first_seen"], row["last_seen"]
        if whole is None:
            whole = [count, first, last]
        else:
            _span_add(whole, count, first, last)
        k = (row["peer"], row["peer_workload_id"])
        found = by_peer.get(k)
        if found is None:
            by_peer[k] = [count, first, last]
        else:
            _span_add(found, count, first, last)
        k = (row["protocol"], row["port"])
        found = by_service.get(k)
        if found is None:
            by_service[k] = [count, first, last]
        else:
            _span_add(found, count, first, last)
    texts: dict = {}

    def text(instant):
        found = texts.get(instant)
        if found is None:
            found = texts[instant] = rfc3339(instant)
        return found

    def made(count, first, last) -> dict:
        return {"connection_count": count, "first_seen": text(first), "last_seen": text(last)}

    return (
        made(*whole) if whole is not None else {},
        {k: made(*v) for k, v in by_peer.items()},
        {k: made(*v) for k, v in by_service.items()},
    )


def _span_add(span: list, count: int, first, last) -> None:
    span[0] += count
    if first < span[1]:
        span[1] = first
    if last > span[2]:
        span[2] = last


@dataclass
class _Rule:
    """A rule of the proposal before its ruleset and groups are named."""

    selectors: list[str]
    addresses: list[str]  # outside peers seen, for the rule's own address group
    runs: list[PortRun]
    rows: list[dict]
    held_sources: list[tuple]


class Proposal:
    """The draft's rulesets (one per scope, more past 500 rules), the address groups to create, and
    the evidence of each rule, built scope by scope."""

    def __init__(
        self, fleet: FleetIndex, prefix: int | None, prefix_v6: int | None, *, direction: str = "inbound"
    ) -> None:
        self.fleet, self.prefix, self.prefix_v6 = fleet, prefix, prefix_v6
        self.direction, self.peers_key = direction, peers_key(direction)
        self.outbound = self.peers_key == "destinations"
        self.rulesets: list[dict] = []
        self.groups: list[dict] = []
        self.group_evidence: dict[str, dict] = {}
        self.evidence: list[dict] = []
        self.warnings: list[str] = []
        self.ruleset_names, self.group_names = _Names(Ruleset), _Names(AddressGroup)
        self.stored_groups = {tuple(g.members): g.name for g in AddressGroup.objects.all()}
        self.named_services = _stored_services()

    def add_scope(self, scope: str, seen: dict, workload_ids: list[str]) -> None:
        # Sources by the exact set of services they were seen on: a rule admits every source on every
        # service, so one rule per set is as small as the evidence allows.
        by_services: dict[tuple, list] = defaultdict(list)
        for source, services in seen.items():
            by_services[tuple(sorted(services))].append(source)
        drafts: list[_Rule] = []
        for services_key, sources in sorted(by_services.items(), key=lambda i: (i[0], sorted(i[1]))):
            selectors = sorted(value for kind, value in sources if kind == "selector")
            addresses = sorted((value for kind, value in sources if kind == "address"), key=_address_order)
            runs = port_runs(services_key)
            # A rule holds at most 64 sources (an address group is one) and 64 services: past either,
            # more rules of the same sources or services.
            parts: list[tuple[list[str], list[str]]] = [(c, []) for c in source_chunks(selectors)]
            if addresses:
                if parts and len(parts[-1][0]) < 64:
                    parts[-1] = (parts[-1][0], addresses)
                else:
                    parts.append(([], addresses))
            for part_selectors, part_addresses in parts:
                held = [("selector", s) for s in part_selectors] + [("address", a) for a in part_addresses]
                for chunk in service_chunks(runs):
                    # The services of the key that the chunk's runs hold, found once for every source.
                    chunk_services = [k for k in services_key if any(r.holds(*k) for r in chunk)]
                    rows = [row for s in held for k in chunk_services for row in seen[s].get(k, ())]
                    drafts.append(_Rule(list(part_selectors), list(part_addresses), chunk, rows, held))
        for first in range(0, len(drafts), MAX_RULES_PER_RULESET):
            self._ruleset(scope, drafts[first : first + MAX_RULES_PER_RULESET], workload_ids)

    def _ruleset(self, scope: str, drafts: list[_Rule], workload_ids: list[str]) -> None:
        name = self.ruleset_names.take(f"suggested {scope}")
        scope_workloads = len(self.fleet.positions_matching(parse_selector(scope)))
        rules, rules_evidence = [], []
        for position, draft in enumerate(drafts, start=1):
            sources: list[dict] = [{"selector": s} for s in draft.selectors]
            groups = self._groups(f"{name[:70]} rule {position}", draft.addresses, scope)
            sources += [{"address_group": g["name"]} for g in groups]
            services = [self.named_services.get(_run_key(r)) or r.entry() for r in draft.runs]
            rules.append({"description": DESCRIPTION, self.peers_key: sources, "services": services})
            peers = sum(len(self.fleet.positions_matching(parse_selector(s))) for s in draft.selectors)
            peers += sum(g["admitted"] for g in groups)
            wide = breadth(
                workloads=scope_workloads,
                peers=peers,
                services=sum(r.width for r in draft.runs),
                seen=_combinations_seen(draft.rows),
            )
            if wide["wider_than_seen"]:
                self.warnings.append(
                    f"{name}, rule {position}: admits {wide['admitted']} (workload, peer, service) "
                    f"combinations against {wide['seen']} seen ({wide['ratio']}x)"
                )
            rules_evidence.append(
                {
                    **_rule_evidence(draft.rows, draft.runs),
                    "breadth": wide,
                    "address_groups": [
                        {k: g[k] for k in ("name", "addresses_seen", "unseen_addresses_admitted")}
                        for g in groups
                    ],
                }
            )
        ruleset = {"name": name, "description": DESCRIPTION, "enabled": True, "scope": scope, "rules": rules}
        if self.outbound:
            ruleset = {**ruleset, "direction": self.direction}
        self.rulesets.append(ruleset)
        self.evidence.append({"ruleset": name, "workloads": workload_ids, "rules": rules_evidence})

    def _groups(self, rule_name: str, addresses: list[str], scope: str) -> list[dict]:
        """The address groups of the rule's outside peers, each named for the rule (a stored group of
        exactly the members is reused), with the addresses they admit beyond the ones seen."""
        if not addresses:
            return []
        held = _aggregated(addresses, self.prefix, self.prefix_v6)
        chunks = member_chunks(list(held))
        out = []
        for index, part in enumerate(chunks, start=1):
            seen = sum(held[m] for m in part)
            admitted = addresses_admitted(part)
            name = self.stored_groups.get(tuple(part))
            if name is None:
                kind = " destinations" if self.outbound else " peers"
                suffix = f"{kind} {index}" if len(chunks) > 1 else kind
                name = self.group_names.take(rule_name + suffix)
                self.groups.append(
                    {
                        "name": name,
                        # A narrowed scope can be long: the description stays within a write's limit.
                        "description": (
                            f"Destinations {scope} reached in the suggested range ({rule_name})."
                            if self.outbound
                            else f"Peers seen by {scope} in the suggested range ({rule_name})."
                        )[:MAX_DESCRIPTION],
                        "members": part,
                    }
                )
            entry = {"name": name, "addresses_seen": seen, "unseen_addresses_admitted": admitted - seen}
            self.group_evidence[name] = entry
            out.append({**entry, "admitted": admitted})
        return out


def _combinations_seen(rows: list[dict]) -> int:
    """The distinct (workload, peer, service) of the rows, a peer workload counted once whatever
    address it came from."""
    return len(
        {
            (row["workload_id"], row["peer_workload_id"] or row["peer"], row["protocol"], row["port"])
            for row in rows
        }
    )


@functools.lru_cache(maxsize=65536)
def parsed_address(text: str):
    return ipaddress.ip_address(text)


def _address_order(text: str) -> tuple:
    """Addresses by family, then in address order (as integers: comparing the address objects was a
    tenth of a fleet's proposal)."""
    address = parsed_address(text)
    return (address.version, int(address))


def _run_key(run: PortRun) -> tuple:
    high = None if run.high == run.low else run.high
    return (run.protocol, run.low or 0, high)


def _stored_services() -> dict[tuple, dict]:
    """Stored services of exactly one entry, by (protocol, port, port_to): what a suggested service
    reuses by name (the first by name when several match)."""
    found: dict[tuple, dict] = {}
    for service in Service.objects.prefetch_related("entries").order_by("name"):
        entries = list(service.entries.all())
        if len(entries) == 1:
            key = (entries[0].protocol, entries[0].port or 0, entries[0].port_to)
            found.setdefault(key, {"service": service.name})
    return found


def _rule_evidence(rows: list[dict], runs: list[PortRun]) -> dict:
    whole, by_peer, by_service = _spans(rows)
    return {
        **whole,
        "peers": [
            {"peer": peer, "peer_workload_id": str(pw) if pw else None, **span}
            for (peer, pw), span in sorted(by_peer.items(), key=lambda item: item[0][0])
        ],
        "services": [{"protocol": p, "port": n, **by_service[(p, n)]} for p, n in sorted(by_service)],
        # Runs of ports proposed as one range: the ports of the range the evidence does not hold are
        # admitted too, and said here.
        "port_ranges": [
            {
                "protocol": r.protocol,
                "port": r.low,
                "port_to": r.high,
                "ports_seen": r.seen,
                "ports_unseen": r.width - r.seen,
            }
            for r in runs
            if r.width > 1
        ],  # fmt: skip
        "workload_ids": sorted(str(w) for w in {r["workload_id"] for r in rows}),
    }
