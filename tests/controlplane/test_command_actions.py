"""Host commands with actions (`mint`, `list`, ...): the base command runs the action named on the
command line in the command's method `do_<action>`."""

import io

import pytest
from django.core.management import call_command, get_commands, load_command_class

from controlplane.management.base import PalisadeCommand


class Sample(PalisadeCommand):
    migrates_itself = True  # touches no database

    def add_arguments(self, parser):
        super().add_arguments(parser)
        actions = self.add_actions(parser)
        actions.add_parser("show").add_argument("name")
        actions.add_parser("set-name").add_argument("name")

    def do_show(self, options):
        self.emit({"shown": options["name"]}, f"shown {options['name']}")

    def do_set_name(self, options):
        self.emit({"set": options["name"]}, f"set {options['name']}")


def test_the_action_named_runs_its_method_and_a_dash_reads_as_an_underscore():
    out = io.StringIO()
    call_command(Sample(), "show", "a", stdout=out)
    call_command(Sample(), "set-name", "b", "--json", stdout=out)
    assert out.getvalue() == 'shown a\n{\n  "set": "b"\n}\n'


def test_an_action_declared_without_its_method_fails_when_the_command_is_built():
    class Forgetful(PalisadeCommand):
        def add_arguments(self, parser):
            super().add_arguments(parser)
            self.add_actions(parser).add_parser("revoke")

    with pytest.raises(TypeError, match="the action revoke has no do_revoke"):
        Forgetful().create_parser("manage.py", "forgetful")


@pytest.mark.parametrize(
    "name",
    sorted(
        name
        for name, app in get_commands().items()
        if app in ("controlplane", "controlplane.auth", "policy", "fleet", "flows")
    ),
)
def test_every_command_builds_with_a_method_for_each_action(name):
    command = load_command_class(get_commands()[name], name)
    assert isinstance(command, PalisadeCommand)
    command.create_parser("manage.py", name)
