"""Outbound rulesets and the outbound mode through the API and the renderer: direction and destinations,
findings with their paths, the rule index, mode changes by direction (confirm and revert each on its
own), the fleet filter, and a fleet that never uses outbound rendering what it always did."""

from datetime import timedelta

import pytest

from fleet.mode_confirmations import mode_changes_revert_due
from fleet.models import RenderedPolicy, Workload
from tests.support.helpers import assert_problem
from tests.support.workloads import make_workload

pytestmark = pytest.mark.django_db

TCP_9090 = {"protocol": "tcp", "port": 9090}


def post(api, path, body):
    return api.post(path, body, format="json")


def findings(response):
    assert_problem(response, 422, "validation")
    return {(f["path"], f["rule"]) for f in response.json()["errors"]}


def outbound_ruleset(api, **extra):
    answer = post(api, "/api/v1/rulesets", {
        "name": "egress", "scope": "role=server", "direction": "outbound",
        "rules": [{"destinations": [{"any": True}], "services": [TCP_9090]}], **extra})  # fmt: skip
    assert answer.status_code == 201, answer.content
    return answer.json()


def document(workload) -> str:
    return RenderedPolicy.objects.get(version=Workload.objects.get(id=workload.id).latest_policy_id).document


def test_an_outbound_ruleset_has_destinations_and_says_its_direction(api):
    created = outbound_ruleset(api)
    assert created["direction"] == "outbound"
    (rule,) = created["rules"]
    assert rule["destinations"] == [{"any": True}] and "sources" not in rule
    again = api.get(f"/api/v1/rulesets/{created['id']}").json()
    assert again["direction"] == "outbound" and again["rules"][0]["destinations"] == [{"any": True}]
    one = api.get(f"/api/v1/rulesets/{created['id']}/rules/{rule['id']}").json()
    assert one["destinations"] == [{"any": True}]
    # An inbound ruleset (the default) reads as it always did.
    inbound = post(api, "/api/v1/rulesets", {"name": "web", "scope": "", "rules": [
        {"sources": [{"any": True}], "services": [TCP_9090]}]})  # fmt: skip
    assert inbound.json()["direction"] == "inbound" and "destinations" not in inbound.json()["rules"][0]


def test_peers_of_the_wrong_direction_and_unknown_directions_are_findings_with_their_paths(api):
    wrong = post(api, "/api/v1/rulesets", {"name": "egress", "scope": "", "direction": "outbound",
                 "rules": [{"sources": [{"any": True}], "services": [TCP_9090]}]})  # fmt: skip
    assert findings(wrong) == {("/rules/0/sources", "direction"), ("/rules/0/destinations", "required")}
    inbound = post(api, "/api/v1/rulesets", {"name": "web", "scope": "",
                   "rules": [{"destinations": [{"any": True}], "sources": [{"any": True}], "services": [TCP_9090]}]})  # fmt: skip
    assert findings(inbound) == {("/rules/0/destinations", "direction")}
    unknown = post(api, "/api/v1/rulesets", {"name": "web", "scope": "", "direction": "sideways"})
    assert findings(unknown) == {("/direction", "direction")}
    created = outbound_ruleset(api)
    added = post(
        api, f"/api/v1/rulesets/{created['id']}/rules", {"sources": [{"any": True}], "services": [TCP_9090]}
    )
    assert findings(added) == {("/sources", "direction"), ("/destinations", "required")}
    added = post(api, f"/api/v1/rulesets/{created['id']}/rules",
                 {"destinations": [{"selector": "app=db"}], "services": [TCP_9090]})  # fmt: skip
    assert added.status_code == 201 and added.json()["destinations"] == [{"selector": "app=db"}]


def test_a_fleet_in_outbound_visibility_renders_no_output_chain_and_outbound_rules_only_on_the_way_out(api):
    server = make_workload(
        hostname="server", labels={"role": "server"}, addresses=["10.0.0.1"], mode="enforced"
    )
    before = document(server)
    created = outbound_ruleset(api)
    assert document(server) == before  # visibility outbound: the outbound ruleset changes nothing
    assert "chain output" not in before and "daddr" not in before
    answer = post(api, "/api/v1/mode-changes", {"selection": {"workload_ids": [str(server.id)]},
                  "mode": "enforced", "direction": "outbound"})  # fmt: skip
    assert answer.status_code == 202 and answer.json()["direction"] == "outbound"
    stored = Workload.objects.get(id=server.id)
    assert (stored.mode, stored.outbound_mode) == ("enforced", "enforced")
    text = document(server)
    assert "chain output" in text and "set agent_gateways_v4" in text
    assert "ct mark set 0xc2000000 accept" in text  # the fail-safe list, flagged
    number = created["rules"][0]["number"]
    assert "meta l4proto . th dport @svc_" in text and f"0x{0x82000000 | number:08x} accept" in text
    policy = api.get(f"/api/v1/workloads/{server.id}/rendered-policy").json()
    assert policy["outbound_mode"] == "enforced"
    assert policy["rule_index"][str(number)]["direction"] == "outbound"
    listed = api.get("/api/v1/workloads", {"outbound_mode": "enforced"}).json()["items"]
    assert [w["id"] for w in listed] == [str(server.id)] and listed[0]["outbound_mode"] == "enforced"
    assert api.get("/api/v1/workloads", {"outbound_mode": "simulation"}).json()["items"] == []
    assert findings(api.get("/api/v1/workloads", {"outbound_mode": "loud"})) == {
        ("?outbound_mode", "outbound-mode")
    }


def test_an_unconfirmed_outbound_change_puts_back_the_outbound_mode_only(api, clock_at):
    web = make_workload(hostname="web", labels={"app": "web"}, mode="simulation")
    original = document(web)
    answer = post(api, "/api/v1/mode-changes", {"selection": {"labels": ["app=web"]}, "mode": "enforced",
                  "direction": "outbound", "confirm_within_seconds": 10})  # fmt: skip
    assert answer.status_code == 202, answer.content
    stored = Workload.objects.get(id=web.id)
    assert (stored.mode, stored.outbound_mode) == ("simulation", "enforced")
    # An inbound change meanwhile takes over the inbound mode only: the outbound deadline still holds.
    inbound = post(api, "/api/v1/mode-changes", {"selection": {"labels": ["app=web"]}, "mode": "enforced"})
    assert inbound.status_code == 202
    clock_at(timedelta(seconds=11))
    assert mode_changes_revert_due() == 1
    stored = Workload.objects.get(id=web.id)
    assert (stored.mode, stored.outbound_mode) == ("enforced", "visibility")
    reverted_by = api.get(f"/api/v1/mode-changes/{answer.json()['id']}").json()["reverted_by"]
    revert = api.get(f"/api/v1/mode-changes/{reverted_by}").json()
    assert revert["direction"] == "outbound" and revert["mode"] == "visibility"
    assert document(web) != original and "chain output" not in document(web)


def test_the_host_commands_take_the_direction_and_the_outbound_mode(tmp_path):
    import json

    from tests.support.helpers import run_command as run

    web = make_workload(hostname="web", labels={"app": "web"})
    make_workload(hostname="db", labels={"app": "db"})
    code, out, _ = run("mode-change", "simulation", "--label", "app=web", "--direction", "outbound")
    assert code == 0 and out.startswith("outbound simulation: 1 selected, 1 changed"), out
    assert Workload.objects.get(id=web.id).outbound_mode == "simulation"
    code, out, _ = run("workload", "list", "--outbound-mode", "simulation", "--json")
    assert code == 0 and [w["hostname"] for w in json.loads(out)] == ["web"]
    body = tmp_path / "egress.json"
    body.write_text(json.dumps({"name": "egress", "scope": "app=web", "direction": "outbound",
                                "rules": [{"destinations": [{"any": True}], "services": [TCP_9090]}]}))  # fmt: skip
    code, out, err = run("ruleset", "create", str(body), "--json")
    assert code == 0, err
    assert json.loads(out)["direction"] == "outbound"
    body.write_text(json.dumps({"name": "bad", "scope": "", "direction": "outbound",
                                "rules": [{"sources": [{"any": True}], "services": [TCP_9090]}]}))  # fmt: skip
    code, _, err = run("ruleset", "create", str(body))
    assert code != 0 and "/rules/0/sources" in err
