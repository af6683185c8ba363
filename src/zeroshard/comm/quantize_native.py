"""A fused CPU kernel for ZeRO++'s block quantization (issue 24): the same results as
comm.quantization's torch ops, bit for bit (the one difference: the scale of a block of signed
zeros may be +0 where the torch ops give -0, equal under torch.equal), in one pass per block
each way.

The torch formulation is at least five passes per quantize (amax, amin, scale, round, convert;
bf16 adds one) and two per dequantize, each about a copy's cost: 0.1-0.3 of a copy's bandwidth
on a CPU (bench/RESULTS.md). This C loop reads each block once into L1 and writes its payload
once, so quantize + dequantize runs near memory speed.

Built at first use with the system C compiler (`$CC`, else Python's, else `cc`; plain C99, no
torch headers: about 2 CPU seconds, once) into a cache directory (`$ZEROSHARD_CACHE_DIR`, else
`$XDG_CACHE_HOME/zeroshard`, else `~/.cache/zeroshard`), named by a hash of the source, flags,
compiler and machine, written to a temporary name and renamed (ranks that start together may each build it; each
loads a whole file). Loaded with ctypes (which releases the GIL during a call). No compiler, a
failed build or `ZEROSHARD_NATIVE_QUANTIZE=0`: `kernel()` is None and comm.quantization runs its
torch ops; `status()` says why. Nothing is printed either way.

Same arithmetic as the torch path: absmax compared as |value| bit patterns (NaN above inf, so a
non-finite value makes the scale non-finite, as torch's amax does), scale = absmax / qmax in
fp32, 1 / scale (0 where that is not finite), value x (1 / scale) rounded half to even by the
1.5 x 2^23 addition (exact for |y| < 2^22; |y| <= qmax here), bf16 rounded to nearest even.
No FMA contraction, no fast-math. Not -march=native (a cache directory may be shared between
different CPUs): with GCC on x86-64 Linux each entry point is built for x86-64-v4 (AVX-512), -v3,
-v2 and the baseline, and the loader picks the one this CPU runs (`target_clones`); elsewhere
the baseline. Quantize prefetches the next block while it reads one (its absmax pass otherwise
waits on memory; bench/RESULTS.md). One thread per call (each rank quantizes its own buckets;
ranks run one torch thread here).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import threading

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* one copy per x86-64 level, picked when loaded (GCC ifunc); -DZS_NO_CLONES: the baseline only */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && !defined(ZS_NO_CLONES)
#define ZS_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "arch=x86-64-v2", "default")))
#else
#define ZS_CLONES
#endif

#define MAGIC 12582912.0f /* 1.5 * 2^23: y + MAGIC rounds y to an integer, half to even */

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* fp32 -> bf16, nearest even; `f` not NaN */
static inline uint16_t bf16_finite(float f) { uint32_t u = bits_of(f); return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); }
static inline uint16_t bf16_any(float f) { return f != f ? (uint16_t)0x7FC0 : bf16_finite(f); }

/* 1 / scale, 0 where that is not finite (scale 0, denormal, inf or NaN) */
static inline float inverse(float scale) { float inv = 1.0f / scale; return inv < INFINITY ? inv : 0.0f; }

/* int8 values of a block (|q| <= qmax) -> int4 pairs: (q & 15) ^ 8 is q + 8 in 1..15, low nibble first */
static inline void pack4(const int8_t *restrict q, int64_t size, int8_t *restrict dst) {
    const uint16_t *restrict w = (const uint16_t *)q;
    uint8_t *restrict d = (uint8_t *)dst;
    for (int64_t j = 0; j < size / 2; j++) {
        uint16_t v = (uint16_t)((w[j] & 0x0F0Fu) ^ 0x0808u);
        d[j] = (uint8_t)(v | (v >> 4));
    }
}

static inline void put(const float *restrict f, int64_t size, float inv, int8_t *restrict dst) {
    for (int64_t j = 0; j < size; j++) dst[j] = (int8_t)bits_of(f[j] * inv + MAGIC);
}

/* bf16 values read as pairs: the even one is the pair's low 16 bits (little-endian), so
   w << 16 and w & 0xFFFF0000 are both as fp32 without unpacking; each pair gives one int16 of
   two int8 values, or one byte of two int4 values */
static inline void put16(const uint16_t *restrict h, int64_t size, float inv, int bits, int8_t *restrict dst) {
    int64_t pairs = size / 2;
    if (bits == 8) {
        for (int64_t j = 0; j < pairs; j++) {
            uint32_t w, e, o;
            memcpy(&w, h + 2 * j, 4);
            e = bits_of(float_of(w << 16) * inv + MAGIC) & 0xFFu;
            o = bits_of(float_of(w & 0xFFFF0000u) * inv + MAGIC) & 0xFFu;
            uint16_t v = (uint16_t)(e | (o << 8));
            memcpy(dst + 2 * j, &v, 2);
        }
        if (size & 1) dst[size - 1] = (int8_t)bits_of(float_of((uint32_t)h[size - 1] << 16) * inv + MAGIC);
    } else {
        uint8_t *restrict d = (uint8_t *)dst;
        for (int64_t j = 0; j < pairs; j++) {
            uint32_t w, e, o;
            memcpy(&w, h + 2 * j, 4);
            e = bits_of(float_of(w << 16) * inv + MAGIC);
            o = bits_of(float_of(w & 0xFFFF0000u) * inv + MAGIC);
            d[j] = (uint8_t)(((e & 15u) | ((o & 15u) << 4)) ^ 0x88u);
        }
    }
}

/* Blocks [lo, hi) of a (rows, n) input, row-major, blocked as count x size (the last block
   zero-padded); payload rows of count * size * bits / 8 bytes, scales rows of count. */
ZS_CLONES
int zs_quantize(const void *x, int x_bf16, int64_t n, int64_t count, int64_t size, int bits,
                int8_t *payload, float *scales, int64_t lo, int64_t hi) {
    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const int64_t row_bytes = count * size * bits / 8;
    void *buf = NULL;
    int8_t *q8 = bits == 4 ? malloc((size_t)size) : NULL;
    if (bits == 4 && !q8) return 1;
    for (int64_t id = lo; id < hi; id++) {
        int64_t row = id / count, blk = id % count, start = blk * size;
        int64_t len = n - start < size ? n - start : size;
        int8_t *dst = payload + row * row_bytes + start * bits / 8;
        float absmax;
        if (start + size < n) { /* the next block, read while this one is: from memory, not first touched in its absmax pass */
            const char *next = (const char *)x + (row * n + start + size) * (x_bf16 ? 2 : 4);
            for (int64_t k = 0; k < size * (x_bf16 ? 2 : 4); k += 64) __builtin_prefetch(next + k);
        }
        if (x_bf16) {
            const uint16_t *h = (const uint16_t *)x + row * n + start;
            if (len < size) { /* the last block: zero-padded copy */
                if (!buf && !(buf = malloc(4 * (size_t)size))) { free(q8); return 1; }
                memcpy(buf, h, 2 * (size_t)len);
                memset((uint16_t *)buf + len, 0, 2 * (size_t)(size - len));
                h = buf;
            }
            /* |value| bit patterns, ordered like the values, NaN above inf */
            int16_t m = 0;
            for (int64_t j = 0; j < size; j++) { int16_t a = (int16_t)(h[j] & 0x7FFF); m = a > m ? a : m; }
            absmax = float_of((uint32_t)(uint16_t)m << 16);
            float scale = absmax / qmax;
            scales[id] = scale;
            put16(h, size, inverse(scale), bits, dst);
        } else {
            const float *f = (const float *)x + row * n + start;
            if (len < size) {
                if (!buf && !(buf = malloc(4 * (size_t)size))) { free(q8); return 1; }
                memcpy(buf, f, 4 * (size_t)len);
                memset((float *)buf + len, 0, 4 * (size_t)(size - len));
                f = buf;
            }
            const int32_t *restrict u = (const int32_t *)f;
            int32_t m = 0;
            for (int64_t j = 0; j < size; j++) { int32_t a = u[j] & 0x7FFFFFFF; m = a > m ? a : m; }
            absmax = float_of((uint32_t)m);
            float scale = absmax / qmax;
            scales[id] = scale;
            put(f, size, inverse(scale), bits == 8 ? dst : q8);
            if (bits == 4) pack4(q8, size, dst);
        }
    }
    free(buf);
    free(q8);
    return 0;
}

/* Blocks [lo, hi): out (rows, n; fp32 or bf16) = payload x scale, computed in fp32. */
ZS_CLONES
int zs_dequantize(const int8_t *payload, const float *scales, int bits, int64_t n, int64_t count,
                  int64_t size, void *out, int out_bf16, int64_t lo, int64_t hi) {
    const int64_t row_bytes = count * size * bits / 8;
    for (int64_t id = lo; id < hi; id++) {
        int64_t row = id / count, blk = id % count, start = blk * size;
        int64_t len = n - start < size ? n - start : size;
        const float s = scales[id];
        const int8_t *restrict src = payload + row * row_bytes + start * bits / 8;
        if (bits == 8 && !out_bf16) {
            float *restrict o = (float *)out + row * n + start;
            for (int64_t j = 0; j < len; j++) o[j] = (float)src[j] * s;
            continue;
        }
        if (!out_bf16) { /* int4 -> fp32 */
            const uint8_t *restrict b = (const uint8_t *)src;
            float *restrict o = (float *)out + row * n + start;
            int64_t pairs = len / 2;
            for (int64_t j = 0; j < pairs; j++) {
                o[2 * j] = (float)((int)(b[j] & 15u) - 8) * s;
                o[2 * j + 1] = (float)((int)(b[j] >> 4) - 8) * s;
            }
            if (len & 1) o[len - 1] = (float)((int)(b[pairs] & 15u) - 8) * s;
            continue;
        }
        uint16_t *restrict o = (uint16_t *)out + row * n + start;
        const uint8_t *restrict b = (const uint8_t *)src;
        int64_t pairs = len / 2;
        if (fabsf(s) < INFINITY) { /* q x s is not NaN: no NaN test per value */
            if (bits == 8) {
                for (int64_t j = 0; j < len; j++) o[j] = bf16_finite((float)src[j] * s);
            } else {
                for (int64_t j = 0; j < pairs; j++) { /* both values of a byte as one uint32 */
                    uint32_t e = bits_of((float)((int)(b[j] & 15u) - 8) * s);
                    uint32_t od = bits_of((float)((int)(b[j] >> 4) - 8) * s);
                    uint32_t v = ((e + 0x7FFFu + ((e >> 16) & 1u)) >> 16) | ((od + 0x7FFFu + ((od >> 16) & 1u)) & 0xFFFF0000u);
                    memcpy(o + 2 * j, &v, 4);
                }
                if (len & 1) o[len - 1] = bf16_finite((float)((int)(b[pairs] & 15u) - 8) * s);
            }
        } else if (bits == 8) {
            for (int64_t j = 0; j < len; j++) o[j] = bf16_any((float)src[j] * s);
        } else {
            for (int64_t j = 0; j < pairs; j++) {
                o[2 * j] = bf16_any((float)((int)(b[j] & 15u) - 8) * s);
                o[2 * j + 1] = bf16_any((float)((int)(b[j] >> 4) - 8) * s);
            }
            if (len & 1) o[len - 1] = bf16_any((float)((int)(b[pairs] & 15u) - 8) * s);
        }
    }
    return 0;
}
"""

FLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off", "-fno-strict-aliasing",
         "-fno-fast-math"]
ENV_SWITCH = "ZEROSHARD_NATIVE_QUANTIZE"  # "0": never build or load the kernel (torch ops only)

_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> str:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("ZEROSHARD_CACHE_DIR") or os.path.join(xdg, "zeroshard")


def _compile(cc: list[str], lib: str) -> str | None:
    """Build `lib` (None) or say why not; a compiler without x86-64 level clones gets a second
    try with the baseline instruction set only."""
    with tempfile.TemporaryDirectory(dir=os.path.dirname(lib)) as tmp:
        src, tmp_lib = os.path.join(tmp, "quantize.c"), os.path.join(tmp, "quantize.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        for extra in ([], ["-DZS_NO_CLONES"]):
            done = subprocess.run(cc + FLAGS + extra + ["-o", tmp_lib, src], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode == 0:
                os.replace(tmp_lib, lib)  # atomic: a rank that loads it sees the whole file or none
                return None
        return f"C build failed ({' '.join(cc)}): {(done.stderr or done.stdout).strip()[:300]}"


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None, f"disabled by {ENV_SWITCH}=0"
    if sys.byteorder != "little" or not (sys.platform.startswith("linux") or sys.platform == "darwin"):
        return None, f"no native build on {sys.platform} ({sys.byteorder}-endian)"
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    try:
        version = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"no C compiler ({' '.join(cc)}: {e})"
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, *cc, version, platform.machine(), sys.platform]).encode())
    lib = os.path.join(cache_dir(), f"zeroshard_quantize_{key.hexdigest()[:20]}.so")
    if not os.path.exists(lib):
        try:
            os.makedirs(os.path.dirname(lib), exist_ok=True)
            failed = _compile(cc, lib)
        except (OSError, subprocess.SubprocessError) as e:
            failed = f"C build failed ({' '.join(cc)}): {e}"
        if failed:
            return None, failed
    try:
        dll = ctypes.CDLL(lib)
    except OSError as e:
        return None, f"could not load {lib}: {e}"
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    dll.zs_quantize.argtypes = [ptr, i32, i64, i64, i64, i32, ptr, ptr, i64, i64]
    dll.zs_dequantize.argtypes = [ptr, ptr, i32, i64, i64, i64, ptr, i32, i64, i64]
    dll.zs_quantize.restype = dll.zs_dequantize.restype = i32
    return dll, f"fused C kernel {lib}"


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel, built on first call; None where it cannot be (see `status()`)."""
    if "dll" not in _state:
        with _lock:
            if "dll" not in _state:
                _state["dll"], _state["status"] = _build()
    return _state["dll"]  # type: ignore[return-value]


def status() -> str:
    """Which implementation comm.quantization runs on CPU tensors, and why."""
    return "torch ops: " + str(_state["status"]) if kernel() is None else str(_state["status"])


def reset() -> None:
    """Forget the loaded kernel, so that the next `kernel()` builds or loads it again (tests)."""
    with _lock:
        _state.clear()
