"""The torch engine's KV cache: fixed-address buffers that a decode step can be captured and replayed over.

Owns one buffer of every layer's keys and values, `[layers, 2, slots, H, cap, D]`, the position of each row
(`[slots]`: how many of its tokens are cached, the column its next token goes to) and the decode mask. Each
row's sequence is left-aligned in its own slot; a decode step writes its new keys/values at the row's own
position (a scatter on the position buffer) and attends over the first C columns, masked to the columns up
to its position, so a step's shapes and addresses depend on (rows, C) only. `allocate` sizes it once (what
CUDA graphs need: their addresses never move); without it `cap` grows by doubling as rows need, a
reallocation that `reserve` reports. Decode attention passes the Hq / H query heads
of each key/value head as its queries: no copy of the cache per query head, which transformers' SDPA path
makes (`repeat_kv`) whenever there is a mask. Does not decide which rows are live or what is sampled.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from actors.engine import EngineError

ATTENTION = "april_slots"  # the name of the attention function registered with transformers


class SlotCache:
    """Every layer's keys and values for `slots` rows; see the module docstring."""

    def __init__(self, layers: int, slots: int, device: torch.device) -> None:
        self.slots = slots
        self.device = device
        self.kv: torch.Tensor | None = None  # [layers, 2, slots, H, cap, D], allocated at the first write
        self.cap = 0
        self.pos = torch.zeros(slots, dtype=torch.long, device=device)  # cached tokens per row
        self._cols = torch.zeros(0, dtype=torch.long, device=device)  # [cap]: 0, 1, ..., cap - 1
        self._mask = torch.zeros(slots, 0, dtype=torch.bool, device=device)  # room for a [rows, C] mask
        self._layers = [_SlotLayer(self, i) for i in range(layers)]
        self.cache = Cache(layers=list(self._layers))  # what the model's forward is given
        # the current forward's window: prefill rows [row0, row1), or decode rows [0, row1) over `width`
        self.decoding, self.row0, self.row1, self.width = False, 0, 0, 0
        self._index: torch.Tensor | None = None  # [rows, H, 1, D] view of `pos`: where decode writes
        self.fixed = False  # sized once by `allocate`: never reallocated

    def allocate(self, cap: int, heads: int, dim: int, dtype: torch.dtype) -> None:
        """Every buffer at its final size now: `cap` columns of `heads` x `dim` keys and values a row."""
        shape = (len(self._layers), 2, self.slots, heads, cap, dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self._size(cap)
        self.fixed = True

    def reserve(self, cols: int) -> bool:
        """Make room for `cols` columns (at least doubling); True if the buffers were reallocated."""
        if cols <= self.cap:
            return False
        if self.fixed:  # the engine clips every row to the columns it allocated: a bug if reached
            raise EngineError(f"torch engine: a step needs {cols} cache columns, the cache holds {self.cap}")
        cap = max(cols, 2 * self.cap, 64)
        if self.kv is not None:
            kv = self.kv.new_zeros((*self.kv.shape[:4], cap, self.kv.shape[5]))
            kv[..., : self.cap, :] = self.kv
            self.kv = kv
        self._size(cap)
        return True

    def _size(self, cap: int) -> None:
        """The column buffers for `cap` columns."""
        self.cap = cap
        self._cols = torch.arange(cap, device=self.device)
        self._mask = torch.zeros(self.slots, cap, dtype=torch.bool, device=self.device)

    def prefill(self, row0: int, row1: int) -> None:
        """The next forward writes rows [row0, row1) from column 0 and attends to its own keys only."""
        self.decoding, self.row0, self.row1 = False, row0, row1

    def decode(self, rows: int, width: int, masked: bool = True) -> torch.Tensor | None:
        """The next forward decodes rows [0, rows) over `width` columns; returns its attention mask
        `[rows, 1, 1, width]` (a row sees the columns up to its position), or None if not `masked` (every
        row is at the last column).

        Only fixed-address views and in-place ops: a CUDA graph captured around the forward replays it.
        """
        self.decoding, self.row1, self.width = True, rows, width
        kv = self.kv
        self._index = None if kv is None else self._decode_index(rows, kv.shape[3], kv.shape[5])
        if not masked:
            return None
        mask = self._mask.view(-1)[: rows * width].view(rows, width)
        torch.le(self._cols[:width], self.pos[:rows, None], out=mask)
        return mask[:, None, None, :]

    def write(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one layer's new keys/values `[rows, H, n, D]`; return what the layer attends over."""
        if self.kv is None:
            self._allocate(keys)
        assert self.kv is not None
        if keys.shape[1] != self.kv.shape[3] or keys.shape[3] != self.kv.shape[5]:
            raise EngineError(
                f"torch engine: layer {layer} has {keys.shape[1]} x {keys.shape[3]} keys per token, layer 0 "
                f"{self.kv.shape[3]} x {self.kv.shape[5]}; layers of different shapes are not supported"
            )
        k, v = self.kv[layer, 0], self.kv[layer, 1]
        if not self.decoding:
            n = keys.shape[2]
            k[self.row0 : self.row1, :, :n] = keys
            v[self.row0 : self.row1, :, :n] = values
            return keys, values
        rows = self.row1
        if self._index is None:  # the first write of all (every row's input was one token: no prefill)
            self._index = self._decode_index(rows, keys.shape[1], keys.shape[3])
        k[:rows].scatter_(2, self._index, keys)
        v[:rows].scatter_(2, self._index, values)
        return k[:rows, :, : self.width], v[:rows, :, : self.width]

    def move(self, src: int, dst: int, cols: int) -> None:
        """Copy row `src`'s first `cols` columns of every layer, and its position, to row `dst`."""
        if self.kv is not None and cols:
            self.kv[:, :, dst, :, :cols] = self.kv[:, :, src, :, :cols]
        self.pos[dst] = self.pos[src]

    def release(self) -> None:
        self.kv = None
        self.cap = 0
        self.fixed = False
        self._layers.clear()

    def _decode_index(self, rows: int, heads: int, dim: int) -> torch.Tensor:
        """`[rows, H, 1, D]`, each row's position: the scatter index of a decode write."""
        return self.pos[:rows].view(rows, 1, 1, 1).expand(rows, heads, 1, dim)

    def _allocate(self, keys: torch.Tensor) -> None:
        _, heads, _, dim = keys.shape
        shape = (len(self._layers), 2, self.slots, heads, self.cap, dim)
        self.kv = torch.zeros(shape, dtype=keys.dtype, device=self.device)


class _SlotLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # (transformers' __init_subclass__)
    """One layer of the model's `Cache`: its update writes into the shared `SlotCache` buffer."""

    def __init__(self, store: SlotCache, index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.store, self.index = store, index

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.write(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return 0


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: one query token `[B, Hq, 1, D]` attends with its Hq / H query
    heads packed as the queries of their key/value head; anything else is transformers' SDPA path."""
    if query.shape[2] != 1 or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        return out
    rows, q_heads, _, dim = query.shape
    packed = query.reshape(rows, key.shape[1], q_heads // key.shape[1], dim)  # [B, H, G, D]
    out_ = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, scale=scaling
    )  # the mask [B, 1, 1, C] is shared by every head and every packed query
    return out_.reshape(rows, 1, q_heads, value.shape[-1]), None


def use_slot_attention(model: Any) -> bool:
    """Register `slot_attention` with transformers and make `model` use it; False if the model cannot
    switch its attention implementation (it then keeps its own, which gives the same results)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, slot_attention)
    if not model._can_set_attn_implementation():
        return False
    model.set_attn_implementation(ATTENTION)
    return bool(model.config._attn_implementation == ATTENTION)
