"""The agent's gateway sets: the names the renderer leaves empty, filled with the endpoints it uses."""

from agent import gateway_sets as gateways
from policy import renderer
from policy.render_inputs import FleetIndex, WorkloadInput


def _document(outbound_mode: str) -> str:
    workload = WorkloadInput("wl", {"role": "server"}, ("10.0.0.1",), "enforced", outbound_mode)
    return renderer.render(workload, [], {}, FleetIndex.build([workload])).document


def test_the_agent_fills_the_sets_the_renderer_leaves_empty():
    assert gateways.GATEWAY_SETS == renderer.GATEWAY_SETS
    document = _document("enforced")
    filled = gateways.with_gateways(
        document, [("10.9.0.1", 8443), ("::ffff:10.9.0.2", 8443), ("fd00::1", 443)]
    )
    assert "elements = { 10.9.0.1 . 8443, 10.9.0.2 . 8443 }" in filled
    assert "elements = { fd00::1 . 443 }" in filled
    assert filled.count("elements") == document.count("elements") + 2
    # Nothing to fill in a document without an output chain (the agent adds one: agent/outbound_observe.py),
    # and nothing without endpoints.
    plain = _document("visibility")
    assert "chain output" not in plain and gateways.with_gateways(plain, [("10.9.0.1", 8443)]) == plain
    assert gateways.with_gateways(document, []) == document


def test_the_gateway_names_resolve_and_bad_ones_are_skipped():
    assert gateways.resolve(["127.0.0.1:8443", "[::1]:9443"]) == [("127.0.0.1", 8443), ("::1", 9443)]
    assert gateways.resolve(["no-such-host.invalid:1"]) == []


def test_the_observe_only_output_chain_has_the_renderers_baseline_and_judges_nothing():
    """agent/outbound_observe.py: the chain the agent adds to a document without one (outbound visibility)
    has the rendered output chain's baseline word for word, the renderer's gateway sets, and one mark:
    observed, outbound (0x80), rule 0."""
    from agent import outbound_observe
    from agent.conntrack import decode_mark_flags

    added = outbound_observe.added_text()
    assert renderer._GATEWAY_SET_DEFINITIONS in added
    assert renderer._OUTPUT_HEAD + renderer._ESTABLISHED + renderer._OUTPUT_BASELINE in added
    mark = renderer.encode_mark(renderer.DECISION_OBSERVED, 0, renderer.DIRECTION_OUTBOUND_FLAG)
    assert outbound_observe.OBSERVED_OUTBOUND_MARK == mark
    assert decode_mark_flags(mark) == ("observed", None, "outbound", False)
    assert "drop" not in added and "log " not in added
    plain = _document("visibility")
    extended = outbound_observe.with_output_observed(plain)
    assert extended.startswith(plain.rstrip()[:-1]) and extended.endswith(added + "}\n")
    assert outbound_observe.with_output_observed(extended) == extended
    enforced = _document("enforced")
    assert outbound_observe.with_output_observed(enforced) == enforced
    # The gateway sets it adds are the ones the agent fills.
    assert "elements = { 10.9.0.1 . 8443 }" in gateways.with_gateways(extended, [("10.9.0.1", 8443)])
