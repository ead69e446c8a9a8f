"""Tests for policy.grammar: labels, selectors, canonical printing and matching.

Pure Python: nothing here touches the database or Django.
"""

import ast
import pickle
import string
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policy.grammar import (
    MAX_REQUIREMENTS,
    MAX_SELECTOR_LENGTH,
    GrammarError,
    Requirement,
    Selector,
    parse_selector,
    validate_label_key,
    validate_label_value,
    validate_labels,
)

RULES = {
    "label-key", "label-key-prefix", "label-key-too-long", "label-value", "label-value-too-long",
    "labels-type", "selector-type", "selector-syntax", "selector-empty-set", "selector-too-long",
    "selector-too-many",
}  # fmt: skip

PROPERTY = settings(max_examples=300, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


def error_of(call, *args) -> GrammarError:
    with pytest.raises(GrammarError) as info:
        call(*args)
    return info.value


# --------------------------------------------------------------------------- labels

VALID_KEYS = [
    "app", "a", "Z", "0", "a.b_c-D", "x" * 63, "example.com/app", "a/b", "1.2.3/x",
    "kubernetes.io/role", "my-org.example.com/Team_Name.v2", "a" * 253 + "/b",
]  # fmt: skip

INVALID_KEYS = [
    ("", "label-key"),
    ("a/", "label-key"),
    ("a/b/c", "label-key"),
    ("-a", "label-key"),
    ("a-", "label-key"),
    ("_a", "label-key"),
    ("a.", "label-key"),
    ("a b", "label-key"),
    ("a@b", "label-key"),
    ("é", "label-key"),
    ("a\n", "label-key"),
    ("x" * 64, "label-key-too-long"),
    ("ok.com/" + "x" * 64, "label-key-too-long"),
    ("a" * 254 + "/b", "label-key-too-long"),
    ("/", "label-key-prefix"),
    ("/a", "label-key-prefix"),
    ("Example.com/a", "label-key-prefix"),
    ("-a.com/x", "label-key-prefix"),
    ("a-.com/x", "label-key-prefix"),
    ("a..b/x", "label-key-prefix"),
    ("a_b.com/x", "label-key-prefix"),
    (".a/x", "label-key-prefix"),
    (123, "label-key"),
    (None, "label-key"),
    (b"app", "label-key"),
]

VALID_VALUES = ["", "a", "0", "web", "A-b_c.d", "x" * 63, "v1.2.3"]

INVALID_VALUES = [
    ("x" * 64, "label-value-too-long"),
    ("-a", "label-value"),
    ("a-", "label-value"),
    ("_a", "label-value"),
    ("a b", "label-value"),
    ("a/b", "label-value"),
    ("a=b", "label-value"),
    ("é", "label-value"),
    ("a\n", "label-value"),
    (" ", "label-value"),
    (5, "label-value"),
    (None, "label-value"),
    (b"a", "label-value"),
]


@pytest.mark.parametrize("key", VALID_KEYS)
def test_valid_label_keys(key):
    validate_label_key(key)


@pytest.mark.parametrize(("key", "rule"), INVALID_KEYS)
def test_invalid_label_keys(key, rule):
    error = error_of(validate_label_key, key)
    assert (error.rule, error.position) == (rule, None)
    assert error.message and str(error) == error.message


@pytest.mark.parametrize("value", VALID_VALUES)
def test_valid_label_values(value):
    validate_label_value(value)


@pytest.mark.parametrize(("value", "rule"), INVALID_VALUES)
def test_invalid_label_values(value, rule):
    error = error_of(validate_label_value, value)
    assert (error.rule, error.position) == (rule, None)


def test_validate_labels_reports_every_bad_key_and_value():
    labels = {"app": "web", "Bad Key": "x", "ok": "bad value", "/x": "-y", 1: "v", "e": ""}
    got = [(key, error.rule) for key, error in validate_labels(labels)]
    assert got == [
        ("Bad Key", "label-key"),
        ("ok", "label-value"),
        ("/x", "label-key-prefix"),
        ("/x", "label-value"),
        ("1", "label-key"),
    ]
    assert validate_labels({}) == []
    assert validate_labels({"example.com/app": "web", "tier": ""}) == []


@pytest.mark.parametrize("labels", [None, [], "app=web", [("app", "web")], 3])
def test_validate_labels_rejects_non_mappings(labels):
    [(key, error)] = validate_labels(labels)
    assert key == "" and error.rule == "labels-type"


def test_grammar_error_is_a_value_error_that_pickles():
    error = GrammarError("selector-syntax", "expected ')' at position 14", 14)
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rule, copy.message, copy.position, str(copy)) == (
        "selector-syntax", "expected ')' at position 14", 14, "expected ')' at position 14")  # fmt: skip


# --------------------------------------------------------------------------- selectors

VALID_SELECTORS = [
    ("", ""),
    ("   \t\n", ""),
    ("a=b", "a=b"),
    ("a==b", "a=b"),
    (" a = b ", "a=b"),
    ("a != b", "a!=b"),
    ("a=", "a="),
    ("a==", "a="),
    ("a!=", "a!="),
    ("a=,b", "a=,b"),
    ("a= ,b", "a=,b"),
    ("k in (b,a,b)", "k in (a,b)"),
    ("k in(a)", "k in (a)"),
    ("k notin( x , y )", "k notin (x,y)"),
    ("k\tin\n(a)", "k in (a)"),
    ("k\r\n=\tv", "k=v"),
    ("k", "k"),
    ("!k", "!k"),
    ("! k", "!k"),
    ("b=1,a=2", "a=2,b=1"),
    ("a=1, a=1 ,a==1", "a=1"),
    ("x,!x", "!x,x"),
    ("k in (a),k=a", "k=a,k in (a)"),
    ("example.com/app=web", "example.com/app=web"),
    ("a.b-c_d=E.f-G_h", "a.b-c_d=E.f-G_h"),
    ("in in (in,notin)", "in in (in,notin)"),
    ("notin", "notin"),
    ("k=in", "k=in"),
    ("app in (web, api), tier != db , !legacy", "app in (api,web),!legacy,tier!=db"),
    ("x" * 63 + "=" + "y" * 63, "x" * 63 + "=" + "y" * 63),
    ("a" * 253 + "/b", "a" * 253 + "/b"),
]


@pytest.mark.parametrize(("text", "canonical"), VALID_SELECTORS)
def test_valid_selectors(text, canonical):
    selector = parse_selector(text)
    assert str(selector) == canonical
    assert parse_selector(canonical) == selector
    assert selector.is_empty == (canonical == "")


def test_parsed_structure():
    selector = parse_selector("tier notin (db, cache), app in (web,api,web), !legacy, env, k==v, j!=")
    assert selector.requirements == (
        Requirement("app", "in", ("api", "web")),
        Requirement("env", "exists", ()),
        Requirement("j", "!=", ("",)),
        Requirement("k", "=", ("v",)),
        Requirement("legacy", "!exists", ()),
        Requirement("tier", "notin", ("cache", "db")),
    )
    assert parse_selector("") == Selector(()) == Selector()


TOO_MANY = ",".join(f"a{i}" for i in range(MAX_REQUIREMENTS + 1))

INVALID_SELECTORS = [
    ("k in (a, b", "selector-syntax", 10),
    ("k in (a b)", "selector-syntax", 8),
    ("k in (a,)", "selector-syntax", 8),
    ("k in (,a)", "selector-syntax", 6),
    ("k in (a))", "selector-syntax", 8),
    ("k in a", "selector-syntax", 5),
    ("k notin", "selector-syntax", 7),
    ("k in ()", "selector-empty-set", 6),
    ("k notin (  )", "selector-empty-set", 11),
    ("a,", "selector-syntax", 2),
    (",", "selector-syntax", 0),
    (" ,a", "selector-syntax", 1),
    ("a=b,,c", "selector-syntax", 4),
    ("a b", "selector-syntax", 2),
    ("k)", "selector-syntax", 1),
    ("(k)", "selector-syntax", 0),
    ("!a=b", "selector-syntax", 2),
    ("!", "selector-syntax", 1),
    ("!!k", "selector-syntax", 1),
    ("k=(", "selector-syntax", 2),
    ("k!==v", "selector-syntax", 3),
    ("k=a=b", "selector-syntax", 3),
    ("k=v w", "selector-syntax", 4),
    ("k =! v", "selector-syntax", 3),
    ("app=Web_", "label-value", 4),
    ("app in (web, -api)", "label-value", 13),
    ("-app=x", "label-key", 0),
    ("  é", "label-key", 2),
    ("k=v\xa0", "label-value", 2),  # only space, tab, CR and LF separate tokens
    ("\u2003k", "label-key", 0),
    ("k\f", "label-key", 0),
    ("a/b/c", "label-key", 0),
    ("x, !Example.com/app", "label-key-prefix", 4),
    ("/a", "label-key-prefix", 0),
    ("x, " + "a" * 64, "label-key-too-long", 3),
    ("k in (ok, " + "v" * 64 + ")", "label-value-too-long", 10),
    ("k=v" + "x" * (MAX_SELECTOR_LENGTH - 2), "selector-too-long", MAX_SELECTOR_LENGTH),
    (TOO_MANY, "selector-too-many", TOO_MANY.index("a64")),
]


@pytest.mark.parametrize(("text", "rule", "position"), INVALID_SELECTORS)
def test_invalid_selectors(text, rule, position):
    error = error_of(parse_selector, text)
    assert (error.rule, error.position) == (rule, position)
    assert f"position {position}" in error.message


def test_syntax_error_message_names_the_expected_token():
    assert error_of(parse_selector, "app in (web, api").message == "expected ',' or ')' at position 16"
    assert error_of(parse_selector, "k in x").message == "expected '(' at position 5"


def test_limits_are_inclusive():
    at_limit = "k=" + "v" * 63 + "," + ",".join(f"k{i}" for i in range(MAX_REQUIREMENTS - 1))
    assert len(parse_selector(at_limit).requirements) == MAX_REQUIREMENTS
    long_text = "k" + " " * (MAX_SELECTOR_LENGTH - 1)
    assert str(parse_selector(long_text)) == "k"


def test_canonical_text_longer_than_the_limit_is_rejected():
    # 4095 characters as written, but the canonical "k in (" adds a space per requirement.
    text = ",".join(f"k{i:02d} in(" + "v" * 55 + ")" for i in range(MAX_REQUIREMENTS))
    assert len(text) <= MAX_SELECTOR_LENGTH
    assert error_of(parse_selector, text).rule == "selector-too-long"


@pytest.mark.parametrize("value", [None, b"a=b", 5, ["a"], {"a": "b"}])
def test_non_string_selector(value):
    assert error_of(parse_selector, value).rule == "selector-type"


# --------------------------------------------------------------------------- objects


@pytest.mark.parametrize(
    ("args", "rule"),
    [
        (("k", "=", ()), "selector-syntax"),
        (("k", "=", ("a", "b")), "selector-syntax"),
        (("k", "in", ()), "selector-empty-set"),
        (("k", "in", ("", "a")), "label-value"),
        (("k", "in", "ab"), "label-value"),
        (("k", "in", ("a b",)), "label-value"),
        (("k", "exists", ("a",)), "selector-syntax"),
        (("k", "~", ("a",)), "selector-syntax"),
        (("k", None, ()), "selector-syntax"),
        (("Bad Key", "exists", ()), "label-key"),
    ],
)
def test_invalid_requirements(args, rule):
    assert error_of(Requirement, *args).rule == rule


def test_requirement_and_selector_normalise():
    assert Requirement("k", "in", ["b", "a", "b"]).values == ("a", "b")
    assert Requirement("k", "=", ("v", "v")).values == ("v",)
    a, b = Requirement("a", "exists"), Requirement("b", "=", ("1",))
    assert Selector([b, a, b]) == Selector((a, b))
    assert Selector([b, a, b]).requirements == (a, b)
    assert hash(Selector([b, a])) == hash(Selector((a, b)))
    assert str(Requirement("k", "notin", ("b", "a"))) == "k notin (a,b)"


def test_invalid_selector_objects():
    assert error_of(Selector, "a=b").rule == "selector-type"
    assert error_of(Selector, ("a=b",)).rule == "selector-type"
    too_many = [Requirement(f"k{i}", "exists") for i in range(MAX_REQUIREMENTS + 1)]
    assert error_of(Selector, too_many).rule == "selector-too-many"
    long_values = tuple(f"{c}" * 63 for c in "abcde")
    too_long = [Requirement(f"k{i}" * 20, "in", long_values) for i in range(12)]
    assert error_of(Selector, too_long).rule == "selector-too-long"


# --------------------------------------------------------------------------- matching

MATCHES = [
    ("k!=v", {}, True),
    ("k!=v", {"k": "v"}, False),
    ("k!=v", {"k": "w"}, True),
    ("k notin (a,b)", {}, True),
    ("k notin (a,b)", {"k": "a"}, False),
    ("k notin (a,b)", {"k": "c"}, True),
    ("k in (a,b)", {}, False),
    ("k in (a,b)", {"k": "b"}, True),
    ("k in (a,b)", {"k": "c"}, False),
    ("k=v", {}, False),
    ("k=v", {"k": "v"}, True),
    ("k=v", {"k": "V"}, False),
    ("k=v", {"K": "v"}, False),
    ("k=", {"k": ""}, True),
    ("k=", {}, False),
    ("k!=", {}, True),
    ("k!=", {"k": ""}, False),
    ("k!=", {"k": "x"}, True),
    ("k", {"k": ""}, True),
    ("k", {}, False),
    ("!k", {"k": ""}, False),
    ("!k", {}, True),
    ("", {}, True),
    ("", {"a": "b"}, True),
    ("a=1,b=2", {"a": "1"}, False),
    ("a=1,b=2", {"a": "1", "b": "2", "c": "3"}, True),
    ("x,!x", {"x": "1"}, False),
    ("example.com/app=web", {"app": "web"}, False),
    ("example.com/app=web", {"example.com/app": "web"}, True),
]


@pytest.mark.parametrize(("text", "labels", "expected"), MATCHES)
def test_matches_follows_kubernetes_semantics(text, labels, expected):
    assert parse_selector(text).matches(labels) is expected


# --------------------------------------------------------------------------- properties

ALNUM = string.ascii_letters + string.digits
LOWER_ALNUM = string.ascii_lowercase + string.digits


def bracketed(ends: str, middle: str, max_middle: int):
    """Strings of `ends` characters, or ones starting and ending so with `middle` between."""
    end = st.sampled_from(ends)
    inner = st.text(middle, max_size=max_middle)
    return st.one_of(end, st.builds(lambda a, m, b: a + m + b, end, inner, end))


names = bracketed(ALNUM, ALNUM + "-_.", 61)
dns_parts = bracketed(LOWER_ALNUM, LOWER_ALNUM + "-", 20)
# Long prefixes are expensive to generate piecewise, so the 253-character edge is fixed.
prefixes = st.one_of(st.lists(dns_parts, min_size=1, max_size=4).map(".".join), st.just("p-" * 126 + "p"))
keys = st.one_of(names, st.tuples(prefixes, names).map("/".join))
values = st.one_of(st.just(""), names)
# At most 317 + 330 characters a requirement, so six of them stay under the text limit.
requirements = st.one_of(
    st.builds(Requirement, keys, st.sampled_from(["=", "!="]), values.map(lambda v: (v,))),
    st.builds(Requirement, keys, st.sampled_from(["in", "notin"]), st.lists(names, min_size=1, max_size=5)),
    st.builds(Requirement, keys, st.sampled_from(["exists", "!exists"])),
)
selectors = st.lists(requirements, max_size=6).map(Selector)


@PROPERTY
@given(selectors)
def test_print_then_parse_round_trips(selector):
    text = str(selector)
    assert parse_selector(text) == selector
    assert str(parse_selector(text)) == text
    assert selector.is_empty == (text == "")


@PROPERTY
@given(st.lists(requirements, max_size=6), st.randoms(use_true_random=False))
def test_non_canonical_spellings_parse_to_the_same_selector(reqs, rnd):
    shuffled = reqs + reqs[:2]
    rnd.shuffle(shuffled)

    def spell(r: Requirement) -> str:
        w = [rnd.choice(["", " ", "  ", "\t", "\r\n "]) for _ in range(4)]
        if r.op == "exists":
            return f"{w[0]}{r.key}{w[1]}"
        if r.op == "!exists":
            return f"{w[0]}!{w[1]}{r.key}{w[2]}"
        if r.op in ("=", "!="):
            op = rnd.choice(["=", "=="]) if r.op == "=" else "!="
            return f"{w[0]}{r.key}{w[1]}{op}{w[2]}{r.values[0]}{w[3]}"
        listed = list(r.values + r.values[:1])
        rnd.shuffle(listed)
        return f"{w[0]}{r.key} {r.op}{w[1]}({w[2]}{f'{w[3]},{w[3]}'.join(listed)}{w[2]}){w[1]}"

    text = ",".join(map(spell, shuffled))
    if len(text) <= MAX_SELECTOR_LENGTH:
        assert parse_selector(text) == Selector(reqs)


def check_parse_outcome(text: str) -> None:
    try:
        selector = parse_selector(text)
    except GrammarError as error:
        assert error.rule in RULES
        assert error.message
        assert error.position is None or 0 <= error.position <= len(text)
    else:
        canonical = str(selector)
        assert parse_selector(canonical) == selector
        assert str(parse_selector(canonical)) == canonical


@PROPERTY
@given(st.text())
def test_parse_never_raises_anything_but_grammar_error(text):
    check_parse_outcome(text)


# Random text rarely gets past the first token, so also feed the parser soups of grammar
# pieces and valid selectors with a slice cut out or replaced (truncations included).
pieces = st.one_of(
    st.sampled_from(["a", "k", " in ", " notin ", "=", "==", "!=", "!", "(", ")", ",", " ", "\t", "-", "/"]),
    keys,
    values,
    st.text(max_size=3),
)


@PROPERTY
@given(st.lists(pieces, max_size=30).map("".join))
def test_parse_of_token_soup_never_raises_anything_but_grammar_error(text):
    check_parse_outcome(text)


@PROPERTY
@given(selectors, st.data())
def test_parse_of_damaged_selectors_never_raises_anything_but_grammar_error(selector, data):
    text = str(selector)
    start = data.draw(st.integers(0, len(text)))
    end = data.draw(st.one_of(st.just(len(text)), st.integers(start, len(text))))
    check_parse_outcome(text[:start] + data.draw(st.one_of(st.just(""), pieces)) + text[end:])


RICH = "a.io/b in (x,y),c notin ( z ),d=,e==f,g!=h,!i,j, k != , l in(m)"


def test_every_prefix_and_deletion_of_a_selector_fails_cleanly():
    for cut in range(len(RICH) + 1):
        check_parse_outcome(RICH[:cut])
        check_parse_outcome(RICH[:cut] + RICH[cut + 1 :])
        check_parse_outcome(RICH[:cut] + ",")


POOL_KEYS = ["app", "tier", "example.com/team", "env"]
POOL_VALUES = ["web", "db", "a"]
pool_requirements = st.one_of(
    st.tuples(st.sampled_from(POOL_KEYS), st.sampled_from(["=", "!="]),
              st.sampled_from(["", *POOL_VALUES]).map(lambda v: (v,))),
    st.tuples(st.sampled_from(POOL_KEYS), st.sampled_from(["in", "notin"]),
              st.lists(st.sampled_from(POOL_VALUES), min_size=1, max_size=4).map(tuple)),
    st.tuples(st.sampled_from(POOL_KEYS), st.sampled_from(["exists", "!exists"]), st.just(())),
)  # fmt: skip
pool_labels = st.dictionaries(st.sampled_from(POOL_KEYS), st.sampled_from(["", *POOL_VALUES]))


def reference_matches(specs, labels) -> bool:
    """The Kubernetes rules, spelled out one operator at a time."""
    for key, op, vals in specs:
        present = key in labels
        value = labels.get(key)
        if op == "=":
            ok = present and value == vals[0]
        elif op == "!=":
            ok = not present or value != vals[0]
        elif op == "in":
            ok = present and value in vals
        elif op == "notin":
            ok = not present or value not in vals
        elif op == "exists":
            ok = present
        else:
            ok = not present
        if not ok:
            return False
    return True


@PROPERTY
@given(st.lists(pool_requirements, max_size=5), pool_labels)
def test_matches_agrees_with_reference(specs, labels):
    selector = Selector([Requirement(*spec) for spec in specs])
    expected = reference_matches(specs, labels)
    assert selector.matches(labels) is expected
    assert parse_selector(str(selector)).matches(labels) is expected
    for spec in specs:
        assert Requirement(*spec).matches(labels) is reference_matches([spec], labels)


# --------------------------------------------------------------------------- purity


def test_grammar_imports_only_the_standard_library():
    import policy.grammar

    tree = ast.parse(Path(policy.grammar.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative imports reach into the project"
            imported.add(node.module.split(".")[0])
    assert imported, "the AST walk found no imports at all"
    assert imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names
