/* gather_blocks / scatter_blocks between vLLM's pages and canonical blocks
   (tierkv/kernels/cpu_block_copy.py loads it with ctypes). */
#include <stdint.h>
#include <string.h>

static inline void copy_row(char *d, const char *s, int64_t row) {
  switch (row) {
    case 32: memcpy(d, s, 32); break;
    case 64: memcpy(d, s, 64); break;
    case 128: memcpy(d, s, 128); break;
    case 192: memcpy(d, s, 192); break;
    case 256: memcpy(d, s, 256); break;
    case 512: memcpy(d, s, 512); break;
    default: memcpy(d, s, (size_t)row);
  }
}

/* One canonical block [L, 2, B, H, row] (contiguous) <-> the engine's page of block `page`: kv
   strides in bytes (layer, K|V, token, head); a row is head_dim contiguous elements. */
static void copy_block(char *canon, char *page, int64_t L, int64_t B, int64_t H, int64_t row,
                       int64_t sl, int64_t skv, int64_t st, int64_t sh, int scatter) {
  for (int64_t l = 0; l < L; l++)
    for (int64_t k = 0; k < 2; k++) {
      char *c = canon + (l * 2 + k) * B * H * row;
      char *p = page + l * sl + k * skv;
      /* The canonical block is walked in memory order in both directions: gather
         measured 0.61-0.64x memcpy this way against 0.48-0.56x walking the page in order. */
      for (int64_t t = 0; t < B; t++)
        for (int64_t h = 0; h < H; h++) {
          if (scatter)
            copy_row(p + t * st + h * sh, c + (t * H + h) * row, row);
          else
            copy_row(c + (t * H + h) * row, p + t * st + h * sh, row);
        }
    }
}

/* blocks[i] <-> kv[:, ids[i]]: a canonical block every sn bytes from `blocks`. */
void tierkv_block_copy(char *kv, char *blocks, const int64_t *ids, int64_t n, int64_t L, int64_t B,
                       int64_t H, int64_t row, int64_t sl, int64_t sb, int64_t skv, int64_t st,
                       int64_t sh, int64_t sn, int scatter) {
  for (int64_t i = 0; i < n; i++)
    copy_block(blocks + i * sn, kv + ids[i] * sb, L, B, H, row, sl, skv, st, sh, scatter);
}

/* The same with each canonical block wherever it lies: blocks[i] points at block i. */
void tierkv_block_copy_list(char *kv, char **blocks, const int64_t *ids, int64_t n, int64_t L,
                            int64_t B, int64_t H, int64_t row, int64_t sl, int64_t sb, int64_t skv,
                            int64_t st, int64_t sh, int scatter) {
  for (int64_t i = 0; i < n; i++)
    copy_block(blocks[i], kv + ids[i] * sb, L, B, H, row, sl, skv, st, sh, scatter);
}
