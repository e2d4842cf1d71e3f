"""The mixed-steps benchmark's cell on the CPU (the timing means nothing here; the bookkeeping
does): every timed step admits one new prompt beside the decoding requests, each timed forward
is recorded with its rows and route, and the cell leaves the engine empty."""

import pytest

from kvcap.bench import mixed_steps


@pytest.mark.parametrize("decoders", [0, 2])
def test_cell_admits_a_prompt_every_step_and_leaves_nothing(default_model_dir, decoders):
    from kvcap import LLM

    llm = LLM(model=str(default_model_dir), device="cpu", max_model_len=256, num_blocks=32,
              max_num_seqs=3, max_num_batched_tokens=64)
    llm.engine.overlap = False  # one forward per step: the route list lines up with the steps
    ms, kinds = mixed_steps.run_cell(llm, decoders, context=24, prompt=8, warmup=1, steps=3)
    assert ms > 0 and kinds == [(decoders + 8, "eager")] * 3  # the CPU has no graphs
    assert "_forward" not in vars(llm.runner)  # the recording wrapper is gone
    assert not llm.engine.has_unfinished() and llm.block_manager.num_used_blocks == 0


def test_refuses_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit):
        mixed_steps.main(["--steps", "1"])
    assert "CUDA" in capsys.readouterr().err
