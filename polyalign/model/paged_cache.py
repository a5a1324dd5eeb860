"""A KV cache in fixed-size pages, shared by every sequence of a generation engine.

The pool holds `pages` pages of `page_size` token slots per layer. A sequence owns a row of the page
table: entry j is the page holding its positions [j * page_size, (j + 1) * page_size). Page 0 is never
given to a sequence: unused page-table entries point at it, and tokens that must not be stored (padding
of a prefill chunk, an idle slot) are written there, so every step has the same shapes whichever
sequences are running. Several sequences may list the same pages (n samples of one prompt share its
pages).

Attention reads a row's pages in page-table order, so key j of the gathered row is position j; a query
at position p sees keys 0..p (and, in a sliding-window layer, only the last `window` of them). Entries
past a sequence's length point at page 0 or at pages not yet written; the mask hides them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from polyalign.model.architecture import ModelConfig

NULL_PAGE = 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedKVCache:
    """k, v: the pool, [layers, pages, page_size, kv_heads, head_dim]; page_table [B, pages_per_row];
    write_pages, write_offsets [B, t]: where each of the t new tokens of a row goes; layer: the layer
    being run (set by the layer loop)."""

    k: jax.Array
    v: jax.Array
    page_table: jax.Array
    write_pages: jax.Array
    write_offsets: jax.Array
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
        (their positions may lie past the page table, which may be cut to the pages a step can reach)."""
        page_size = pool[0].shape[-3]
        column = jnp.minimum(positions // page_size, page_table.shape[1] - 1)
        pages = jnp.take_along_axis(page_table, column, axis=1)
        return cls(pool[0], pool[1], page_table, jnp.where(store, pages, NULL_PAGE), positions % page_size)

    @property
    def pool(self) -> tuple[jax.Array, jax.Array]:
        return self.k, self.v

    def attention_masks(self, positions: jax.Array, sliding_window: int | None) -> tuple[jax.Array, jax.Array | None]:
        """Masks [B, 1, t, S] over a row's gathered keys (S = pages_per_row * page_size)."""
        keys = jnp.arange(self.page_table.shape[1] * self.k.shape[-3])[None, None, :]
        distance = positions[:, :, None] - keys
        mask = (distance >= 0)[:, None]
        local = mask & (distance < sliding_window)[:, None] if sliding_window else None
        return mask, local

    def at_layer(self, layer: jax.Array | None) -> PagedKVCache:
        return dataclasses.replace(self, layer=layer)

    def update(self, k: jax.Array, v: jax.Array) -> tuple[PagedKVCache, jax.Array, jax.Array]:
        """Stores this layer's new keys and values [B, t, K, D] in place; returns the cache and each
        row's keys and values [B, S, K, D] in position order, gathered from its pages."""
        pool_k = self.k.at[self.layer, self.write_pages, self.write_offsets].set(k.astype(self.k.dtype))
        pool_v = self.v.at[self.layer, self.write_pages, self.write_offsets].set(v.astype(self.v.dtype))
        batch = self.page_table.shape[0]

        def rows(pool):
            # whole pages as rows of a [layers * pages, page_size * K * D] table: one row gather, which XLA
            # runs about a third faster on CPU than indexing the layer and the pages as two axes
            layers, pages = pool.shape[:2]
            flat = pool.reshape(layers * pages, -1)
            gathered = jnp.take(flat, (self.layer * pages + self.page_table).reshape(-1), axis=0)
            return gathered.reshape(batch, -1, *pool.shape[-2:])

        return dataclasses.replace(self, k=pool_k, v=pool_v), rows(pool_k), rows(pool_v)
