"""The service's notion of now. Every instant the domain stores or compares comes from here, so tests
move time forward instead of waiting."""

from datetime import UTC, datetime, timedelta

from django.utils import timezone

_offset = timedelta(0)


def now() -> datetime:
    return timezone.now() + _offset


def rfc3339(instant: datetime | None) -> str | None:
    if instant is None:
        return None
    return instant.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
