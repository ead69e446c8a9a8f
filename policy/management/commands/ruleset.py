from controlplane.management.crud import ObjectCommand
from policy import selectors, services
from policy.representations import ruleset_data


class Command(ObjectCommand):
    help = "Rulesets with their rules: list, show, create, replace, delete (same rules as /api/v1/rulesets)."
    noun, id_keyword = "ruleset", "ruleset_id"
    list_items = staticmethod(selectors.ruleset_list)
    get_item = staticmethod(selectors.ruleset_get)
    represent = staticmethod(ruleset_data)
    create_item = staticmethod(services.ruleset_create)
    replace_item = staticmethod(services.ruleset_replace)
    delete_item = staticmethod(services.ruleset_delete)
