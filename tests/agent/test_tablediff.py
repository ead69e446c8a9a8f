"""The one-line description of a hand edit of the owned table."""

from agent.tablediff import ADDED, CHANGED, MAX_DESCRIPTION_CHARS, REMOVED, Changes, describe


def changes(*items: tuple) -> Changes:
    found = Changes()
    for item in items:
        found.add(*item)
    return found


def test_a_rule_added_to_a_chain():
    assert describe(changes(("chain", "input", ADDED, "rule"))) == "chain input: 1 rule added"


def test_elements_count_and_plural():
    assert describe(changes(("set", "allow_v4_3", ADDED, "element"))) == "set allow_v4_3: 1 element added"
    assert (
        describe(changes(("set", "allow_v4_3", REMOVED, "element", 4)))
        == "set allow_v4_3: 4 elements removed"
    )


def test_several_objects_in_the_order_they_were_touched():
    text = describe(
        changes(
            ("chain", "input", REMOVED, "rule", 3),
            ("set", "s", ADDED, "element"),
            ("chain", "input", ADDED, "rule"),
            ("chain", "extra", ADDED),
        )
    )
    assert text == "chain input: 3 rules removed, 1 rule added; set s: 1 element added; chain extra added"


def test_the_object_itself_and_its_members():
    assert describe(changes(("chain", "input", CHANGED), ("chain", "input", ADDED, "rule", 2))) == (
        "chain input changed: 2 rules added"
    )
    assert describe(changes(("table", "", CHANGED))) == "table changed"
    assert describe(changes(("chain", "x", ADDED), ("chain", "x", ADDED))) == "chain x added 2 times"


def test_nothing_and_zero_counts():
    assert describe(changes(("set", "s", ADDED, "element", 0))) == "no difference"


def test_a_long_edit_stays_one_bounded_line():
    many = changes(*((("chain", f"chain_{i:04}", REMOVED, "rule", i + 1)) for i in range(200)))
    text = describe(many)
    assert len(text) <= MAX_DESCRIPTION_CHARS and text.endswith("; ...") and "\n" not in text
    assert text.startswith("chain chain_0000: 1 rule removed; chain chain_0001: 2 rules removed")
