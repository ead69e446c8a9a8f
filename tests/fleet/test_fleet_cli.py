"""The fleet commands call the same domain functions as the API and refuse the same things."""

import json

from fleet import sync
from tests.support.helpers import assert_problem
from tests.support.helpers import run_command as run
from tests.support.workloads import connect, make_workload


def test_list_show_counts_match_the_api(api, db):
    a = make_workload(hostname="a", labels={"env": "prod"})
    make_workload(hostname="b", labels={"env": "dev"})
    code, out, _ = run("workload", "list", "--label", "env=prod", "--json")
    assert code == 0
    assert json.loads(out) == api.get("/api/v1/workloads?label=env=prod").json()["items"]
    code, out, _ = run("workload", "show", str(a.id), "--json")
    assert json.loads(out) == api.get(f"/api/v1/workloads/{a.id}").json()
    code, out, _ = run("workload", "counts", "--json")
    assert json.loads(out) == api.get("/api/v1/workloads/counts").json()
    code, out, _ = run("workload", "rendered-policy", str(a.id))
    assert out.startswith("table inet palisade {")


def test_set_labels_and_mode_change_parity(api, db, monkeypatch):
    a = make_workload(hostname="a", labels={"env": "prod"})
    bad = {"labels": {"env": "not ok!"}}
    api_problem = assert_problem(
        api.put(f"/api/v1/workloads/{a.id}/labels", bad, format="json", HTTP_IF_MATCH='"1"'),
        422,
        "validation",
    )
    code, out, _ = run(
        "workload",
        "set-labels",
        str(a.id),
        "-",
        "--if-match",
        "1",
        "--json",
        stdin_text=json.dumps(bad),
        monkeypatch=monkeypatch,
    )
    assert code == 2 and json.loads(out)["errors"] == api_problem["errors"]
    code, out, _ = run(
        "workload",
        "set-labels",
        str(a.id),
        "-",
        "--if-match",
        "1",
        "--json",
        stdin_text='{"labels": {"env": "dev"}}',
        monkeypatch=monkeypatch,
    )
    assert code == 0 and json.loads(out) == {"labels": {"env": "dev"}, "version": "2"}
    code, out, _ = run("mode-change", "enforced", "--label", "env=dev", "--json")
    assert code == 0 and json.loads(out)["changed_count"] == 1
    code, _, err = run("mode-change", "enforced", "--label", "env=nope")
    assert code == 2 and "selects-nothing" in err


def test_resend_refusal_is_one_line(db):
    workload = make_workload()
    code, _, err = run("workload", "resend-snapshot", str(workload.id))
    assert code == 1 and err.count("\n") == 1 and "never connected" in err
    connect(workload)
    code, out, _ = run("workload", "resend-snapshot", str(workload.id))
    assert code == 0
    sync.workload_stream_ended(workload_id=workload.id, stream_id="stream-1")
    code, _, err = run("workload", "resend-snapshot", str(workload.id))
    assert "last heard from" in err


def test_selector_preview_and_dryrun_commands(db, monkeypatch):
    make_workload(labels={"app": "web"})
    code, out, _ = run("selector-preview", "app=web", "--json")
    assert code == 0 and json.loads(out)["count"] == 1
    body = {
        "rulesets": [
            {
                "name": "r",
                "scope": "app=web",
                "rules": [{"sources": [{"any": True}], "services": [{"protocol": "icmp"}]}],
            }
        ]
    }
    code, out, _ = run("render-dryrun", "-", "--json", stdin_text=json.dumps(body), monkeypatch=monkeypatch)
    assert code == 0 and json.loads(out)["changed_count"] == 0  # visibility documents ignore rules
