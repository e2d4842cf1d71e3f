"""Bugs found in the reasoning split and /metrics (each test failed before its fix)."""

from __future__ import annotations

from kvcap.bench.serving import parse_metrics
from kvcap.server.async_engine import EngineStats
from kvcap.server.metrics import ServerInfo, ServerMetrics


def test_metrics_counters_past_a_million_are_exported_exactly():
    """`{value:g}` rounded every sample to 6 significant digits: 12345678 prompt tokens read
    1.23457e+07, and a counter that grew by a few tokens between scrapes stood still."""
    m = ServerMetrics(ServerInfo("tiny", "fp16", "not_required", "none"))
    for _ in range(3):
        m.count_http("/v1/completions", 200)
    stats = EngineStats(prompt_tokens=12_345_678, generation_tokens=1_000_001,
                        finished={"stop": 2_500_001}, steps=7_654_321)
    text = m.render(stats, 3)
    got = parse_metrics(text)
    assert got["kvcap_prompt_tokens_total"] == 12_345_678
    assert got["kvcap_generation_tokens_total"] == 1_000_001
    assert got['kvcap_requests_total{outcome="stop"}'] == 2_500_001
    assert got["kvcap_engine_steps_total"] == 7_654_321
    assert "kvcap_prompt_tokens_total 12345678\n" in text
    assert "e+" not in text
    later = parse_metrics(m.render(EngineStats(prompt_tokens=12_345_679), 0))
    assert later["kvcap_prompt_tokens_total"] > got["kvcap_prompt_tokens_total"]
