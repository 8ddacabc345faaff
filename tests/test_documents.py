"""Packed documents (Megatron's reset_attention_mask; Mamba's seq_idx): a sample holding several
documents computes, for every form of the interdomain / S4D core, exactly what each document
computes alone: outputs, final state and every gradient (float64, < 1e-10), with boundaries at
chunk edges, inside chunks, documents of one token, and a given initial state continuing into
the first document. Without document ids nothing changes, bit for bit."""
import os

import pytest
import torch
from conftest import relative_error
from test_interdomain_forms import core_inputs, form_options

from megatron_id.ops.interdomain import FORMS

# two rows, chunk 4: boundaries at chunk edges (4, 8), inside chunks, one-token documents
DOCUMENTS = [[4, 1, 6, 3, 1, 2], [9, 4, 1, 1, 2]]   # lengths per row; both rows 17 tokens
N = 17


def seq_idx_for(rows):
    return torch.tensor([[d for d, length in enumerate(row) for _ in range(length)] for row in rows])


def packed_and_alone(form, readout, with_state, seed=1, dtype=torch.float64):
    """The packed call runs in `dtype` (its inputs cast from the float64 leaves), the documents
    alone in float64 on the same leaves."""
    contraction = readout == "contraction"
    tensors, state = core_inputs(seed, torch.float64, B=2, N=N, H=2, R=3, Dv=4, M=5, delta="init",
                                 contraction=contraction, with_state=with_state)
    if state is not None:
        state.requires_grad_()
    mode = "hermitian" if contraction else readout
    params = [tensors[n] for n in ("log_dt", "a_log", "a_im", "c_re", "c_im")]
    kw = dict(readout=mode, c_vec=tensors.get("c_vec"))
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(2, N, 2, 4 if not contraction else 7, generator=g, dtype=torch.float64)
    w_state = torch.randn(2, 2, 5, 7, generator=g, dtype=torch.complex128)
    name, options = form_options(form, 4)
    low = lambda x: None if x is None else x.to(dtype if not x.is_complex() else state_dtype)
    state_dtype = torch.complex128 if dtype == torch.float64 else torch.complex64
    out, final = FORMS[name](low(q), low(k), low(v), *map(low, params), readout=mode, c_vec=low(kw["c_vec"]),
                             initial_state=low(state), output_final_state=True,
                             seq_idx=seq_idx_for(DOCUMENTS), **options)
    packed_loss = (out * weight).sum() + (final * w_state).real.sum()
    # each document alone, through the naive reference, on slices of the same leaves
    outs, alone_loss = torch.zeros_like(out), 0
    for b, row in enumerate(DOCUMENTS):
        lo = 0
        for d, length in enumerate(row):
            take = lambda x: None if x is None else x[b:b + 1, lo:lo + length]
            first_state = None if (state is None or d > 0) else state[b:b + 1]
            o, f = FORMS["naive"](take(q), take(k), take(v), *params, **kw, initial_state=first_state,
                                  output_final_state=True)
            outs[b:b + 1, lo:lo + length] = o.detach()
            alone_loss = alone_loss + (o * weight[b:b + 1, lo:lo + length]).sum()
            if d == len(row) - 1:
                alone_loss = alone_loss + (f * w_state[b:b + 1]).real.sum()
                final_alone = f
            lo += length
        assert relative_error(final[b:b + 1], final_alone) < (1e-10 if dtype == torch.float64 else 1e-4), \
            (form, "final state", b)
    leaves = [t for t in (q, k, v, *params, tensors.get("c_vec"), state) if t is not None]
    grads = torch.autograd.grad(packed_loss, leaves)
    grads_alone = torch.autograd.grad(alone_loss, leaves)
    return out, outs, grads, grads_alone


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "given_state"])
@pytest.mark.parametrize("readout", ["hermitian", "plain", "contraction"])
@pytest.mark.parametrize("form", ["naive", "recurrent", "chunked", "recompute"])
def test_packed_documents_equal_each_document_alone(form, readout, with_state):
    out, alone, grads, grads_alone = packed_and_alone(form, readout, with_state)
    assert relative_error(out, alone) < 1e-10, "outputs"
    for i, (g, ref) in enumerate(zip(grads, grads_alone)):
        assert relative_error(g, ref) < 1e-10, f"gradient {i}"


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "given_state"])
@pytest.mark.parametrize("readout", ["hermitian", "contraction"])
def test_packed_documents_in_the_triton_kernels(readout, with_state):
    """The kernels (under TRITON_INTERPRET=1, float32; chunk 4 in the call runs as 16, so the
    documents cross kernel chunks too) against the float64 documents alone: < 1e-4."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (tests/conftest.py sets it unless it is set otherwise)")
    out, alone, grads, grads_alone = packed_and_alone("triton", readout, with_state, dtype=torch.float32)
    assert relative_error(out, alone) < 1e-4, "outputs"
    for i, (g, ref) in enumerate(zip(grads, grads_alone)):
        assert relative_error(g, ref) < 1e-4, f"gradient {i}"


@pytest.mark.parametrize("form", ["chunked", "recompute", "recurrent", "naive"])
def test_one_document_changes_nothing_bit_for_bit(form):
    """All tokens in one document: the masks are exact ones, so the numbers are the very same
    bits as without document ids (and without them the code runs as before)."""
    tensors, _ = core_inputs(2, torch.float32, B=2, N=N, H=2, R=3, Dv=4, M=5, delta="init",
                             contraction=False, with_state=False)
    name, options = form_options(form, 4)
    args = [tensors[n] for n in ("q", "k", "v", "log_dt", "a_log", "a_im", "c_re", "c_im")]
    plain = FORMS[name](*args, output_final_state=True, **options)
    one = FORMS[name](*args, output_final_state=True, seq_idx=torch.zeros(2, N, dtype=torch.long), **options)
    assert torch.equal(plain[0], one[0]) and torch.equal(plain[1], one[1])


# ---------------------------------------------------------------- the whole model

EOD = 7


def packed_tokens():
    """Two rows of 17 tokens; every document ends with EOD (Megatron's --append-eod), the last
    one of each row is cut by the sample's end, as packing does."""
    g = torch.Generator().manual_seed(11)
    rows = []
    for lengths in DOCUMENTS:
        row = []
        for i, length in enumerate(lengths):
            body = torch.randint(8, 60, (length,), generator=g)
            if i < len(lengths) - 1:
                body[-1] = EOD
            row.append(body)
        rows.append(torch.cat(row))
    return torch.stack(rows)


def test_document_index_follows_megatron():
    """The EOD token ends its document; positions restart right after it."""
    from megatron_id.training.documents import document_index
    tokens = torch.tensor([[5, EOD, 6, 6, EOD, EOD, 9], [EOD, 1, 2, 3, 4, 5, 6]])
    seq_idx, positions = document_index(tokens, EOD)
    assert seq_idx.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    assert (packed_tokens() == EOD).sum() == sum(len(r) - 1 for r in DOCUMENTS)


@pytest.mark.parametrize("mixer,form", [("interdomain", "chunked"), ("interdomain", "recompute"),
                                        ("interdomain", "recurrent"), ("interdomain", "naive"),
                                        ("s4d", "chunked"), ("s4d", "recompute"), ("softmax", "chunked"),
                                        ("interdomain-nodual", "chunked")])
def test_language_model_on_packed_documents_equals_each_document_alone(tiny_config, monkeypatch, mixer, form):
    """float64: logits and every parameter gradient of a packed batch (seq_idx and position ids
    from its EOD tokens) equal those of each document run as its own sequence (< 1e-10). The
    recompute form runs its features and core in segments of 8 tokens (chunk 4), so documents
    cross segments and the convs' halo."""
    from megatron_id.model import LanguageModel
    from megatron_id.ops.interdomain import chunked
    from megatron_id.training.documents import document_index
    monkeypatch.setattr(chunked, "SEGMENT_CHUNKS", 2)
    extra = ["model.dual_kv_input=false"] if mixer == "interdomain-nodual" else []
    cfg = tiny_config(f"model.mixer={mixer.split('-')[0]}", "model.d_model=16", "model.n_heads=2", "model.n_layers=2",
                      "model.state_size=5", "model.chunk_size=4", "model.vocab_size=64",
                      f"model.core_impl={'recompute' if form == 'recompute' else 'autograd'}", *extra)
    model = LanguageModel(cfg, form="chunked" if form == "recompute" else form, seed=3).double()
    tokens = packed_tokens()
    seq_idx, positions = document_index(tokens, EOD)
    weight = torch.randn(*tokens.shape, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    packed = model(tokens, seq_idx=seq_idx, position_ids=positions)
    grads = torch.autograd.grad((packed * weight).sum(), list(model.parameters()))
    alone, loss = torch.zeros_like(packed), 0
    for b, lengths in enumerate(DOCUMENTS):
        lo = 0
        for length in lengths:
            logits = model(tokens[b:b + 1, lo:lo + length])
            alone[b, lo:lo + length] = logits[0].detach()
            loss = loss + (logits * weight[b:b + 1, lo:lo + length]).sum()
            lo += length
    grads_alone = torch.autograd.grad(loss, list(model.parameters()))
    assert relative_error(packed, alone) < 1e-10
    for (name, _), g, ref in zip(model.named_parameters(), grads, grads_alone):
        assert relative_error(g, ref) < 1e-10, name
