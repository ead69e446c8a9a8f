"""Create the stock deployment's database, one user and its DRF token; print the token."""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "stock_django.settings")
django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.core.management import call_command  # noqa: E402
from rest_framework.authtoken.models import Token  # noqa: E402

call_command("migrate", verbosity=0)
user = User.objects.create_user("bench")
print(Token.objects.create(user=user).key)
