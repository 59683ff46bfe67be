"""Fake aiter.ops.shuffle: shuffle_weight and shuffle_scale with the shipped signatures and aiter's
layouts (a pure view/permute each, as in aiter), and, for the fake kernels, their inverses computed
element by element from the layouts' index formulas (never by inverting the permutes above)."""
import torch


def shuffle_weight(x, layout=(16, 16), use_int4=False, is_guinterleave=False, gate_up=False, pad_k_to=0):
    if use_int4 or is_guinterleave or pad_k_to:
        raise NotImplementedError("fake: only the plain (16, 16) weight shuffle is modelled")
    x_type = x.dtype
    raw = x.view(torch.uint8) if x.element_size() == 1 else x
    rows_per_tile, half_k = layout
    k_tile = 2 * half_k  # BK
    pack = 16 // raw.element_size()  # elements per 16-byte lane load
    if raw.shape[-2] % rows_per_tile or raw.shape[-1] % k_tile:
        raise AssertionError(f"{raw.shape[-2]} % {rows_per_tile} or {raw.shape[-1]} % {k_tile}")
    tiles = raw.reshape(-1, raw.shape[-2] // rows_per_tile, rows_per_tile, raw.shape[-1] // k_tile,
                        k_tile // pack, pack)
    out = tiles.permute(0, 1, 3, 4, 2, 5).contiguous().view(*raw.shape).view(x_type)
    out.is_shuffled = True
    return out


def unshuffle_weight(w):
    """The row-major ``[..., N, K]`` of a (16, 16)-shuffled weight, from the index formula: element
    (n, k) sits at ((n // 16 * K/32 + k // 32) * 32/p + k % 32 // p) * 16p + n % 16 * p + k % p of its
    matrix, p = 16 bytes / element size."""
    raw = w.view(torch.uint8) if w.element_size() == 1 else w
    rows, cols = raw.shape[-2], raw.shape[-1]
    pack = 16 // raw.element_size()
    n = torch.arange(rows)[:, None]
    k = torch.arange(cols)[None, :]
    where = (((n // 16) * (cols // 32) + k // 32) * (32 // pack) + (k % 32) // pack) * (16 * pack) \
        + (n % 16) * pack + k % pack
    flat = raw.reshape(-1, rows * cols)
    return flat[:, where.flatten()].reshape(raw.shape).view(w.dtype)


def shuffle_scale(src, experts_cnt=None, is_guinterleave=False, gate_up=False):
    if src is None or src.dtype == torch.float32:
        return src
    if is_guinterleave or src.dim() != 2:
        raise NotImplementedError("fake: only the plain 2-D e8m0 scale shuffle is modelled")
    rows, cols = src.shape
    padded = torch.zeros(-(-rows // 256) * 256, -(-cols // 8) * 8, dtype=torch.uint8)  # aiter: torch.empty
    padded[:rows, :cols] = src.view(torch.uint8)
    prows, pcols = padded.shape
    tiles = padded.view(prows // 32, 2, 16, pcols // 8, 2, 4).permute(0, 3, 5, 2, 4, 1).contiguous()
    return tiles.view(prows, pcols).view(src.dtype)


def unshuffle_scale(shuffled, rows, cols):
    """``[rows, cols]`` of a shuffled e8m0 scale, from dynamic_mxfp4_quant's shuffled store offsets:
    (r, c) at r % 32 // 16 + 2 (c % 8 // 4) + 4 (r % 16) + 64 (c % 4) + 256 (c // 8) + 32 pcols (r // 32)."""
    raw = shuffled.view(torch.uint8)
    pcols = raw.shape[1]
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    where = (r % 32) // 16 + 2 * ((c % 8) // 4) + 4 * (r % 16) + 64 * (c % 4) + 256 * (c // 8) + 32 * pcols * (r // 32)
    return raw.flatten()[where.flatten()].view(rows, cols)
