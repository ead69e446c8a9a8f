"""The shape shared by host commands over one kind of authored object:
`list`, `show ID`, `create FILE`, `replace ID FILE --if-match V`, `delete ID --if-match V`.
FILE is a JSON file, or `-` for standard input. Each action calls the named domain function."""

from __future__ import annotations

import json
from collections.abc import Callable

from controlplane.conditional import if_match_from_header
from controlplane.management.base import PalisadeCommand


class ObjectCommand(PalisadeCommand):
    noun: str  # e.g. "service"
    id_keyword: str  # the domain functions' id argument, e.g. "service_id"
    list_items: Callable[[], list]
    get_item: Callable[..., object]
    represent: Callable[[object], dict]
    create_item: Callable[..., object]
    replace_item: Callable[..., object]
    delete_item: Callable[..., None]

    def add_arguments(self, parser):
        super().add_arguments(parser)
        actions = self.add_actions(parser)
        actions.add_parser("list", help=f"list every {self.noun}")
        show = actions.add_parser("show", help=f"show one {self.noun}")
        show.add_argument("id")
        create = actions.add_parser("create", help=f"create a {self.noun} from a JSON file (- for stdin)")
        create.add_argument("file")
        replace = actions.add_parser("replace", help=f"replace a {self.noun} from a JSON file (- for stdin)")
        replace.add_argument("id")
        replace.add_argument("file")
        replace.add_argument("--if-match", required=True, help="the version you read")
        delete = actions.add_parser("delete", help=f"delete a {self.noun}")
        delete.add_argument("id")
        delete.add_argument("--if-match", required=True, help="the version you read")

    def show_one(self, obj) -> None:
        data = type(self).represent(obj)
        self.emit(data, json.dumps(data, indent=2))

    def do_list(self, options):
        items = [type(self).represent(obj) for obj in type(self).list_items()]
        lines = [f"{'ID':36}  {'VERSION':8}  NAME"] + [
            f"{i['id']:36}  {i['version']:8}  {i['name']}" for i in items
        ]
        self.emit(items, "\n".join(lines))

    def do_show(self, options):
        self.show_one(type(self).get_item(**{self.id_keyword: options["id"]}))

    def do_create(self, options):
        obj = type(self).create_item(actor=self.actor, data=self.read_json_input(options["file"]))
        self.show_one(type(self).get_item(**{self.id_keyword: str(obj.id)}))

    def do_replace(self, options):
        type(self).replace_item(
            actor=self.actor,
            expected_version=if_match_from_header(options["if_match"]),
            data=self.read_json_input(options["file"]),
            **{self.id_keyword: options["id"]},
        )
        self.show_one(type(self).get_item(**{self.id_keyword: options["id"]}))

    def do_delete(self, options):
        type(self).delete_item(
            actor=self.actor,
            expected_version=if_match_from_header(options["if_match"]),
            **{self.id_keyword: options["id"]},
        )
        self.emit({"deleted": options["id"]}, f"deleted {self.noun} {options['id']}")
