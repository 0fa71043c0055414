"""model.attention_mask: document: a packed sequence attends within each document only, which is
running each document alone (rotary positions are relative, so its offset does not matter)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from scale_llm.config import ModelConfig
from scale_llm.errors import UserError
from scale_llm.model import build_model
from scale_llm.model.transformer import document_mask
from scale_llm.train.preflight import check_document_end
from tests.helpers import make_config

END = 2


def tiny(attention: str, mask: str) -> torch.nn.Module:
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=32)
    cfg = dataclasses.replace(cfg, attention=attention, attention_mask=mask)
    model = build_model(cfg)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_sequence_under_the_document_mask_is_its_documents_run_alone(attention):
    docs = [
        torch.tensor([5, 9, 11, END]),
        torch.tensor([7, 3, 3, 8, 21, END]),
        torch.tensor([4, 6]),
    ]
    packed = torch.cat(docs)[None]  # (1, 12)
    model = tiny(attention, "document")
    with torch.no_grad():
        together = model(packed)[0]
        alone = torch.cat([model(d[None])[0] for d in docs])
        causal = tiny(attention, "causal")(packed)[0]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert torch.equal(together[:4], causal[:4])  # the first document sees nothing else anyway
    assert not torch.allclose(together[4:], causal[4:], atol=1e-3)  # the others do, causally


def test_the_mask_splits_after_each_end_token_and_the_run_checks_the_id(tmp_path):
    mask = document_mask(torch.tensor([[1, END, 1, 1, END, END]]), END)[0, 0]
    assert mask[1].tolist() == [True, True, False, False, False, False]  # the end is its doc's
    assert mask[3].tolist() == [False, False, True, True, False, False]
    assert mask[5].tolist() == [False] * 5 + [True]  # an empty document: itself alone
    cfg = make_config(tmp_path, tmp_path, "model.attention_mask=document")
    check_document_end(cfg, {"tokenizer": {"eos_id": END}})
    with pytest.raises(UserError, match="set model.document_end_id=0"):
        check_document_end(cfg, {"tokenizer": {"eos_id": 0}})
