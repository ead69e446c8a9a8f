"""Label grammar and label selectors.

Standard library only: the API validators, the renderer and offline tools share this
single definition of what a label and a selector are.

Labels (a workload's labels are a dict of key -> value, one value per key)::

    key    ::= [prefix "/"] name
    prefix ::= DNS subdomain: "."-separated parts of [a-z0-9-], each part starting and
               ending with [a-z0-9]; at most 253 characters
    name   ::= 1-63 characters of [A-Za-z0-9_.-], starting and ending with [A-Za-z0-9]
    value  ::= "" | 1-63 characters with the same rules as name

Selectors (requirements are ANDed; space, tab, CR and LF are allowed around tokens)::

    selector    ::= "" | requirement ("," requirement)*
    requirement ::= key ("=" | "==" | "!=") [value]     # omitted value means ""
                  | key ("in" | "notin") "(" value ("," value)* ")"
                  | key                                  # key exists
                  | "!" key                              # key does not exist

Semantics follow Kubernetes: ``k!=v`` and ``k notin (...)`` also match workloads without
``k``. Set values are non-empty (use ``k=`` or ``k!=`` for the empty value) and duplicates
collapse. The empty selector matches everything. Limits: 4096 characters, 64 requirements.

Canonical form: requirements sorted by (key, op, values), duplicates removed, printed as
``k=v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k``, ``!k`` joined by ",";
``parse_selector(str(s)) == s`` for every Selector.

Every failure is a GrammarError (a ValueError) with a stable ``rule``: label-key,
label-key-prefix, label-key-too-long, label-value, label-value-too-long, labels-type,
selector-type, selector-syntax, selector-empty-set, selector-too-long, selector-too-many.
``position`` is the 0-based offset into the selector text; it is None for labels checked
on their own and for problems that belong to no single place.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

MAX_SELECTOR_LENGTH = 4096
MAX_REQUIREMENTS = 64
MAX_PREFIX_LENGTH = 253
MAX_NAME_LENGTH = 63

_NAME = re.compile(r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?")
_PREFIX = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")
# Between two tokens there can only be whitespace, so finditer() doubles as the scanner.
# Whitespace is Kubernetes' four ASCII characters: a pasted no-break space is an error,
# not an invisible separator.
_TOKEN = re.compile(r"(?P<op>==|!=|[=!(),])|(?P<word>[^ \t\r\n=!(),]+)")
_OPS = frozenset({"=", "!=", "in", "notin", "exists", "!exists"})
_END = "end"
_NAME_RULES = "letters, digits, '-', '_' and '.', starting and ending with a letter or digit"


class GrammarError(ValueError):
    def __init__(self, rule: str, message: str, position: int | None = None) -> None:
        # All three go to args so that the error survives pickling and copying.
        super().__init__(rule, message, position)
        self.rule, self.message, self.position = rule, message, position

    def __str__(self) -> str:
        return self.message


# Fleets reuse a small vocabulary of keys and values, so caching the verdicts makes
# validating 10,000 workloads (or parsing their selectors) mostly dictionary lookups.
@lru_cache(maxsize=8192)
def _key_problem(key: str) -> tuple[str, str] | None:
    prefix, slash, name = key.rpartition("/")
    if slash:
        if "/" in prefix:
            return "label-key", "label key may contain at most one '/'"
        if not prefix:
            return "label-key-prefix", "label key prefix before '/' must not be empty"
        if len(prefix) > MAX_PREFIX_LENGTH:
            return "label-key-too-long", f"label key prefix must be at most {MAX_PREFIX_LENGTH} characters"
        if not _PREFIX.fullmatch(prefix):
            return "label-key-prefix", (
                "label key prefix must be a DNS subdomain: lowercase letters, digits, '-' and '.', "
                "each part starting and ending with a letter or digit"
            )
    if not name:
        return "label-key", "label key name must not be empty"
    if len(name) > MAX_NAME_LENGTH:
        return "label-key-too-long", f"label key name must be at most {MAX_NAME_LENGTH} characters"
    if not _NAME.fullmatch(name):
        return "label-key", f"label key name must consist of {_NAME_RULES}"
    return None


@lru_cache(maxsize=8192)
def _value_problem(value: str) -> tuple[str, str] | None:
    if len(value) > MAX_NAME_LENGTH:
        return "label-value-too-long", f"label value must be at most {MAX_NAME_LENGTH} characters"
    if value and not _NAME.fullmatch(value):
        return "label-value", f"label value must be empty or consist of {_NAME_RULES}"
    return None


def validate_label_key(key: object) -> None:
    if not isinstance(key, str):
        raise GrammarError("label-key", f"label key must be a string, not {type(key).__name__}")
    if problem := _key_problem(key):
        raise GrammarError(*problem)


def validate_label_value(value: object) -> None:
    if not isinstance(value, str):
        raise GrammarError("label-value", f"label value must be a string, not {type(value).__name__}")
    if problem := _value_problem(value):
        raise GrammarError(*problem)


def validate_labels(labels: object) -> list[tuple[str, GrammarError]]:
    if not isinstance(labels, Mapping):
        return [("", GrammarError("labels-type", "labels must be a mapping of label keys to values"))]
    problems: list[tuple[str, GrammarError]] = []
    for key, value in labels.items():
        where = key if isinstance(key, str) else repr(key)
        for check, item in ((validate_label_key, key), (validate_label_value, value)):
            try:
                check(item)
            except GrammarError as error:
                problems.append((where, error))
    return problems


def _as_tuple(items: object, what: str, rule: str) -> tuple:
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise GrammarError(rule, f"{what} must be a sequence, not {type(items).__name__}")
    return tuple(items)


# order=True compares (key, op, values), which is exactly the canonical order.
@dataclass(frozen=True, order=True)
class Requirement:
    key: str
    op: str
    values: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Constructed requirements get the same checks as parsed ones, so every
        # Requirement prints to text that parses back to it.
        validate_label_key(self.key)
        op = self.op
        if not isinstance(op, str) or op not in _OPS:
            raise GrammarError("selector-syntax", f"unknown selector operator {op!r}")
        values = _as_tuple(self.values, "requirement values", "label-value")
        for value in values:
            validate_label_value(value)
        values = tuple(sorted(set(values)))
        if op in ("=", "!=") and len(values) != 1:
            raise GrammarError("selector-syntax", f"'{op}' takes exactly one value")
        if op in ("in", "notin") and not values:
            raise GrammarError("selector-empty-set", f"'{op}' needs at least one value")
        if op in ("in", "notin") and values[0] == "":
            raise GrammarError("label-value", f"'{op}' values must not be empty; use '=' or '!='")
        if op in ("exists", "!exists") and values:
            raise GrammarError("selector-syntax", f"'{op}' takes no values")
        object.__setattr__(self, "values", values)

    def matches(self, labels: Mapping[str, str]) -> bool:
        op, present = self.op, self.key in labels
        if op == "exists" or op == "!exists":
            return present == (op == "exists")
        if op == "=" or op == "!=":
            return (present and labels[self.key] == self.values[0]) == (op == "=")
        return (present and labels[self.key] in self.values) == (op == "in")

    def __str__(self) -> str:
        op, key = self.op, self.key
        if op == "exists":
            return key
        if op == "!exists":
            return "!" + key
        if op == "=" or op == "!=":
            return f"{key}{op}{self.values[0]}"
        return f"{key} {op} ({','.join(self.values)})"


@dataclass(frozen=True)
class Selector:
    requirements: tuple[Requirement, ...] = ()

    def __post_init__(self) -> None:
        reqs = _as_tuple(self.requirements, "selector requirements", "selector-type")
        if not all(isinstance(r, Requirement) for r in reqs):
            raise GrammarError("selector-type", "selector requirements must be Requirement objects")
        reqs = tuple(sorted(set(reqs)))
        if len(reqs) > MAX_REQUIREMENTS:
            raise GrammarError("selector-too-many", f"selector has more than {MAX_REQUIREMENTS} requirements")
        # The limit applies to the canonical text so that every Selector parses again; the
        # text is kept because renderers use it as a cache key.
        text = ",".join(map(str, reqs))
        if len(text) > MAX_SELECTOR_LENGTH:
            msg = f"selector is longer than {MAX_SELECTOR_LENGTH} characters"
            raise GrammarError("selector-too-long", msg)
        object.__setattr__(self, "requirements", reqs)
        object.__setattr__(self, "_text", text)

    def matches(self, labels: Mapping[str, str]) -> bool:
        for requirement in self.requirements:
            if not requirement.matches(labels):
                return False
        return True

    def __str__(self) -> str:
        return self._text  # type: ignore[attr-defined]

    @property
    def is_empty(self) -> bool:
        return not self.requirements


def _expected(what: str, pos: int) -> GrammarError:
    return GrammarError("selector-syntax", f"expected {what} at position {pos}", pos)


def _checked(check: Callable[[str], object], token: str, pos: int) -> str:
    try:
        check(token)
    except GrammarError as error:
        raise GrammarError(error.rule, f"{error.message} (at position {pos})", pos) from None
    return token


class _Parser:
    """Recursive descent over (kind, text, position) tokens; kind is "op", "word" or "end"."""

    __slots__ = ("tokens", "i")

    def __init__(self, text: str) -> None:
        # Every alternative of _TOKEN is a named group, so lastgroup is never None.
        self.tokens: list[tuple[str, str, int]] = [
            (m.lastgroup or "", m.group(), m.start()) for m in _TOKEN.finditer(text)
        ]
        self.tokens.append((_END, "", len(text)))
        self.i = 0

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.i]

    def take(self) -> tuple[str, str, int]:
        # Every rule fails on an unexpected "end", so nothing ever reads past it.
        token = self.tokens[self.i]
        self.i += 1
        return token

    def selector(self) -> list[Requirement]:
        reqs = [self.requirement()]
        while True:
            kind, text, pos = self.take()
            if kind == _END:
                return reqs
            if text != ",":
                raise _expected("',' or end of input", pos)
            if len(reqs) == MAX_REQUIREMENTS:
                pos = self.peek()[2]
                msg = f"selector has more than {MAX_REQUIREMENTS} requirements (at position {pos})"
                raise GrammarError("selector-too-many", msg, pos)
            reqs.append(self.requirement())

    def requirement(self) -> Requirement:
        kind, text, pos = self.take()
        if kind == "op" and text == "!":
            return Requirement(self.key(*self.take()), "!exists")
        key = self.key(kind, text, pos)
        kind, text, pos = self.peek()
        if kind == _END or text == ",":
            return Requirement(key, "exists")
        self.i += 1
        if kind == "op" and text in ("=", "==", "!="):
            return Requirement(key, "!=" if text == "!=" else "=", (self.exact_value(),))
        if kind == "word" and text in ("in", "notin"):
            return Requirement(key, text, self.value_set(text))
        raise _expected("'=', '==', '!=', 'in', 'notin', ',' or end of input", pos)

    def key(self, kind: str, text: str, pos: int) -> str:
        if kind != "word":
            raise _expected("a label key", pos)
        return _checked(validate_label_key, text, pos)

    def exact_value(self) -> str:
        kind, text, pos = self.peek()
        if kind == _END or text == ",":
            return ""
        if kind != "word":
            raise _expected("a label value", pos)
        self.i += 1
        return _checked(validate_label_value, text, pos)

    def value_set(self, op: str) -> tuple[str, ...]:
        kind, text, pos = self.take()
        if text != "(":
            raise _expected("'('", pos)
        if self.peek()[1] == ")":
            pos = self.peek()[2]
            msg = f"'{op}' needs at least one value at position {pos}"
            raise GrammarError("selector-empty-set", msg, pos)
        values = []
        while True:
            kind, text, pos = self.take()
            if kind != "word":
                raise _expected("a label value", pos)
            values.append(_checked(validate_label_value, text, pos))
            kind, text, pos = self.take()
            if text == ")":
                return tuple(values)
            if text != ",":
                raise _expected("',' or ')'", pos)


def parse_selector(text: str) -> Selector:
    if not isinstance(text, str):
        raise GrammarError("selector-type", f"selector must be a string, not {type(text).__name__}")
    if len(text) > MAX_SELECTOR_LENGTH:
        msg = f"selector is longer than {MAX_SELECTOR_LENGTH} characters (at position {MAX_SELECTOR_LENGTH})"
        raise GrammarError("selector-too-long", msg, MAX_SELECTOR_LENGTH)
    return _parse(text)


# Policies share a handful of selectors across a fleet and Selector is immutable, so a
# rendered fleet parses each distinct text once. Errors are not cached; they are rare.
@lru_cache(maxsize=4096)
def _parse(text: str) -> Selector:
    parser = _Parser(text)
    if parser.peek()[0] == _END:
        return Selector(())
    return Selector(tuple(parser.selector()))
