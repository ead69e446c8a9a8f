"""Properties of suggested rules over randomized fleets and evidence: every draft is accepted by the
ruleset validation and saves as it is, all or nothing; saved, it admits every key it learnt from (the
impact of enforcing it over the same range refuses nothing newly); and no scope reaches outside the
selection. Both ways: inbound rulesets from received connections, outbound ones (`direction:
outbound`) from opened connections, judged with the destinations' inbound policy (both ends)."""

from __future__ import annotations

import itertools
import random
from datetime import timedelta

import pytest
from django.db import transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane import clock
from controlplane.auth.actor import CLI_ACTOR
from fleet.services import workload_labels_replace
from flows.policy_drafts.draft import in_force_load
from flows.policy_drafts.draft_save import policy_draft_save
from flows.policy_drafts.impact import policy_impact
from flows.policy_drafts.suggestions import policy_suggest
from flows.selectors import workloads_selected
from flows.services import flow_report_ingest
from policy import services
from policy.grammar import parse_selector
from policy.models import AddressGroup, Ruleset
from policy.validation import address_group_input, ruleset_input
from tests.support.flow_evidence import enrolled, flow_report, windows_between

_uptimes = itertools.count(10_000)
APPS = ("web", "api", "db", "Web", "cache")
ENVS = ("prod", "stage", None)
OUTSIDE = [f"198.51.100.{i}" for i in range(1, 12)] + ["2001:db8::7", "2001:db8::8", "203.0.113.5"]


class _Rollback(Exception):
    pass


def _fleet(rng: random.Random, size: int) -> list:
    workloads = []
    for i in range(size):
        workload, _, _ = enrolled(f"h{i}", f"10.60.0.{10 + i}")
        labels = {"app": rng.choice(APPS)}
        env = rng.choice(ENVS)
        if env:
            labels["env"] = env
        if rng.random() < 0.1:
            labels.pop("app")
        workloads.append(
            workload_labels_replace(
                actor=CLI_ACTOR, workload_id=str(workload.id), expected_version=str(workload.labels_version),
                data={"labels": labels},
            )
        )  # fmt: skip
    return workloads


def _ports(rng: random.Random) -> list[int]:
    shapes = [
        lambda: [rng.choice([22, 80, 443, 5432, 6379, 9100])],
        lambda: list(range(7000, 7000 + rng.randint(2, 100))),  # a job's range
        lambda: rng.sample(range(1, 30000), rng.randint(1, 90)),  # scattered, past 64 services
        lambda: [rng.randint(32768, 60999)],  # a late reply
        lambda: list(range(8000, 8200, rng.choice([1, 2, 3]))),  # dense, with gaps
    ]
    return rng.choice(shapes)()


def _evidence(rng: random.Random, workloads: list, direction: str = "inbound") -> None:
    addresses = [w.addresses[0] for w in workloads]
    for workload in workloads:
        if rng.random() < 0.3:
            continue
        groups = []
        for _ in range(rng.randint(1, 4)):
            peer = rng.choice(addresses + OUTSIDE)
            protocol = rng.choice(["tcp", "tcp", "udp", "icmp"])
            ports = [0] if protocol == "icmp" else _ports(rng)
            decision = rng.choice(["observed", "would_block", "allowed", "blocked"])
            for port in ports:
                groups.append({
                    "peer": peer, "protocol": protocol, "port": port, "decision": decision,
                    "rule": rng.randint(1, 50) if decision == "allowed" else None,
                    "connection_count": rng.randint(1, 6),
                    **({"direction": direction} if direction != "inbound" else {}),
                })  # fmt: skip
        unique = {(g["peer"], g["protocol"], g["port"], g["decision"]): g for g in groups}
        [window] = windows_between(clock.now() - timedelta(minutes=20), 1)
        template = window["groups"][0]
        window["groups"] = [{**template, **g} for g in unique.values()][:4000]
        window["groups"] = [
            {**g, "first_seen": template["first_seen"], "last_seen": template["last_seen"]}
            for g in window["groups"]
        ]
        report = flow_report("p", next(_uptimes), [window])
        answer = flow_report_ingest(workload_id=str(workload.id), data=report)
        assert all(r["result"] == "accepted" for r in answer["windows"]), answer


def _policy_in_force(rng: random.Random) -> None:
    if rng.random() < 0.5:
        services.ruleset_create(
            actor=CLI_ACTOR,
            data={"name": "in force", "scope": "app=db", "rules": [
                {"sources": [{"selector": "app=web"}], "services": [{"protocol": "tcp", "port": 1, "port_to": 9000}]}
            ]},
        )  # fmt: skip


def _rows_unadmitted_after(first: dict) -> int:
    return first["set_apart_count"] + first["not_generalised_count"]


@pytest.mark.django_db
@settings(
    max_examples=25, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(2, 8), by_label=st.booleans())
def test_every_draft_saves_as_it_is_and_then_admits_every_key_it_learnt_from(seed, size, by_label):
    rng = random.Random(seed)
    with pytest.raises(_Rollback), transaction.atomic():
        workloads = _fleet(rng, size)
        _evidence(rng, workloads)
        _policy_in_force(rng)
        start, end = clock.now() - timedelta(hours=1), clock.now() + timedelta(minutes=1)
        labels = [parse_selector("app=db,env=prod")] if by_label else []
        selected = workloads_selected(workload_ids=[], labels=labels)
        first = policy_suggest(selected=selected, start=start, end=end, selection_labels=labels)

        # Every object of the draft is a body the writes' own validation accepts.
        for ruleset in first["rulesets"]:
            ruleset_input(ruleset)
        for group in first["address_groups"]:
            address_group_input(group)
        # Scopes stay inside the selection.
        if selected is not None:
            chosen = {str(i) for i in selected.values_list("id", flat=True)}
            fleet = in_force_load().fleet
            for ruleset in first["rulesets"]:
                matched = {
                    fleet.workload_ids[p] for p in fleet.positions_matching(parse_selector(ruleset["scope"]))
                }
                assert matched <= chosen, (ruleset["scope"], first["scope_notes"])
        groups_before, rulesets_before = AddressGroup.objects.count(), Ruleset.objects.count()
        saved = policy_draft_save(
            actor=CLI_ACTOR, data={"address_groups": first["address_groups"], "rulesets": first["rulesets"]}
        )
        assert Ruleset.objects.count() == rulesets_before + len(first["rulesets"])
        assert AddressGroup.objects.count() == groups_before + len(saved["address_groups"])

        # Saved, the policy in force admits every key learnt from: nothing is proposed again, and what
        # is left unadmitted is exactly what was set apart or could not be generalised.
        again = policy_suggest(selected=selected, start=start, end=end, selection_labels=labels)
        assert again["rulesets"] == [], (again["rulesets"], again["evidence"])
        # (a range of ports admits some keys set apart too: never more are left)
        assert _rows_unadmitted_after(again) <= _rows_unadmitted_after(first)
        raise _Rollback


def _outbound_policy_in_force(rng: random.Random) -> list[dict]:
    """Rulesets in force, as bodies: an inbound one that admits some of the outgoing keys at their
    destination's end, an outbound one that admits some at their source's."""
    bodies = []
    if rng.random() < 0.5:
        bodies.append(
            {
                "name": "in force",
                "scope": "app=db",
                "rules": [
                    {
                        "sources": [{"selector": "app=web"}],
                        "services": [{"protocol": "tcp", "port": 1, "port_to": 9000}],
                    }
                ],
            }
        )
    if rng.random() < 0.5:
        bodies.append(
            {
                "name": "out in force",
                "direction": "outbound",
                "scope": "app=api",
                "rules": [
                    {
                        "destinations": [{"any": True}],
                        "services": [{"protocol": "tcp", "port": 7000, "port_to": 7050}],
                    }
                ],
            }
        )
    for body in bodies:
        services.ruleset_create(actor=CLI_ACTOR, data=body)
    return bodies  # fmt: skip


@pytest.mark.django_db
@settings(
    max_examples=20, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
@given(seed=st.integers(0, 2**32 - 1), size=st.integers(2, 8), by_label=st.booleans())
def test_every_outbound_draft_saves_as_it_is_and_its_impact_refuses_nothing_newly(seed, size, by_label):
    rng = random.Random(seed)
    with pytest.raises(_Rollback), transaction.atomic():
        workloads = _fleet(rng, size)
        _evidence(rng, workloads, direction="outbound")
        in_force = _outbound_policy_in_force(rng)
        start, end = clock.now() - timedelta(hours=1), clock.now() + timedelta(minutes=1)
        labels = [parse_selector("app=web,env=prod")] if by_label else []
        selected = workloads_selected(workload_ids=[], labels=labels)
        first = policy_suggest(
            selected=selected, start=start, end=end, selection_labels=labels, direction="outbound"
        )

        for ruleset in first["rulesets"]:
            assert ruleset["direction"] == "outbound" and ruleset_input(ruleset).direction == "outbound"
            assert all("destinations" in rule and "sources" not in rule for rule in ruleset["rules"])
        for group in first["address_groups"]:
            address_group_input(group)
        if selected is not None:
            chosen = {str(i) for i in selected.values_list("id", flat=True)}
            fleet = in_force_load().fleet
            for ruleset in first["rulesets"]:
                matched = {
                    fleet.workload_ids[p] for p in fleet.positions_matching(parse_selector(ruleset["scope"]))
                }
                assert matched <= chosen, (ruleset["scope"], first["scope_notes"])

        # The impact of the policy in force with the draft beside it, judged on the outbound evidence:
        # nothing admitted now is refused, and every key learnt from is admitted.
        body = {
            "rulesets": [*in_force, *first["rulesets"]], "address_groups": first["address_groups"],
            "from": clock.rfc3339(start), "to": clock.rfc3339(end), "direction": "outbound",
            "label": [str(s) for s in labels],
        }  # fmt: skip
        impact = policy_impact(data=body)
        assert impact["newly_refused"] == [], impact["newly_refused"][:5]
        learnt = first["keys_total"] - first["admitted_now_count"] - _rows_unadmitted_after(first)
        # (a range of ports admits some keys set apart too: never fewer are admitted)
        assert impact["newly_admitted_summary"]["count"] >= learnt
        assert impact["keys_total"] == first["keys_total"]

        groups_before, rulesets_before = AddressGroup.objects.count(), Ruleset.objects.count()
        saved = policy_draft_save(
            actor=CLI_ACTOR, data={"address_groups": first["address_groups"], "rulesets": first["rulesets"]}
        )
        assert Ruleset.objects.count() == rulesets_before + len(first["rulesets"])
        assert AddressGroup.objects.count() == groups_before + len(saved["address_groups"])
        assert set(Ruleset.objects.filter(name__in=[r["name"] for r in first["rulesets"]]).values_list(
            "direction", flat=True)) <= {"outbound"}  # fmt: skip

        again = policy_suggest(
            selected=selected, start=start, end=end, selection_labels=labels, direction="outbound"
        )
        assert again["rulesets"] == [], (again["rulesets"], again["evidence"])
        assert _rows_unadmitted_after(again) <= _rows_unadmitted_after(first)
        raise _Rollback
