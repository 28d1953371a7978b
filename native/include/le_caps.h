/* le_caps.h — what the machine has: CPU features (CPUID + XGETBV), NUMA nodes
 * (libnuma, dlopened), GPUs (libcuda, dlopened). Nothing here fails when an
 * optional library is absent: the *_available fields say so, and `reason` says why.
 * This header is fed to cffi's cdef: declarations only, no macros. */
#ifndef LE_CAPS_H
#define LE_CAPS_H

typedef struct {
    char vendor[16];
    char brand[64];
    int is_x86;
    int sse3, ssse3, sse41, sse42, popcnt;
    int avx, f16c, fma, avx2;
    int avx512f, avx512bw, avx512vl, avx512dq, avx512vnni, avx512bf16;
    int avxvnni;
    int amx_tile, amx_int8, amx_bf16;
    int os_avx;       /* XGETBV: the OS saves YMM state */
    int os_avx512;    /* XGETBV: the OS saves opmask + ZMM state */
    int os_amx;       /* XGETBV: the OS saves tile state (XTILECFG, XTILEDATA) */
    int logical_cpus; /* online logical CPUs (sysconf) */
} le_cpu_info;

/* Fills *out with this CPU's features; a feature is reported 1 only if the CPU has it
 * and the OS enables its register state. Never fails on x86-64; on other CPUs is_x86=0. */
int le_cpu_detect(le_cpu_info *out);

typedef struct {
    int available;    /* 1 if libnuma loaded and numa_available() >= 0 */
    int nodes;        /* configured NUMA nodes (1 when unavailable) */
    char reason[128]; /* why unavailable, empty when available */
} le_numa_info;

int le_numa_detect(le_numa_info *out);

typedef struct {
    int available;          /* 1 if libcuda loaded and cuInit succeeded */
    int driver_version;     /* e.g. 12080 for 12.8 */
    int device_count;
    char reason[128];       /* why unavailable */
} le_gpu_driver_info;

typedef struct {
    char name[128];
    int cc_major, cc_minor; /* compute capability */
    long long total_mem;    /* bytes */
    int multiprocessors;
} le_gpu_device_info;

int le_gpu_detect(le_gpu_driver_info *out);
int le_gpu_device(int index, le_gpu_device_info *out);

#endif
