"""Decode graph context classes, shared by graph replays and eager CUDA decode (same split-K
choice, so enforce_eager and graph runs compute the same sums)."""

from __future__ import annotations

from kvcap.engine.cuda_graph import context_class, context_classes


def test_classes_and_lookup():
    assert context_classes(131072) == [2048, 16384, 131072]
    assert context_classes(2048) == [2048]
    assert context_classes(1000) == [1000]
    classes = context_classes(32768)
    assert [context_class(classes, n) for n in (1, 2048, 2049, 16384, 20000, 32768)] == \
        [2048, 2048, 16384, 16384, 32768, 32768]
    assert context_class(classes, 40000) == 40000  # beyond the last class: itself

