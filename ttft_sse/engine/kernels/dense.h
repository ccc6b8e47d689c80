/* A dense layer's panels (HALF, BRAIN, FULL: an F16, BF16 or F32 file's weights, laid out as kernel.c's codes are,
   K x 16 values a panel): one chain of fused multiply-adds an output, input after input, from zero, each value
   widened exactly as it is read; in tiles of up to B_ROWS rows x B_COLS columns, as kernel.c's buffered tiles. */

#ifndef TTFT_DENSE_H
#define TTFT_DENSE_H

#include <stdint.h>

#include "blocks.h"
#include "vectors.h"

#define B_COLS 3 /* columns a tile over a dense layer's panels, or over kernel.c's buffer */

/* Up to B_ROWS rows against `cols` columns (CV outputs each), from column c0, of a dense layer's panels of values at
   w (K x 16 a panel; HALF, BRAIN, FULL): one chain of multiply-adds an output, in input order, from zero. */
static inline __attribute__((always_inline)) void dense(int rows, int cols, int c0, const uint8_t *w, int bits,
                                                        const float *x, int64_t K, float *y, int64_t N,
                                                        int64_t outputs) {
    cv acc[B_ROWS][B_COLS];
    int64_t at[B_COLS];
    for (int c = 0; c < cols; c++) at[c] = (int64_t)(c0 + c) * CV / P * K * P + (int64_t)(c0 + c) * CV % P;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = cv_zero();
    for (int64_t k = 0; k < K; k++) {
        cv wk[B_COLS];
        for (int c = 0; c < cols; c++) wk[c] = cv_dense(w, at[c] + k * P, bits);
        for (int r = 0; r < rows; r++)
            for (int c = 0; c < cols; c++) acc[r][c] = cv_fma(x[r * K + k], wk[c], acc[r][c]);
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            int64_t first = (int64_t)(c0 + c) * CV;
            put_column(y + r * N + first, acc[r][c], outputs - first);
        }
}

/* Panels p .. p+group-1 of y = x . W^T from a dense layer's panels of values at w (the group's first; K x 16 a
   panel), in tiles of up to B_ROWS rows. */
static inline void dense_group(const float *x, int64_t M, int64_t K, const uint8_t *w, int bits, int64_t N, float *y,
                        int64_t p, int group) {
    int columns = group * P / CV;
    int64_t tiles = (M + B_ROWS - 1) / B_ROWS, r = 0;
    for (int64_t t = 0; t < tiles; t++) {
        int64_t rows = tile_rows(M, r, t, tiles);
        const float *xr = x + r * K;
        float *yr = y + r * N + p * P;
        for (int c0 = 0; c0 < columns; c0 += B_COLS) {
            int cols = columns - c0 < B_COLS ? columns - c0 : B_COLS;
            /* the kind a constant in each specialisation (always_inline): no test in the inner loop */
#define DENSE_HALF(R, C) if (R <= B_ROWS) dense(R, C, c0, w, HALF, xr, K, yr, N, N - p * P)
#define DENSE_BRAIN(R, C) if (R <= B_ROWS) dense(R, C, c0, w, BRAIN, xr, K, yr, N, N - p * P)
#define DENSE_FULL(R, C) if (R <= B_ROWS) dense(R, C, c0, w, FULL, xr, K, yr, N, N - p * P)
            if (bits == HALF) {
                BY_ROWS(DENSE_HALF, rows, cols)
            } else if (bits == BRAIN) {
                BY_ROWS(DENSE_BRAIN, rows, cols)
            } else {
                BY_ROWS(DENSE_FULL, rows, cols)
            }
        }
        r += rows;
    }
}

#endif
