"""YAML as a policy file is read: YAML 1.2's core schema, not PyYAML's YAML 1.1 resolution.

PyYAML resolves plain scalars by YAML 1.1's rules, under which `port: 1:30` is 90 (base 60),
`017` is 15 (octal), `1_000` is 1000, `yes`/`no`/`on`/`off` are booleans and `2026-01-01` a date.
YAML 1.2's core schema (the YAML of most editors and linters today) reads a plain scalar as:

- null: `~`, `null`, `Null`, `NULL` or nothing;
- a boolean: `true`, `True`, `TRUE`, `false`, `False`, `FALSE`;
- an integer: `[-+]?[0-9]+` (decimal, leading zeros included: `017` is 17), `0o[0-7]+` (octal),
  `0x[0-9a-fA-F]+` (hexadecimal);
- a float: `[-+]?(\\.[0-9]+|[0-9]+(\\.[0-9]*)?)([eE][-+]?[0-9]+)?`, `[-+]?.inf` and `.nan` (each
  also capitalised or in capitals);
- anything else a string: `1:30`, `1_000`, `yes`, `on`, `0b101`, `2026-01-01`, `12:00:00`.

A quoted scalar is always a string. Explicit tags are those of the core schema alone (`!!str`,
`!!int`, `!!float`, `!!bool`, `!!null`, `!!seq`, `!!map`), read by the same rules (`!!int 1_000` is
refused); any other (`!!python/object`, `!!timestamp`, `!!binary`, `!!set`) is refused. An integer
longer than MAX_INTEGER_DIGITS digits is refused (no field takes one; Python refuses to read past
4,300 digits, with an error naming a setting). Each refusal is a YAML error at its line and column,
which the caller reports as one line. Parsing is libyaml's where PyYAML has it (the pure-Python
parser is some five times slower on a large file).
"""

from __future__ import annotations

import re

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.resolver import BaseResolver

from controlplane.strict_json import MAX_NUMBER_DIGITS
from controlplane.validation import quoted

MAX_INTEGER_DIGITS = MAX_NUMBER_DIGITS

_NULL = re.compile(r"~|null|Null|NULL|")
_BOOL = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_INT = re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")
_FLOAT = re.compile(
    r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"
)
_TAG = "tag:yaml.org,2002:"


class CoreResolver(BaseResolver):
    """Plain scalars resolved by the core schema's patterns alone (the module says which)."""


# BaseResolver keeps its table per class; these are the only implicit resolutions.
CoreResolver.yaml_implicit_resolvers = {}
for _tag, _pattern, _first in (
    ("bool", r"true|True|TRUE|false|False|FALSE", "tTfF"),
    ("int", _INT.pattern, "-+0123456789"),
    ("float", _FLOAT.pattern, "-+0123456789."),
    ("null", _NULL.pattern, ["~", "n", "N", ""]),
):
    CoreResolver.add_implicit_resolver(_TAG + _tag, re.compile(rf"^(?:{_pattern})$"), list(_first))


class CoreConstructor(SafeConstructor):
    """The core schema's tags, each read by its own pattern; every other tag refused."""

    def construct_yaml_null(self, node):
        self._scalar_as(node, _NULL, "null")

    def construct_yaml_bool(self, node):
        value = self.construct_scalar(node)
        if value not in _BOOL:
            raise ConstructorError(
                None, None, f"{quoted(value)} is not a boolean (true or false)", node.start_mark
            )
        return _BOOL[value]

    def construct_yaml_int(self, node):
        value = self._scalar_as(node, _INT, "an integer")
        digits = value.lstrip("+-")
        if len(digits) > MAX_INTEGER_DIGITS:
            raise ConstructorError(
                None,
                None,
                f"an integer of {len(digits)} digits: no field takes more than {MAX_INTEGER_DIGITS}",
                node.start_mark,
            )
        if digits.startswith(("0o", "0x")):
            return int(digits[2:], 8 if digits[1] == "o" else 16)
        return int(value)

    def construct_yaml_float(self, node):
        value = self._scalar_as(node, _FLOAT, "a number")
        if len(value) > MAX_INTEGER_DIGITS:
            raise ConstructorError(
                None, None, f"a number of more than {MAX_INTEGER_DIGITS} characters", node.start_mark
            )
        lowered = value.lower()
        return float(
            lowered.replace(".inf", "inf") if lowered.endswith(".inf") else lowered.replace(".nan", "nan")
        )

    def construct_not_admitted(self, node):
        raise ConstructorError(
            None,
            None,
            f"the tag {node.tag.replace(_TAG, '!!')} is not admitted in a policy file (YAML 1.2 core schema)",
            node.start_mark,
        )

    def _scalar_as(self, node, pattern: re.Pattern, what: str) -> str:
        value = self.construct_scalar(node)
        if not pattern.fullmatch(value):
            raise ConstructorError(None, None, f"{quoted(value)} is not {what}", node.start_mark)
        return value


CoreConstructor.yaml_constructors = {
    _TAG + "null": CoreConstructor.construct_yaml_null,
    _TAG + "bool": CoreConstructor.construct_yaml_bool,
    _TAG + "int": CoreConstructor.construct_yaml_int,
    _TAG + "float": CoreConstructor.construct_yaml_float,
    _TAG + "str": SafeConstructor.construct_yaml_str,
    _TAG + "seq": SafeConstructor.construct_yaml_seq,
    _TAG + "map": SafeConstructor.construct_yaml_map,
    None: CoreConstructor.construct_not_admitted,
}
CoreConstructor.yaml_multi_constructors = {}

# libyaml's parser where PyYAML was built with it, else PyYAML's own.
if getattr(yaml, "__with_libyaml__", False):
    from yaml.cyaml import CParser as _Parser

    class CoreParser(_Parser):  # type: ignore[misc,valid-type]
        pass

else:  # pragma: no cover - PyYAML without libyaml
    from yaml.composer import Composer
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class CoreParser(Reader, Scanner, Parser, Composer):  # type: ignore[no-redef]
        def __init__(self, stream):
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)
            Composer.__init__(self)


def aliases_refuse(node) -> None:
    """An alias is the node of its anchor met again: refused, since a policy needs none and they could
    multiply a small file into a huge one (walked without recursion, every node once)."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not admitted in a policy file", node.start_mark
            )
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack += (key, value)
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
