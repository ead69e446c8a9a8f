from controlplane.management.crud import ObjectCommand
from policy import selectors, services
from policy.representations import address_group_data


class Command(ObjectCommand):
    help = "Address groups: list, show, create, replace, delete (same rules as /api/v1/address-groups)."
    noun, id_keyword = "address group", "group_id"
    list_items = staticmethod(selectors.address_group_list)
    get_item = staticmethod(selectors.address_group_get)
    represent = staticmethod(address_group_data)
    create_item = staticmethod(services.address_group_create)
    replace_item = staticmethod(services.address_group_replace)
    delete_item = staticmethod(services.address_group_delete)
