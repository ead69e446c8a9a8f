"""A name of a ruleset, service or address group must read as what it is (policy/validation.py
`lookalike_problem`): its NFKC form, visible characters only, the letters of one script, and not
written wholly in Cyrillic or Greek letters that look like Latin ones. A look-alike is refused with
the same finding (`name-lookalike` at the name) by the API, the commands and a policy file's plan."""

from __future__ import annotations

import json

import pytest

from tests.support.helpers import run_command as run

LOOKALIKES = {
    "zero-width space": "pay\u200bments",
    "zero-width joiner": "web\u200dtier",
    "Cyrillic a among Latin letters": "p\u0430yments",
    "Greek omicron among Latin letters": "r\u03bfuter",
    "wholly Cyrillic letters that look Latin": "\u0440\u0430\u0443",  # "pay"
    "full-width letters": "\uff57\uff45\uff42",  # "web"
    "a ligature": "\ufb01les",  # "files"
    "a no-break space": "web\u00a0tier",
    "a decomposed accent": "cafe\u0301",
    "a private-use character": "web\ue000",
    "a soft hyphen": "web\u00adtier",
    "an ideographic space": "web\u3000tier",
}
ADMITTED = {
    "ASCII with spaces": "suggested app=web 2",
    "Cyrillic": "\u043f\u043b\u0430\u0442\u0435\u0436\u0438",  # "платежи"
    "Greek": "\u03a9\u03bc\u03ad\u03b3\u03b1",
    "Chinese": "\u51b3\u7b56\u7cfb\u7edf",
    "Japanese, kanji and kana": "\u30b5\u30fc\u30d3\u30b9\u540d",
    "Latin with a composed accent": "caf\u00e9",
}
BODIES = {
    "service": ("services", lambda name: {"name": name, "entries": [{"protocol": "tcp", "port": 22}]}),
    "address-group": ("address-groups", lambda name: {"name": name, "members": ["192.0.2.1"]}),
    "ruleset": ("rulesets", lambda name: {"name": name, "scope": "", "rules": []}),
}


def _api(api, kind: str, name: str):
    path, body = BODIES[kind]
    return api.post(f"/api/v1/{path}", body(name), format="json")


@pytest.mark.parametrize("kind", BODIES)
@pytest.mark.parametrize("name", LOOKALIKES.values(), ids=LOOKALIKES.keys())
def test_a_lookalike_name_is_refused_alike_by_the_api_and_the_command(api, db, tmp_path, kind, name):
    response = _api(api, kind, name)
    assert response.status_code == 422
    assert [(e["path"], e["rule"]) for e in response.json()["errors"]] == [("/name", "name-lookalike")]
    path = tmp_path / "body.json"
    path.write_text(json.dumps(BODIES[kind][1](name)))
    code, out, _ = run(kind, "create", str(path), "--json")
    assert code == 2
    assert [(e["path"], e["rule"]) for e in json.loads(out)["errors"]] == [("/name", "name-lookalike")]


@pytest.mark.parametrize("name", LOOKALIKES.values(), ids=LOOKALIKES.keys())
def test_a_lookalike_name_in_a_policy_file_is_a_finding_at_its_place(db, tmp_path, name):
    data = {
        "version": 1,
        "services": [{"name": name, "entries": [{"protocol": "tcp", "port": 22}]}],
        "address_groups": [],
        "rulesets": [],
    }
    path = tmp_path / "policy.yaml"
    path.write_text(json.dumps(data))
    code, _, err = run("policy", "plan", str(path))
    assert (
        code == 2
        and err.startswith("error: services[0].name: name ")
        and err.strip().endswith("[name-lookalike]")
    )


@pytest.mark.parametrize("kind", BODIES)
@pytest.mark.parametrize("name", ADMITTED.values(), ids=ADMITTED.keys())
def test_a_name_in_one_script_is_admitted(api, db, kind, name):
    response = _api(api, kind, name)
    assert response.status_code == 201, response.content
    assert response.json()["name"] == name
