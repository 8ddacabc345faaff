"""Packed documents in a training sample, with Megatron-LM's three switches and meanings:

    data.reset_attention_mask   no token reads another document: the interdomain / S4D state
                                and the short convs restart at every document, softmax attention
                                is block-diagonal causal (Megatron: --reset-attention-mask)
    data.reset_position_ids     RoPE positions restart at 0 in every document (--reset-position-ids)
    data.eod_mask_loss          no loss where the input token is the end-of-document token, i.e.
                                for predicting the first token of the next document (--eod-mask-loss)

All three are off by default, as in Megatron. Documents are found as Megatron finds them
(get_ltor_masks_and_position_ids): a document ends with its EOD token, and the next one starts
right after it. The EOD id is the data's own (the `.meta.json` sidecar preprocessing writes) or
data.eod_token_id. The model receives `seq_idx` [B, N] (a document index per token, Mamba's
name) and `position_ids` [B, N]; the loss a 0/1 mask (training/loss.py applies it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.gpt_dataset import DataConfigError, parse_data_path
from ..data.indexed_dataset import IndexedDataset, read_meta


@dataclass(frozen=True)
class DocumentOptions:
    reset_attention_mask: bool = False
    reset_position_ids: bool = False
    eod_mask_loss: bool = False
    eod_id: int | None = None

    @property
    def active(self) -> bool:
        return self.reset_attention_mask or self.reset_position_ids or self.eod_mask_loss

    @classmethod
    def from_config(cls, data) -> "DocumentOptions":
        """The data config's switches, with the EOD id resolved when any is on (an error naming
        the prefix and the fix when it cannot be)."""
        switches = dict(reset_attention_mask=bool(data.reset_attention_mask),
                        reset_position_ids=bool(data.reset_position_ids), eod_mask_loss=bool(data.eod_mask_loss))
        if not any(switches.values()):
            return cls()
        return cls(**switches, eod_id=resolve_eod_id(data))

    def model_inputs(self, tokens: torch.Tensor) -> dict:
        """The model's keyword arguments for input tokens [B, N] (empty when nothing is on)."""
        if not (self.reset_attention_mask or self.reset_position_ids):
            return {}
        seq_idx, position_ids = document_index(tokens, self.eod_id)
        return {**({"seq_idx": seq_idx} if self.reset_attention_mask else {}),
                **({"position_ids": position_ids} if self.reset_position_ids else {})}

    def loss_mask(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """[B, N] float, 0 where the input token is EOD (None when eod_mask_loss is off)."""
        return (tokens != self.eod_id).float() if self.eod_mask_loss else None


def document_index(tokens: torch.Tensor, eod_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_idx, position_ids), both [B, N] int64: the document each token belongs to (counting
    the EOD tokens before it) and its position inside that document."""
    eod = tokens == eod_id
    seq_idx = torch.cumsum(eod, dim=-1) - eod.long()                  # EODs strictly before t
    positions = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    after_eod = torch.zeros_like(eod)
    after_eod[:, 1:] = eod[:, :-1]
    first = torch.cummax(torch.where(after_eod, positions, 0), dim=-1).values   # the document's first token
    return seq_idx, positions - first


PACKED_SWITCHES = "data.reset_attention_mask / reset_position_ids / eod_mask_loss need"


def resolve_eod_id(data, needed_by: str = PACKED_SWITCHES) -> int:
    """data.eod_token_id, else the EOD id every prefix's sidecar records (they must agree);
    `needed_by` names what asks for it in the error. A given id must be the data's: the one its
    sidecar records, or (without one) the last token of its documents."""
    if data.eod_token_id is not None and not data.data_path:
        return int(data.eod_token_id)   # no files to hold it against (data.source=mqar)
    found = {}
    for _, prefix in parse_data_path(data.data_path):
        meta = read_meta(prefix) or {}
        found[prefix] = meta.get("eod_id")
    if data.eod_token_id is not None:
        return _checked_eod_id(int(data.eod_token_id), found, needed_by)
    ids = set(found.values())
    if None in ids or not ids:
        unknown = [p for p, i in found.items() if i is None] or list(data.data_path)
        raise DataConfigError(
            f"{needed_by} the end-of-document token id, and {unknown[0]}.meta.json does not record one (the "
            f"data was written without --append-eod, or by another tool): preprocess with --append-eod, or, where "
            f"its documents do end with an end-of-document token, set data.eod_token_id=<id> (50256 for GPT-2's "
            f"<|endoftext|>).")
    if len(ids) > 1:
        raise DataConfigError(f"the data prefixes record different end-of-document ids "
                              f"({', '.join(f'{p}: {i}' for p, i in found.items())}): set data.eod_token_id "
                              f"to the one to use, or blend data written with one tokenizer.")
    return ids.pop()


DOCUMENTS_LOOKED_AT = 64   # a given EOD id must end one of a prefix's first documents (no sidecar id)


def _checked_eod_id(given: int, recorded: dict, needed_by: str) -> int:
    """data.eod_token_id against the data: another id than a sidecar's would find no document
    where the data has one, and an id that ends none of the documents (data without EOD tokens,
    an id outside the vocabulary) would read each row as one document; either is refused."""
    for prefix, eod in recorded.items():
        if eod is not None and eod != given:
            raise DataConfigError(
                f"data.eod_token_id={given}, but {prefix}.meta.json records the end-of-document id {eod} (the token "
                f"preprocessing put after every document): {needed_by} it, and with {given} no document end would be "
                f"found where the data has one. Remove data.eod_token_id (the sidecar's id is used) or set "
                f"data.eod_token_id={eod}.")
    for prefix, eod in recorded.items():
        if eod is not None:
            continue
        ds = IndexedDataset(prefix)
        ends = ds.document_index[1:DOCUMENTS_LOOKED_AT + 1] - 1   # each document's last sequence
        last = [int(ds.get(int(i), int(ds.lengths[i]) - 1, 1)[0]) for i in ends if ds.lengths[i] > 0]
        if last and given not in last:
            raise DataConfigError(
                f"data.eod_token_id={given} ends none of the first {len(last)} documents of {prefix} (they end with "
                f"{', '.join(map(str, sorted(set(last))[:5]))}{', ...' if len(set(last)) > 5 else ''}): {needed_by} "
                f"the token that ends each document, and without one every row would be read as one document. "
                f"Preprocess the data with --append-eod, or set data.eod_token_id to the id that ends its documents.")
    return given
