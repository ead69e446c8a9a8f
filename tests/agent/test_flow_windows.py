"""Flow windows and their buffer: the spec's counter semantics and every loss as a gap, exactly."""

import json
import math

import pytest

from agent.flowbuffer import BUFFER_FILE, FlowBuffer, window_from_record, window_record
from agent.flowwindow import AGGREGATE, FlowKey, Windows, window_start

WEB = FlowKey("10.0.0.7", "tcp", 443, "allowed", 17)
SSH = FlowKey("10.0.0.8", "tcp", 22, "would_block", None)


def windows(**kwargs) -> Windows:
    return Windows(**{"length": 60.0, "max_keys": 100, "accounting": True, **kwargs})


def groups(window) -> dict:
    return {key: counters for key, counters in window.groups}


def test_windows_are_aligned_to_the_wall_clock():
    assert window_start(119.9, 60) == 60 and window_start(120.0, 60) == 120
    w = windows()
    w.connection_opened(WEB, 125.0)
    closed, gaps = w.close_due(180.0, "v1")
    assert [(c.start, c.end) for c in closed] == [(120.0, 180.0)] and gaps == []


def test_connections_are_counted_per_key_with_first_and_last_seen():
    w = windows()
    for at in (61.0, 75.5, 90.0):
        w.connection_opened(WEB, at)
    w.connection_opened(SSH, 70.0)
    (closed,), _ = w.close_due(120.0, "v7")
    assert closed.policy_version == "v7" and closed.accounting is True
    web, ssh = groups(closed)[WEB], groups(closed)[SSH]
    assert (web.connection_count, web.first_seen, web.last_seen) == (3, 61.0, 90.0)
    assert (ssh.connection_count, ssh.first_seen, ssh.last_seen) == (1, 70.0, 70.0)


def test_bytes_arrive_when_a_connection_ends_and_count_in_that_window_without_counting_it_again():
    w = windows()
    w.connection_opened(WEB, 10.0)
    w.bytes_counted(WEB, 75.0, bytes_in=1500, bytes_out=40_000)  # DESTROY a window later
    (first, second), _ = w.close_due(120.0, "v1")
    assert groups(first)[WEB].connection_count == 1 and groups(first)[WEB].bytes_in == 0
    late = groups(second)[WEB]
    assert (late.connection_count, late.bytes_in, late.bytes_out) == (0, 1500, 40_000)


def test_without_accounting_bytes_are_zero_and_the_window_says_so():
    w = windows(accounting=False)
    w.connection_opened(WEB, 10.0)
    w.bytes_counted(WEB, 20.0, bytes_in=99, bytes_out=99)
    (closed,), _ = w.close_due(60.0, "v1")
    assert closed.accounting is False
    assert (groups(closed)[WEB].bytes_in, groups(closed)[WEB].bytes_out) == (0, 0)


def test_a_window_that_saw_nothing_is_not_reported_and_ids_are_stable():
    w = windows()
    w.connection_opened(WEB, 10.0)
    closed, _ = w.close_due(600.0, "v1")
    assert len(closed) == 1  # the nine quiet windows after it produce nothing
    record = window_record(closed[0])
    assert window_from_record(json.loads(json.dumps(record))) == closed[0]


def test_a_late_event_for_a_closed_window_is_counted_once_in_the_next_open_one():
    w = windows()
    w.connection_opened(WEB, 10.0)
    w.close_due(60.0, "v1")
    w.connection_opened(WEB, 59.0)  # a source's event delivered after the window closed
    (closed,), _ = w.close_due(120.0, "v1")
    assert closed.start == 60.0 and groups(closed)[WEB].connection_count == 1


def test_each_direction_has_its_own_bound_so_outgoing_keys_never_push_incoming_ones_into_the_aggregate():
    w = windows(max_keys=2, accounting=False)
    outgoing = [FlowKey(f"198.51.100.{i}", "tcp", 443, "observed", None, "outbound") for i in range(5)]
    for at, key in enumerate(outgoing, start=1):
        w.connection_opened(key, float(at))
    w.connection_opened(WEB, 10.0)
    w.connection_opened(SSH, 11.0)
    (closed,), (gap,) = w.close_due(60.0, "v1")
    summed_out = FlowKey(AGGREGATE, AGGREGATE, 0, "observed", None, "outbound")
    assert set(groups(closed)) == {WEB, SSH, *outgoing[:2], summed_out}
    assert groups(closed)[summed_out].connection_count == 3
    assert gap.lost == {"keys": 3, "connections": 3}


def test_keys_over_the_bound_are_summed_into_the_aggregate_key_of_their_decision_and_said_so():
    w = windows(max_keys=2, accounting=True)
    w.connection_opened(WEB, 1.0)
    w.connection_opened(SSH, 2.0)
    extra = [FlowKey(f"10.9.0.{i}", "udp", 53, "observed", None) for i in range(3)]
    blocked = FlowKey("192.0.2.7", "tcp", 23, "blocked", None)
    w.connection_opened(extra[0], 30.0)
    w.connection_opened(extra[1], 31.0)
    w.connection_opened(extra[1], 32.0)
    w.connection_opened(blocked, 33.0)
    w.bytes_counted(extra[2], 35.0, 10, 20)  # bytes of a key not counted one by one: summed too
    w.connection_opened(WEB, 40.0)  # a known key is still counted as itself
    (closed,), (gap,) = w.close_due(60.0, "v1")
    observed, refused = (FlowKey(AGGREGATE, AGGREGATE, 0, d, None) for d in ("observed", "blocked"))
    assert set(groups(closed)) == {WEB, SSH, observed, refused} and groups(closed)[WEB].connection_count == 2
    summed = groups(closed)[observed]
    assert (summed.connection_count, summed.bytes_in, summed.bytes_out) == (3, 10, 20)
    assert (summed.first_seen, summed.last_seen) == (30.0, 35.0)
    assert groups(closed)[refused].connection_count == 1
    assert (gap.kind, gap.source, gap.start, gap.end) == ("keys_aggregated", None, 30.0, 60.0)
    assert gap.lost == {"keys": 4, "connections": 4}


def test_shutdown_closes_the_open_window():
    w = windows()
    w.connection_opened(WEB, 10.0)
    (closed,), _ = w.close_due(math.inf, "v1")
    assert (closed.start, closed.end) == (0.0, 60.0) and w.open == {}


def _closed(starts, w=None):
    w = w or windows()
    for start in starts:
        w.connection_opened(WEB, start + 1)
    return w.close_due(math.inf, "v1")[0]


def test_the_buffer_keeps_windows_across_a_restart_until_acknowledged(tmp_path):
    buffer = FlowBuffer(tmp_path, max_records=10)
    buffer.add(_closed([0, 60, 120]), [])
    again = FlowBuffer(tmp_path, max_records=10)  # the agent restarted
    pending, _ = again.pending()
    assert [w["start"] for w in pending] == [0, 60, 120]
    again.acknowledge({pending[0]["id"], pending[2]["id"]})
    assert [w["start"] for w in FlowBuffer(tmp_path, max_records=10).pending()[0]] == [60]
    assert [p.name for p in tmp_path.iterdir()] == [BUFFER_FILE]  # written whole, by rename


def test_overflow_drops_the_oldest_and_gaps_cover_exactly_their_range(tmp_path):
    buffer = FlowBuffer(tmp_path, max_records=2)
    buffer.add(_closed([0, 60, 180, 240, 300]), [])  # 120-180 was quiet: no window
    pending, gaps = buffer.pending()
    assert [w["start"] for w in pending] == [240, 300]
    assert [(g["kind"], g["start"], g["end"], g["lost"]) for g in gaps] == [
        ("buffer_overflow", 0, 120, {"windows": 2}),
        ("buffer_overflow", 180, 240, {"windows": 1}),
    ]
    buffer.acknowledge({g["id"] for g in gaps})
    assert buffer.pending()[1] == []


def test_bounds_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        Windows(length=0, max_keys=1, accounting=False)
    with pytest.raises(ValueError):
        FlowBuffer(tmp_path, max_records=0)


def test_reports_are_cut_to_a_byte_budget_but_always_carry_one_window():
    from agent import flowreporter

    small = {"groups": [{}] * 10}
    huge = {"groups": [{}] * 100_000}
    assert flowreporter._batch([huge, small]) == [huge]
    assert flowreporter._batch([small] * 3) == [small] * 3
    assert len(flowreporter._batch([huge] * 3)) == 1


def test_reports_carry_at_most_so_many_keys_but_always_one_window():
    from agent import flowreporter

    keys = flowreporter.BATCH_MAX_KEYS
    half = {"groups": [{}] * (keys // 2)}
    assert flowreporter._batch([half, half, {"groups": [{}]}]) == [half, half]
    more = {"groups": [{}] * (keys + 4)}  # a full window and its aggregate keys: still sent, alone
    assert flowreporter._batch([more, half]) == [more]


@pytest.mark.parametrize(
    "answer",
    [
        b"[]",
        b'"ok"',
        b'{"windows": 3}',
        b'{"windows": {"id": "x"}}',
        b'{"gaps": [[1]]}',
        b'{"windows": [{"id": 7}]}',
    ],
)
def test_an_answer_the_gateway_never_sends_is_an_error_the_loop_retries_on(answer):
    from agent import flowreporter

    with pytest.raises(ValueError):  # what the report loop catches: the report is sent again
        flowreporter._answered_items(answer)


def test_the_gateways_answers_are_read_per_window_and_gap():
    from agent import flowreporter

    answer = {
        "windows": [{"id": "w", "result": "accepted", "reason": None}],
        "gaps": [{"id": None, "result": "refused"}],
    }
    assert flowreporter._answered_items(json.dumps(answer).encode()) == answer["windows"] + answer["gaps"]


def test_a_report_the_gateway_is_busy_for_waits_its_retry_after_spread_over_as_long_again():
    from agent.backoff import retry_delay
    from agent.protocol import retry_after

    assert all(0 <= retry_delay(0, None) <= 1 for _ in range(100))
    assert all(4 <= retry_delay(0, 4) <= 8 for _ in range(100))
    assert all(retry_delay(9, 1) <= 60 for _ in range(100))  # the backoff, once it is the longer wait
    assert [retry_after(503, v) for v in ("1", "2.5", None, "", "soon", "-1", "86400")] == [
        1,
        None,
        None,
        None,
        None,
        None,
        600,
    ]
