"""Workloads for tests that are not about enrolment: created as enrolment would leave them."""

import base64
import itertools
import os
from datetime import timedelta

from controlplane import clock
from fleet.models import Workload
from fleet.rendering import workloads_rerender

_serial = itertools.count(1)


def make_workload(*, hostname=None, labels=None, addresses=None, mode="visibility", render=True) -> Workload:
    n = next(_serial)
    now = clock.now()
    workload = Workload.objects.create(
        hostname=hostname or f"host-{n:04}",
        labels=labels or {},
        addresses=addresses if addresses is not None else [f"10.9.{n // 250}.{n % 250 + 1}"],
        mode=mode,
        public_key=base64.b64encode(os.urandom(32)).decode(),
        credential_issued_at=now,
        credential_expires_at=now + timedelta(days=30),
        enrolled_at=now,
    )
    if render:
        workloads_rerender(workload_ids=[str(workload.id)])
        workload.refresh_from_db()
    return workload


def connect(workload: Workload, stream_id: str = "stream-1") -> Workload:
    from fleet.streams import stream_snapshot
    from fleet.sync import workload_stream_opened

    workload_stream_opened(workload_id=workload.id, stream_id=stream_id, agent_version="0.1.0")
    stream_snapshot(workload_id=workload.id, stream_id=stream_id)
    workload.refresh_from_db()
    return workload
