"""QSA: query-aware sparse attention over the (E4M3 or float) KV cache, SYSTEM.md §6."""

from kvcap.qsa.config import ENV_DISABLE_QSA, QSAConfig, qsa_disabled

__all__ = ["ENV_DISABLE_QSA", "QSAConfig", "qsa_disabled"]
