#!/usr/bin/env bash
# Install what the service needs and run it on the embedded SQLite default.
# Extra arguments go to `manage.py serve` (e.g. --operator-listen :9443 --data-dir /srv/palisade).
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
ensure_venv runtime
cd "$ROOT"
exec "$VENV/bin/python" manage.py serve "$@"
