"""Regressions found reviewing the commits after 625e9d5."""

from __future__ import annotations

import kvcap.bench.kernels as kb


def test_run_info_never_records_the_servers_api_key(monkeypatch):
    """e21aeb9 made run_info (kernels and qsa result JSON, which are committed under
    docs/benchmarks/ and printed by --summary) record every KVCAP_* environment variable as a
    "switch": KVCAP_API_KEY, the secret `kvcap serve` reads, went into the file verbatim."""
    class Props:
        name, multi_processor_count, L2_cache_size = "Test GPU", 4, 2**20

    monkeypatch.setattr(kb.torch.cuda, "get_device_properties", lambda dev: Props)
    monkeypatch.setattr(kb, "use_software_fp8", lambda dev: False)
    monkeypatch.setenv("KVCAP_API_KEY", "sk-very-secret")
    monkeypatch.setenv("KVCAP_HF_TOKEN", "hf-very-secret")  # any *KEY* / *TOKEN* name
    monkeypatch.setenv("KVCAP_FORCE_SOFTWARE_FP8", "1")
    info = kb.run_info()
    assert info["switches"].get("KVCAP_FORCE_SOFTWARE_FP8") == "1"  # switches still recorded
    assert "sk-very-secret" not in repr(info)
    assert "sk-very-secret" not in kb.source_caveats(info)
    assert "hf-very-secret" not in repr(info)
