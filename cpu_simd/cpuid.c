/* cpuid.c — CPU feature detection: CPUID says what the core has, XGETBV says what
 * register state the OS saves; a feature counts only when both agree (an AVX-512 core
 * under an OS that does not save ZMM state must not run AVX-512 code).
 * Leaf/bit numbers: Intel SDM vol. 2A, CPUID; XCR0 bits: SDM vol. 1, 13.1. */
#include <string.h>
#include <unistd.h>

#include "le_caps.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    if (!__get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3])) r[0] = r[1] = r[2] = r[3] = 0;
}

static unsigned long long xgetbv0(void) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

#define BIT(x, n) (((x) >> (n)) & 1u)

int le_cpu_detect(le_cpu_info *out) {
    memset(out, 0, sizeof *out);
    out->is_x86 = 1;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    out->logical_cpus = n > 0 ? (int)n : 1;

    unsigned r[4];
    cpuid(0, 0, r);
    unsigned max_leaf = r[0];
    memcpy(out->vendor + 0, &r[1], 4); /* EBX, EDX, ECX spell the vendor */
    memcpy(out->vendor + 4, &r[3], 4);
    memcpy(out->vendor + 8, &r[2], 4);

    cpuid(0x80000000u, 0, r);
    if (r[0] >= 0x80000004u) {
        for (unsigned i = 0; i < 3; i++) {
            cpuid(0x80000002u + i, 0, r);
            memcpy(out->brand + 16 * i, r, 16);
        }
        out->brand[48] = 0;
    }

    cpuid(1, 0, r);
    unsigned ecx1 = r[2], edx1 = r[3];
    (void)edx1;
    out->sse3 = BIT(ecx1, 0);
    out->ssse3 = BIT(ecx1, 9);
    out->fma = BIT(ecx1, 12);
    out->sse41 = BIT(ecx1, 19);
    out->sse42 = BIT(ecx1, 20);
    out->popcnt = BIT(ecx1, 23);
    int osxsave = BIT(ecx1, 27);
    out->avx = BIT(ecx1, 28);
    out->f16c = BIT(ecx1, 29);

    unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
    out->os_avx = (xcr0 & 0x6) == 0x6;            /* XMM | YMM */
    out->os_avx512 = (xcr0 & 0xe6) == 0xe6;       /* + opmask, ZMM_Hi256, Hi16_ZMM */
    out->os_amx = (xcr0 & 0x60000) == 0x60000;    /* XTILECFG | XTILEDATA */

    unsigned ebx7 = 0, ecx7 = 0, edx7 = 0, eax71 = 0;
    if (max_leaf >= 7) {
        cpuid(7, 0, r);
        ebx7 = r[1]; ecx7 = r[2]; edx7 = r[3];
        cpuid(7, 1, r);
        eax71 = r[0];
    }
    out->avx2 = BIT(ebx7, 5);
    out->avx512f = BIT(ebx7, 16);
    out->avx512dq = BIT(ebx7, 17);
    out->avx512bw = BIT(ebx7, 30);
    out->avx512vl = BIT(ebx7, 31);
    out->avx512vnni = BIT(ecx7, 11);
    out->amx_bf16 = BIT(edx7, 22);
    out->amx_tile = BIT(edx7, 24);
    out->amx_int8 = BIT(edx7, 25);
    out->avxvnni = BIT(eax71, 4);
    out->avx512bf16 = BIT(eax71, 5);

    /* Mask by OS support: a feature whose registers the OS does not save is absent. */
    if (!out->os_avx) {
        out->avx = out->avx2 = out->fma = out->f16c = out->avxvnni = 0;
    }
    if (!out->os_avx512) {
        out->avx512f = out->avx512bw = out->avx512vl = out->avx512dq = 0;
        out->avx512vnni = out->avx512bf16 = 0;
    }
    if (!out->os_amx) out->amx_tile = out->amx_int8 = out->amx_bf16 = 0;
    return 0;
}

#else

int le_cpu_detect(le_cpu_info *out) {
    memset(out, 0, sizeof *out);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    out->logical_cpus = n > 0 ? (int)n : 1;
    strcpy(out->vendor, "non-x86");
    return 0;
}

#endif
