"""A KV cache in fixed-size pages, shared by every sequence of a generation engine.

The pool holds `pages` pages of `page_size` token slots per layer. A sequence owns a row of the page
table: entry j is the page holding its positions [j * page_size, (j + 1) * page_size). Page 0 is never
given to a sequence: unused page-table entries point at it, and tokens that must not be stored (padding
of a prefill chunk, an idle slot) are written there, so every step has the same shapes whichever
sequences are running. Several sequences may list the same pages (n samples of one prompt share its
pages).

Attention reads a row's pages where they lie, a block of READ_BLOCK positions at a time in page-table
order (key j of the row is position j), with an online softmax across blocks, and only as many blocks
as the furthest new token needs: one compiled program serves every length, and no step copies a row's
whole cache out of the pool. A query at position p sees keys 0..p (and, in a sliding-window layer, only
the last `window` of them). Entries past a sequence's length point at page 0 or at pages not yet
written; the mask hides them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from polyalign.model.architecture import ModelConfig

NULL_PAGE = 0
# Positions attention reads per block (whole pages). On two CPU cores a block of 128 positions for 16
# rows stays in cache between its score and value products: a decoding step of the demo model's
# attention at 512 positions takes 5 ms so, against 20 ms gathering each row's pages first.
READ_BLOCK = 128
# The window of a layer that sees every earlier position.
UNLIMITED = 2 ** 30


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedMask:
    """The keys each query sees, from its position [B, t]: positions 0..p, the last `window` of them."""

    positions: jax.Array
    window: jax.Array  # int32 scalar: UNLIMITED in a layer without a sliding window


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedKVCache:
    """k, v: the pool, [layers, pages, page_size, kv_heads, head_dim]; page_table [B, pages_per_row];
    write_pages, write_offsets [B, t]: where each of the t new tokens of a row goes; blocks: how many
    READ_BLOCK blocks of each row attention reads; layer: the layer being run (set by the layer loop)."""

    k: jax.Array
    v: jax.Array
    page_table: jax.Array
    write_pages: jax.Array
    write_offsets: jax.Array
    blocks: jax.Array
    layer: jax.Array | None = None

    @staticmethod
    def empty_pool(cfg: ModelConfig, pages: int, page_size: int, dtype=None) -> tuple[jax.Array, jax.Array]:
        shape = (cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = dtype or cfg.dtype
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    @classmethod
    def for_tokens(cls, pool: tuple[jax.Array, jax.Array], page_table: jax.Array, positions: jax.Array,
                   store: jax.Array) -> PagedKVCache:
        """The cache for new tokens at `positions` [B, t]; those with `store` False go to the null page
        (their positions may lie past the page table) and set no read length."""
        page_size = pool[0].shape[-3]
        per_block = _block_pages(page_size)
        # whole blocks of columns, so that every block's slice of the table lies inside it
        columns = -(-page_table.shape[1] // per_block) * per_block
        page_table = jnp.pad(page_table, ((0, 0), (0, columns - page_table.shape[1])), constant_values=NULL_PAGE)
        column = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
        pages = jnp.take_along_axis(page_table, column, axis=1)
        furthest = jnp.max(jnp.where(store, positions, 0))
        blocks = jnp.minimum(furthest // (per_block * page_size) + 1, columns // per_block)
        return cls(pool[0], pool[1], page_table, jnp.where(store, pages, NULL_PAGE), positions % page_size, blocks)

    @property
    def pool(self) -> tuple[jax.Array, jax.Array]:
        return self.k, self.v

    def attention_masks(self, positions: jax.Array, sliding_window: int | None) -> tuple[PagedMask, PagedMask | None]:
        """The masks of full and (with a sliding window) local layers."""
        full = PagedMask(positions, jnp.int32(UNLIMITED))
        return full, (PagedMask(positions, jnp.int32(sliding_window)) if sliding_window else None)

    def at_layer(self, layer: jax.Array | None) -> PagedKVCache:
        return dataclasses.replace(self, layer=layer)

    def store_and_attend(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: PagedMask, *, scale: float,
                         softcap: float | None, implementation: str | None = None) -> tuple[PagedKVCache, jax.Array]:
        """Stores this layer's new keys and values [B, t, K, D] in place, then attends queries q [B, t, H, D]
        over each row's pages (the new tokens included): the cache and the output [B, t, H, D].
        `implementation` is the dense path's; blocks over pages always run as XLA."""
        del implementation
        cache = dataclasses.replace(self, k=self.k.at[self.layer, self.write_pages, self.write_offsets].set(
            k.astype(self.k.dtype)), v=self.v.at[self.layer, self.write_pages, self.write_offsets].set(
            v.astype(self.v.dtype)))
        return cache, cache._attend(q, mask, scale, softcap)

    def _attend(self, q: jax.Array, mask: PagedMask, scale: float, softcap: float | None) -> jax.Array:
        batch, length, heads, dim = q.shape
        layers, pages, page_size, kv_heads, _ = self.k.shape
        per_block = _block_pages(page_size)
        span = per_block * page_size
        # pages as rows of a [layers * pages, ...] table: one row gather per block
        table_k, table_v = (x.reshape(layers * pages, page_size, kv_heads, dim) for x in (self.k, self.v))
        grouped = q.reshape(batch, length, kv_heads, heads // kv_heads, dim)
        lowest = jnp.finfo(jnp.float32).min

        def block(j, carry):
            # online softmax: the running maximum score, the sum of exp(score - maximum), and the
            # values weighted by it; an earlier block's sums shrink by exp(old - new maximum)
            top, total, weighted = carry
            rows = self.layer * pages + jax.lax.dynamic_slice_in_dim(self.page_table, j * per_block, per_block, axis=1)
            keys = table_k[rows].reshape(batch, span, kv_heads, dim)
            values = table_v[rows].reshape(batch, span, kv_heads, dim)
            scores = jnp.einsum("btgrd,bsgd->bgrts", grouped, keys, preferred_element_type=jnp.float32) * scale
            if softcap is not None:
                scores = jnp.tanh(scores / softcap) * softcap
            distance = mask.positions[:, :, None] - (j * span + jnp.arange(span))[None, None, :]
            visible = (distance >= 0) & (distance < mask.window)
            # a finite lowest score, not -inf: a block a query sees nothing of (before its window) then
            # weighs 1 per key until a visible key's score replaces the maximum and exp(lowest - it) = 0
            scores = jnp.where(visible[:, None, None], scores, lowest)
            new_top = jnp.maximum(top, scores.max(-1))
            shrink = jnp.exp(top - new_top)
            probs = jnp.exp(scores - new_top[..., None])
            block_weighted = jnp.einsum("bgrts,bsgd->bgrtd", probs.astype(values.dtype), values,
                                        preferred_element_type=jnp.float32)
            return new_top, total * shrink + probs.sum(-1), weighted * shrink[..., None] + block_weighted

        groups = (batch, kv_heads, heads // kv_heads, length)
        carry = (jnp.full(groups, lowest), jnp.zeros(groups, jnp.float32), jnp.zeros((*groups, dim), jnp.float32))
        _, total, weighted = jax.lax.fori_loop(0, self.blocks, block, carry)
        out = (weighted / total[..., None]).astype(q.dtype)
        return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, dim)


def _block_pages(page_size: int) -> int:
    return max(1, READ_BLOCK // page_size)
