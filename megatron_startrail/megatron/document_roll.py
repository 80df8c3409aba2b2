"""Megatron's MTP roll (``roll_tensor``, one token left inside every document) for packed
documents in the document layout under context parallelism, without a loop over documents.

In the document layout (Transformer Engine's THD CP layout, and the layout Megatron-Bridge
cuts every packed batch in) each document's span of ``cu_seqlens_padded`` is zigzagged on its
own: CP rank r holds chunks r and 2*CP-1-r of every span, span after span. Megatron's packed
roll (``_roll_tensor_packed_seq``) walks the documents in Python with two sends and two
receives each, and places them by the REAL boundaries divided by CP: right only where no
document has padding.

Here the whole local tensor is rolled at once; the last row of every chunk then takes the
first row of the next chunk of its span, which another rank holds:

- after the front chunk r: the front chunk of rank r+1 (at r = CP-1 the next chunk is this
  rank's own back chunk, which the local roll already put there);
- after the back chunk 2*CP-1-r: the back chunk of rank r-1 (at r = 0 the span's end).

Every rank's first rows of both chunks of every document (``[..., 2 * n_docs]``) are
all-gathered over the CP group: one small collective per roll. Then the last real token of
every document, and its padding, is zeroed, as CP = 1 zeroes each document's last token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .packed_rope import document_layout_rows


def document_layout_roll(tensor: torch.Tensor, cp_group, cu_seqlens: torch.Tensor,
                         cu_seqlens_padded: torch.Tensor) -> torch.Tensor:
    """``tensor`` ``[..., t / CP]`` (this rank's rows of the padded sample, in the document
    layout) rolled one token left inside every document, along its last dimension.
    ``cu_seqlens`` / ``cu_seqlens_padded``: ``[n_docs + 1]``, the real and padded global
    boundaries. Device ops and one all-gather over ``cp_group``: no host sync."""
    cp, rank, local = cp_group.size(), cp_group.rank(), tensor.shape[-1]
    padded = cu_seqlens_padded.to(device=tensor.device, dtype=torch.int64)
    n_docs = padded.numel() - 1
    front = padded[:-1] // cp  # [n_docs]: the row of each document's front chunk's first token here
    chunk = (padded[1:] - padded[:-1]) // (2 * cp)  # [n_docs]: rows per chunk (0: an empty span)
    back = front + chunk  # [n_docs]: the back chunk's first row
    firsts = tensor[..., torch.cat([front, back]).clamp(max=local - 1)].contiguous()  # [..., 2 * n_docs]
    gathered = torch.empty(cp * firsts.numel(), dtype=firsts.dtype, device=firsts.device)
    dist.all_gather_into_tensor(gathered, firsts.view(-1), group=cp_group)
    gathered = gathered.view(cp, *firsts.shape)  # [CP, ..., 2 * n_docs]

    # One spare row past the end takes the writes of empty spans (whose chunk has no last row).
    rolled = torch.roll(torch.cat([tensor, tensor[..., :1]], dim=-1), -1, dims=-1)
    last = tensor.dim() - 1
    if rank < cp - 1:
        rolled.index_copy_(last, torch.where(chunk > 0, back - 1, local), gathered[rank + 1][..., :n_docs])
    # At rank 0 the back chunk ends its span: any value, zeroed below.
    rolled.index_copy_(last, torch.where(chunk > 0, back + chunk - 1, local), gathered[(rank - 1) % cp][..., n_docs:])
    rolled = rolled[..., :local]

    document, position = document_layout_rows(padded, cp, rank, local)
    real = cu_seqlens.to(device=tensor.device, dtype=torch.int64)
    length = (real[1:] - real[:-1])[document]  # [t / CP]: the real length of each row's document
    return rolled.masked_fill(position >= length - 1, 0)
