"""The real bundled model: compiled Full generation equals eager generation token for token."""

import pytest
import torch

from kvpass import Full, kvpass
from kvpass.models import chat_prompt


@pytest.mark.slow
def test_full_equals_eager_on_smollm2(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    inputs = tok(chat_prompt(tok, "Name three colours of the rainbow."), return_tensors="pt")
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False)
    ref = model.generate(**inputs, **kw)
    be = kvpass(Full(), strict=True)
    fwd = model.forward
    model.forward = torch.compile(fwd, backend=be)
    try:
        out = model.generate(**inputs, **kw)
    finally:
        model.forward = fwd
    assert torch.equal(out, ref), (tok.decode(out[0]), tok.decode(ref[0]))
    rows = be.report_rows()
    assert [r["layer"] for r in rows] == list(range(30))
    assert all(r["prefill_calls"] == 1 and r["decode_calls"] == 9 for r in rows)
