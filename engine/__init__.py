"""tierkv.engine: a compact paged-attention engine whose L1 pool is the L1 tier of the store."""
