"""Where outbound evidence meets outbound policy: the review of each direction reads that direction's
mode (`outbound_mode` for outbound), and the rules without hits are those of rulesets of the read's
direction (an inbound rule is no unused rule of an outbound read, nor the reverse)."""

from __future__ import annotations

import itertools
from datetime import timedelta

from controlplane import clock
from fleet.models import Workload
from flows.services import flow_report_ingest
from tests.support.flow_evidence import enrolled, flow_report, windows_between

_uptimes = itertools.count(100)


def _range():
    now = clock.now()
    text = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return {"from": text(now - timedelta(hours=1)), "to": text(now + timedelta(hours=1))}


def _ingest(workload, groups):
    windows = windows_between(clock.now() - timedelta(minutes=10), 1)
    windows[0]["groups"] = [{**windows[0]["groups"][0], **group} for group in groups]
    answer = flow_report_ingest(workload_id=str(workload.id), data=flow_report("p1", next(_uptimes), windows))
    assert all(r["result"] == "accepted" for r in answer["windows"]), answer


def _not_in_simulation(api, workload, direction):
    review = api.get(
        "/api/v1/flows/review", {**_range(), "workload": str(workload.id), "direction": direction}
    )
    assert review.status_code == 200, review.content
    return [w["workload_id"] for w in review.json()["not_in_simulation"]]


def test_the_review_of_each_direction_reads_that_directions_mode(api, db):
    web, _, _ = enrolled("web", "10.50.0.1")
    _ingest(web, [{"peer": "198.51.100.4", "port": 9090, "decision": "observed", "direction": "outbound"}])
    long_ago = clock.now() - timedelta(days=1)
    Workload.objects.filter(id=web.id).update(
        mode="simulation", mode_since=long_ago, outbound_mode="visibility", outbound_mode_since=None
    )
    assert _not_in_simulation(api, web, "inbound") == []
    assert _not_in_simulation(api, web, "outbound") == [str(web.id)]
    assert _not_in_simulation(api, web, "any") == [str(web.id)]
    shown = api.get("/api/v1/flows/review", {**_range(), "workload": str(web.id), "direction": "outbound"})
    assert shown.json()["not_in_simulation"][0]["outbound_mode"] == "visibility"
    Workload.objects.filter(id=web.id).update(
        mode="visibility", mode_since=long_ago, outbound_mode="simulation", outbound_mode_since=long_ago
    )
    assert _not_in_simulation(api, web, "inbound") == [str(web.id)]
    assert _not_in_simulation(api, web, "outbound") == []
    shown = api.get("/api/v1/flows/review", {**_range(), "workload": str(web.id)})
    assert "outbound_mode" not in shown.json()["not_in_simulation"][0]
    # Put in simulation during the range: not throughout.
    Workload.objects.filter(id=web.id).update(outbound_mode_since=clock.now() - timedelta(minutes=5))
    assert _not_in_simulation(api, web, "outbound") == [str(web.id)]


def test_unused_rules_are_those_of_the_reads_direction(api, db):
    web, _, _ = enrolled("web", "10.50.0.1")
    inbound = api.post(
        "/api/v1/rulesets",
        {"name": "in", "scope": "", "rules": [
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 443}]},
            {"sources": [{"any": True}], "services": [{"protocol": "tcp", "port": 8443}]},
        ]},
        format="json",
    )  # fmt: skip
    assert inbound.status_code == 201, inbound.content
    outbound = api.post(
        "/api/v1/rulesets",
        {"name": "out", "scope": "", "direction": "outbound", "rules": [
            {"destinations": [{"any": True}], "services": [{"protocol": "tcp", "port": 9090}]},
            {"destinations": [{"any": True}], "services": [{"protocol": "tcp", "port": 9191}]},
        ]},
        format="json",
    )  # fmt: skip
    assert outbound.status_code == 201, outbound.content
    in_used, in_unused = inbound.json()["rules"]
    out_used, out_unused = outbound.json()["rules"]
    _ingest(web, [
        {"port": 443, "decision": "allowed", "rule": in_used["number"], "connection_count": 4},
        {"peer": "198.51.100.4", "port": 9090, "decision": "allowed", "rule": out_used["number"],
         "connection_count": 2, "direction": "outbound"},
    ])  # fmt: skip

    def unused(direction):
        page = api.get(
            "/api/v1/flows/rollup",
            {**_range(), "group_by": "rule", "workload": str(web.id), "direction": direction},
        ).json()
        assert page["coverage"]["complete"] is True
        return [r["rule_id"] for r in page["unused_rules"]]

    assert unused("inbound") == [in_unused["id"]]
    assert unused("outbound") == [out_unused["id"]]
    assert sorted(unused("any")) == sorted([in_unused["id"], out_unused["id"]])
