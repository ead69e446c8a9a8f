"""Rendering fan-out: every change that can alter workloads' documents re-renders exactly the
workloads it can affect, persists documents whose content changed, moves those workloads' latest
version, and tells their open streams after commit. Workloads whose document is unchanged are not
written to.

Which workloads a change can affect:
- a ruleset, rule, service or address-group write: the workloads in the scopes of the rulesets it
  touched (before and after the write);
- a label or address change of workload W: W itself, and every workload protected by a ruleset with
  a rule whose source selector matched W before or after (W was, or becomes, their peer);
- a mode change: the selected workloads.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction

from controlplane import clock, metrics
from fleet.choices import Mode
from fleet.models import RenderedPolicy, Workload
from fleet.sync import latest_version_moved
from policy.grammar import Selector, parse_selector
from policy.models import PolicyState
from policy.render_inputs import (
    FleetIndex,
    PortEntry,
    WorkloadInput,
)
from policy.renderer import compile_policy
from policy.selectors import PolicyInputs, policy_inputs_load

log = logging.getLogger("palisade.fleet")


_INPUT_FIELDS = ("id", "labels", "addresses", "mode", "outbound_mode")


def workload_input_of(workload_id, labels, addresses, mode, outbound_mode=Mode.VISIBILITY) -> WorkloadInput:
    return WorkloadInput(
        id=str(workload_id), labels=labels, addresses=tuple(addresses), mode=mode, outbound_mode=outbound_mode
    )


def fleet_load() -> tuple[FleetIndex, dict[str, WorkloadInput]]:
    rows = Workload.objects.values_list(*_INPUT_FIELDS)
    inputs = {str(r[0]): workload_input_of(*r) for r in rows}
    return FleetIndex.build(inputs.values()), inputs


def outbound_failsafe() -> tuple[PortEntry, ...]:
    """The fail-safe list every output chain admits (settings.PALISADE_OUTBOUND_FAILSAFE)."""
    return tuple(PortEntry(*entry) for entry in settings.PALISADE_OUTBOUND_FAILSAFE)


def _judging_outbound(inputs: Mapping[str, WorkloadInput]) -> set[str]:
    # An output chain reads the whole fleet's inbound policy ("one rule, both ends") and every
    # workload's addresses: any policy or peer change may alter it.
    return {wid for wid, w in inputs.items() if w.outbound_mode != Mode.VISIBILITY}


@dataclass(frozen=True)
class Rerendered:
    considered: int
    changed: tuple[str, ...]


@metrics.RENDER_FANOUT_SECONDS.time()
def workloads_rerender(
    *,
    workload_ids: Iterable[str] | None = None,
    loaded: tuple[FleetIndex, dict[str, WorkloadInput]] | None = None,
    policy: PolicyInputs | None = None,
) -> Rerendered:
    """Render the given workloads (all when None); persist what changed. Call inside the write's
    transaction: the documents commit with the change that caused them."""
    fleet, inputs = loaded or fleet_load()
    targets = inputs.keys() if workload_ids is None else [str(w) for w in workload_ids if str(w) in inputs]
    if not targets:
        return Rerendered(considered=0, changed=())
    policy = policy or policy_inputs_load()
    current = dict(
        Workload.objects.filter(id__in=list(targets)).values_list("id", "latest_policy_id")
        if workload_ids is not None
        else Workload.objects.values_list("id", "latest_policy_id")
    )
    current = {str(k): v for k, v in current.items()}
    rendered_by_version: dict[str, object] = {}
    moved: dict[str, str] = {}
    compiled = compile_policy(policy.rulesets, policy.groups, fleet, outbound_failsafe())
    for workload_id in targets:
        with metrics.RENDER_DOCUMENT_SECONDS.time():
            result = compiled.render(inputs[workload_id])
        if current.get(workload_id) != result.version:
            moved[workload_id] = result.version
            rendered_by_version[result.version] = result
    if moved:
        _store_documents(rendered_by_version.values())
        latest_version_moved(moved)
    return Rerendered(considered=len(targets), changed=tuple(moved))


def documents_refresh_if_stale() -> Rerendered | None:
    """Re-render every workload when an upgrade's migration marked the stored documents stale (its
    renderer writes them differently), so agents converge on the new documents at once and dry-runs
    do not count every workload as changed. serve calls it before it listens; None when not stale."""
    with transaction.atomic():
        # The policy writes' lock: no policy write interleaves with this render.
        state = PolicyState.objects.select_for_update().filter(id=1, documents_stale=True).first()
        if state is None:
            return None
        rerendered = workloads_rerender()
        state.documents_stale = False
        state.save(update_fields=["documents_stale"])
    return rerendered


def _store_documents(results) -> None:
    versions = [r.version for r in results]
    known = _existing_versions(versions)
    now = clock.now()
    fresh = [r for r in results if r.version not in known]
    if not fresh:
        return
    if connection.vendor == "postgresql":
        # Bound parameters in one pipelined batch: a fan-out may store thousands of ~100 KB documents,
        # and one giant INSERT of quoted literals measured half as fast.
        table = RenderedPolicy._meta.db_table
        with connection.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO {table} (version, document, rule_index, created_at) "  # noqa: S608
                "VALUES (%s, %s, %s, %s) ON CONFLICT (version) DO NOTHING",
                [(r.version, r.document, json.dumps(_index(r)), now) for r in fresh],
            )
        return
    RenderedPolicy.objects.bulk_create(
        [
            RenderedPolicy(version=r.version, document=r.document, rule_index=_index(r), created_at=now)
            for r in fresh
        ],
        ignore_conflicts=True,
    )


def _existing_versions(versions: list[str]) -> set[str]:
    """The versions already stored. On PostgreSQL their rows stay key-share locked until this
    transaction ends, so fleet.retention cannot delete a document this change is about to name."""
    if connection.vendor != "postgresql":
        return set(RenderedPolicy.objects.filter(version__in=versions).values_list("version", flat=True))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT version FROM {RenderedPolicy._meta.db_table} WHERE version = ANY(%s) FOR KEY SHARE",  # noqa: S608
            [versions],
        )
        return {row[0] for row in cursor.fetchall()}


def _index(result) -> dict:
    return {str(number): entry for number, entry in result.rule_index.items()}


def _matching(fleet: FleetIndex, selectors: Iterable[Selector]) -> set[str]:
    positions: set[int] = set()
    for selector in selectors:
        positions |= fleet.positions_matching(selector)
    return {fleet.workload_ids[p] for p in positions}


def rerender_for_scopes(*, scopes: Iterable[str]) -> Rerendered:
    """After a policy write: the workloads in the scopes of the rulesets it touched."""
    fleet, inputs = fleet_load()
    affected = _matching(fleet, {parse_selector(s) for s in scopes}) | _judging_outbound(inputs)
    return workloads_rerender(workload_ids=affected, loaded=(fleet, inputs))


def rerender_for_peer_change(*, workload_id: str, labels_before: Mapping[str, str]) -> Rerendered:
    """After workload W's labels or addresses changed: W, and the workloads whose rules had or now
    have W among their sources."""
    policy = policy_inputs_load()
    row = Workload.objects.filter(id=workload_id).values_list(*_INPUT_FIELDS).get()
    workload = workload_input_of(*row)
    labels_after = workload.labels
    scopes = set()
    for ruleset in policy.rulesets:
        for rule in ruleset.rules:
            if any(
                s.kind == "selector"
                and (s.selector.matches(labels_before) or s.selector.matches(labels_after))
                for s in rule.sources
            ):
                scopes.add(ruleset.scope)
                break
    if (
        not scopes
        and workload.mode == Mode.VISIBILITY
        and workload.outbound_mode == Mode.VISIBILITY
        and not Workload.objects.exclude(outbound_mode=Mode.VISIBILITY).exists()
    ):
        # Nobody's peer, and a visibility document depends on no other workload: enrolling into a
        # large fleet must not load the whole fleet.
        alone = (FleetIndex.build([workload]), {workload.id: workload})
        return workloads_rerender(workload_ids=[workload.id], loaded=alone, policy=policy)
    fleet, inputs = fleet_load()
    affected = _matching(fleet, scopes) | {str(workload_id)} | _judging_outbound(inputs)
    return workloads_rerender(workload_ids=affected, loaded=(fleet, inputs), policy=policy)
