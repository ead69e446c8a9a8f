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
    # Nothing to fill in a document without an output chain, and nothing without endpoints.
    plain = _document("visibility")
    assert "chain output" not in plain and gateways.with_gateways(plain, [("10.9.0.1", 8443)]) == plain
    assert gateways.with_gateways(document, []) == document


def test_the_gateway_names_resolve_and_bad_ones_are_skipped():
    assert gateways.resolve(["127.0.0.1:8443", "[::1]:9443"]) == [("127.0.0.1", 8443), ("::1", 9443)]
    assert gateways.resolve(["no-such-host.invalid:1"]) == []
