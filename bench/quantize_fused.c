/* A fused ZeRO++ block quantizer for the CPU: a PROTOTYPE measured for issue 24, not used by
   zeroshard (comm/quantization.py is plain torch). One pass per block for quantize (absmax as the
   largest |value| bit pattern, so a NaN makes the scale NaN; scale = absmax / qmax; round half to
   even), one for dequantize (bf16 rounded to nearest even as torch does). Same results as
   comm.quantization on the cases bench/bench_quantize_fused.py checks. Build:
   gcc -O3 -march=native -fno-math-errno -ffp-contract=off -fPIC -shared -o fused.so quantize_fused.c */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* blocks [lo, hi) of the rows x count blocks of x (rows x n, contiguous; bf16 if x_bf16) */
int zs_quantize(const void *x, int x_bf16, int64_t n, int64_t count, int64_t size, int bits,
                int8_t *payload, float *scales, int64_t lo, int64_t hi) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const int64_t padded = count * size, row_bytes = padded * bits / 8;
    float *f = malloc(sizeof(float) * size);
    int8_t *q = malloc(size);
    if (!f || !q) { free(f); free(q); return 1; }
    for (int64_t id = lo; id < hi; id++) {
        int64_t row = id / count, blk = id % count, start = blk * size;
        int64_t len = n - start < size ? n - start : size;
        const float *fx = f;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + row * n + start;
            for (int64_t j = 0; j < len; j++) f[j] = bf16_to_f32(src[j]);
            for (int64_t j = len; j < size; j++) f[j] = 0.0f;
        } else if (len < size) {
            memcpy(f, (const float *)x + row * n + start, sizeof(float) * len);
            for (int64_t j = len; j < size; j++) f[j] = 0.0f;
        } else {
            fx = (const float *)x + row * n + start;
        }
        /* absmax as the largest |value| bit pattern: ordered like the values, with NaN above
           inf, so a NaN makes the scale NaN (as torch's amax does) */
        uint32_t mb = 0;
        for (int64_t j = 0; j < size; j++) { uint32_t u; memcpy(&u, fx + j, 4); u &= 0x7FFFFFFFu; mb = u > mb ? u : mb; }
        float m; memcpy(&m, &mb, 4);
        float scale = m / qmax;
        float inv = 1.0f / scale;
        if (!(inv < INFINITY)) inv = 0.0f;
        scales[row * count + blk] = scale;
        if (bits == 8) {
            int8_t *dst = payload + row * row_bytes + start;
            for (int64_t j = 0; j < size; j++) dst[j] = (int8_t)(int32_t)nearbyintf(fx[j] * inv);
        } else {
            for (int64_t j = 0; j < size; j++) q[j] = (int8_t)(int32_t)nearbyintf(fx[j] * inv);
            uint8_t *dst = (uint8_t *)payload + row * row_bytes + start / 2;
            for (int64_t j = 0; j < size / 2; j++)
                dst[j] = (uint8_t)(((q[2 * j] + 8) & 15) | (((q[2 * j + 1] + 8) & 15) << 4));
        }
    }
    free(f); free(q);
    return 0;
}

int zs_dequantize(const int8_t *payload, const float *scales, int bits, int64_t n, int64_t count, int64_t size,
                  void *out, int out_bf16, int64_t lo, int64_t hi) {
    const int64_t padded = count * size, row_bytes = padded * bits / 8;
    float *f = malloc(sizeof(float) * size);
    if (!f) return 1;
    for (int64_t id = lo; id < hi; id++) {
        int64_t row = id / count, blk = id % count, start = blk * size;
        int64_t len = n - start < size ? n - start : size;
        const float scale = scales[row * count + blk];
        if (bits == 8 && !out_bf16) {
            const int8_t *src = payload + row * row_bytes + start;
            float *dst = (float *)out + row * n + start;
            for (int64_t j = 0; j < len; j++) dst[j] = (float)src[j] * scale;
            continue;
        }
        if (bits == 8) {
            const int8_t *src = payload + row * row_bytes + start;
            for (int64_t j = 0; j < len; j++) f[j] = (float)src[j] * scale;
        } else {
            const uint8_t *src = (const uint8_t *)payload + row * row_bytes + start / 2;
            for (int64_t j = 0; j < len / 2; j++) {
                f[2 * j] = (float)((int)(src[j] & 15) - 8) * scale;
                f[2 * j + 1] = (float)((int)(src[j] >> 4) - 8) * scale;
            }
            if (len & 1) f[len - 1] = (float)((int)(src[len / 2] & 15) - 8) * scale;
        }
        if (out_bf16) {
            uint16_t *dst = (uint16_t *)out + row * n + start;
            for (int64_t j = 0; j < len; j++) dst[j] = f32_to_bf16(f[j]);
        } else {
            memcpy((float *)out + row * n + start, f, sizeof(float) * len);
        }
    }
    free(f);
    return 0;
}
