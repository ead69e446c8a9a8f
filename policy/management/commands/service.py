from controlplane.management.crud import ObjectCommand
from policy import selectors, services
from policy.representations import service_data


class Command(ObjectCommand):
    help = "Named services: list, show, create, replace, delete (same rules as /api/v1/services)."
    noun, id_keyword = "service", "service_id"
    list_items = staticmethod(selectors.service_list)
    get_item = staticmethod(selectors.service_get)
    represent = staticmethod(service_data)
    create_item = staticmethod(services.service_create)
    replace_item = staticmethod(services.service_replace)
    delete_item = staticmethod(services.service_delete)
