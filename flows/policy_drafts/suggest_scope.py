"""A suggested ruleset's scope kept inside the selection it was asked for (suggestions.py): the
values of `label_keys` alone may name workloads the operator did not select (`app=db` beside the
selected `app=db,env=prod`: the staging databases too). Reads the fleet index and host names."""

from __future__ import annotations

from fleet.models import Workload
from policy.grammar import MAX_REQUIREMENTS, Requirement, Selector, parse_selector
from policy.render_inputs import FleetIndex

HOSTS_NAMED = 5


class ScopeNarrowing:
    """Each base scope (the values of `label_keys`) narrowed to stay inside the selection: first with
    the selection's own label requirements, then with labels every workload of the scope's evidence
    shares, one key at a time while that leaves fewer workloads outside; refused (None and why) when
    workloads outside the selection remain."""

    def __init__(self, fleet: FleetIndex, selected_ids, selection_labels, workloads: dict) -> None:
        self.fleet, self.selected_ids, self.selection_labels = fleet, selected_ids, selection_labels
        self.workloads = {str(i): w for i, w in workloads.items()}  # id -> what has `labels`
        self.notes: list[dict] = []

    def _outside(self, selector: Selector) -> list[str]:
        selected = self.selected_ids
        if selected is None:
            return []
        ids = self.fleet.workload_ids
        return sorted(ids[p] for p in self.fleet.positions_matching(selector) if ids[p] not in selected)

    def _hosts(self, ids: list[str]) -> str:
        names = sorted(Workload.objects.filter(id__in=ids).values_list("hostname", flat=True))
        more = f" and {len(names) - HOSTS_NAMED} more" if len(names) > HOSTS_NAMED else ""
        return ", ".join(names[:HOSTS_NAMED]) + more

    def narrowed(self, base: str, workload_ids: set[str]) -> tuple[str | None, str | None]:
        requirements = list(parse_selector(base).requirements)
        outside = self._outside(Selector(tuple(requirements)))
        if not outside:
            return base, None
        wide = outside
        for selector in self.selection_labels:
            requirements.extend(selector.requirements)
        # A selector holds at most MAX_REQUIREMENTS requirements: past them, the selection's own are
        # not all kept, and the scope is refused below if it still reaches outside.
        candidate = Selector(tuple(dict.fromkeys(requirements))[:MAX_REQUIREMENTS])
        outside = self._outside(candidate)
        labels = [dict(self.workloads[i].labels) for i in workload_ids]
        shared = sorted(set.intersection(*(set(held.items()) for held in labels))) if labels else []
        for key, value in shared:
            if not outside or len(candidate.requirements) >= MAX_REQUIREMENTS:
                break
            tried = Selector((*candidate.requirements, Requirement(key, "=", (value,))))
            left = self._outside(tried)
            if len(left) < len(outside):
                candidate, outside = tried, left
        if outside:
            why = (
                f"the scope {base} would also protect {len(outside)} workload(s) outside the selection "
                f"({self._hosts(outside)}), and no label the selected workloads share tells them apart: "
                "not widened"
            )
            self.notes.append({"scope": base, "narrowed_to": None, "reason": why})
            return None, why
        text = str(candidate)
        self.notes.append(
            {
                "scope": base,
                "narrowed_to": text,
                "reason": f"{base} alone would also protect {len(wide)} workload(s) outside the selection "
                f"({self._hosts(wide)})",
            }
        )
        return text, None
