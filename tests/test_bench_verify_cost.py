"""The verify-cost benchmark's cell on the CPU (the timing means nothing here; the bookkeeping
does): every arm runs, its drafts are the stand-in's, and the cell leaves the engine empty."""

import pytest
import torch
from scheduler_fakes import req

from kvcap.bench import verify_cost
from kvcap.engine.scheduler import ScheduledChunk


def test_stand_in_proposer_offers_k_copies():
    p = verify_cost.AlwaysDraft(3)
    r = req("a", [4, 5, 6])
    assert p.propose(r, 8) == [6, 6, 6] and p.propose(r, 2) == [6, 6]
    r.output_token_ids.append(9)
    assert p.propose(r, 8) == [9, 9, 9]


def test_reread_values_match_the_runner_rule(monkeypatch):
    """The bench's re-read figure is the quantity ModelRunner._draft_rows bounds."""
    from kvcap.engine import model_runner

    class Graphs:
        def can_run(self, num_seqs, max_seq_len):
            return num_seqs <= 64

    runner = model_runner.ModelRunner(
        None, None, type("P", (), {"spec": type("S", (), {"block_size": 16,
                                                          "values_per_token": 1000})})(),
        torch.device("cpu"))
    runner.graphs = Graphs()
    monkeypatch.delenv("KVCAP_SPEC_VERIFY", raising=False)
    runner.verify_route = "auto"
    k, context = 4, 500
    ch = ScheduledChunk(req("a", [1] * context), context, 1 + k, True)
    ch.draft = [1] * k
    extra = verify_cost.rows_reread_tokens(3, context, k) * 1000
    monkeypatch.setattr(model_runner, "SPEC_ROWS_MAX_EXTRA_KV_VALUES", extra)
    assert runner._draft_rows([ch] * 3)
    monkeypatch.setattr(model_runner, "SPEC_ROWS_MAX_EXTRA_KV_VALUES", extra - 1)
    assert not runner._draft_rows([ch] * 3)


def test_cell_runs_every_arm_and_leaves_nothing(default_model_dir):
    from kvcap import LLM

    # a step budget of 48 tokens: the two 40-token prompts take two prefill steps, the second
    # with the first request already in decode (no drafts may come before the arms start)
    llm = LLM(model=str(default_model_dir), device="cpu", max_model_len=256, num_blocks=32,
              max_num_seqs=2, num_speculative_tokens=2, max_num_batched_tokens=48)
    drafted = llm.engine.num_draft_tokens
    cell = verify_cost.run_cell(llm, batch=2, context=40, k=2, warmup=1, steps=2)
    assert set(cell["ms_per_step"]) == set(verify_cost.ARMS)
    assert all(ms > 0 for ms in cell["ms_per_step"].values())
    assert cell["rows_reread_gib"] > 0
    spec = llm.pool.spec  # float32 on the CPU: 4 bytes a value
    assert cell["rows_reread_gib"] == pytest.approx(
        cell["rows_reread_gi_values"] * spec.bytes_per_token / spec.values_per_token, abs=2e-3)
    # rows and chunk arms: (1 + 2) steps each, 2 requests, 2 drafts a step
    assert llm.engine.num_draft_tokens - drafted == 2 * 3 * 2 * 2
    assert not llm.engine.has_unfinished() and llm.block_manager.num_used_blocks == 0
