#!/usr/bin/env bash
# Install everything the tests need (nftables, conntrack, the test dependencies) and run the whole
# suite. Without DATABASE_URL the tests use SQLite; CI sets it to a local PostgreSQL.
# Tests that need root or a missing service skip with the reason (PALISADE_REQUIRE_ALL=1 fails them).
# Extra arguments go to pytest.
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
# chromium: the console tests drive Debian's browser (Playwright launches it by path).
# prometheus: promtool checks the shipped alerting rules and a real Prometheus scrapes serve.
apt_install nftables python3-nftables conntrack iproute2 iputils-ping openssl chromium faketime prometheus
ensure_venv test
link_debian_nftables
cd "$ROOT"
exec "$VENV/bin/python" -m pytest "$@"
