"""The 128x4 swizzled scale layout built independently of the spec's swizzle_128x4, for the tests of every
implementation that writes it."""

import torch


def swizzled_by_loop(scale: torch.Tensor) -> torch.Tensor:
    """Independent construction: every (r, c) written at the byte offset FlashInfer's quantizer writes it to
    (get_sf_out_offset_128x4, quantization_utils.cuh), one element at a time; the rest zero."""
    rows, cols = scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    out = torch.zeros(padded_rows * padded_cols, dtype=torch.uint8)
    raw = scale.view(torch.uint8)
    for r in range(rows):
        for c in range(cols):
            offset = ((r // 128) * (padded_cols // 4) * 512 + (c // 4) * 512 + (r % 32) * 16
                      + ((r % 128) // 32) * 4 + c % 4)
            out[offset] = raw[r, c]
    return out.view(padded_rows, padded_cols)
