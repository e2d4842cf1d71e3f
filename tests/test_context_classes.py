"""Decode graph context classes, shared by graph replays and eager CUDA decode (same split-K
choice, so enforce_eager and graph runs compute the same sums)."""

from __future__ import annotations

from kvcap.engine.cuda_graph import context_class, context_classes


def test_classes_and_lookup():
    assert context_classes(131072) == [2048, 4096, 16384, 131072]
    assert context_classes(2048) == [2048]
    assert context_classes(1000) == [1000]
    classes = context_classes(32768)
    assert [context_class(classes, n) for n in (1, 2048, 2049, 4097, 16384, 20000, 32768)] == \
        [2048, 2048, 4096, 16384, 16384, 32768, 32768]
    assert context_class(classes, 40000) == 40000  # beyond the last class: itself


def test_a_class_boundary_at_every_context_dependent_launch_rule(monkeypatch):
    """A decode step launches for its context class, so each context threshold of the launch
    rules is a class boundary: on an H200 (132 SMs), 64 sequences x 8 KV heads of 2-4K
    tokens get the one-split, three-stage wide launch they would get at their real length,
    not the 16K class's two five-stage splits."""
    import torch

    from kvcap.kernels import common, decode

    monkeypatch.setattr(decode, "device_properties", lambda device: common.target_properties(90))
    monkeypatch.setattr(decode, "has_mma", lambda device: True)
    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    classes = context_classes(131072)
    for n in (2100, 3000, 4096):
        real = decode.default_launch(64, 8, n, 128, True, cuda)
        assert decode.default_launch(64, 8, context_class(classes, n), 128, True, cuda) == real
        assert (real[1].num_stages, real[2]) == (3, 1)
    assert decode.default_launch(64, 8, 16384, 128, True, cuda)[1:] != real[1:]
