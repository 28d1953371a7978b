/* gdn_chunked.cuh — what the chunked GDN's kernels share (gdn_chunked.cu: the prep and the f32 scan;
 * gdn_scan_tf32.cu: the scan on tf32 tensor cores): the chunk, a block's threads, the shared tiles' width, a scan
 * block's columns of S, the largest key dim, and the k-head of a v-head. */
#ifndef LE_GDN_CHUNKED_CUH
#define LE_GDN_CHUNKED_CUH

#include "compat.cuh"

#define GDNC_C 64        /* chunk rows: native/gdn.c GDN_CHUNK */
#define GDNC_THREADS 256
#define GDNC_TILE 32     /* dims of K, Q, V, W per shared tile */
#define GDNC_COLS 16     /* columns of S per scan block: Hv * dv / 16 blocks (256 for the 35B: two an SM) */
#define GDNC_MAX_DK 128

__device__ __forceinline__ int gdnc_k_head(int j, int Hk, int Hv, int tiled) { return tiled ? j % Hk : j / (Hv / Hk); }

#endif
