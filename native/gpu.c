/* gpu.c — NVIDIA GPUs through the CUDA driver API, loaded with dlopen: the package
 * has no link-time CUDA dependency and needs no toolkit. Absent driver = no GPU,
 * with the reason recorded. Kernel modules and launches build on this (issue: GPU engine). */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "le_caps.h"
#include "le_internal.h"

/* Driver API subset; signatures from cuda.h (stable since CUDA 3.2). */
typedef int CUresult;
typedef int CUdevice;
enum { CU_ATTR_MULTIPROCESSOR_COUNT = 16, CU_ATTR_CC_MAJOR = 75, CU_ATTR_CC_MINOR = 76 };

static struct {
    int tried, ok;
    char reason[128];
    CUresult (*cuInit)(unsigned);
    CUresult (*cuDriverGetVersion)(int *);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDeviceGetName)(char *, int, CUdevice);
    CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);
} cu;

static int load_driver(void) {
    if (cu.tried) return cu.ok;
    cu.tried = 1;
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(cu.reason, sizeof cu.reason, "libcuda.so.1 not found (no NVIDIA driver)");
        return 0;
    }
    /* Kept open for the process lifetime: kernels will be launched through it. */
    *(void **)&cu.cuInit = dlsym(h, "cuInit");
    *(void **)&cu.cuDriverGetVersion = dlsym(h, "cuDriverGetVersion");
    *(void **)&cu.cuDeviceGetCount = dlsym(h, "cuDeviceGetCount");
    *(void **)&cu.cuDeviceGet = dlsym(h, "cuDeviceGet");
    *(void **)&cu.cuDeviceGetName = dlsym(h, "cuDeviceGetName");
    *(void **)&cu.cuDeviceGetAttribute = dlsym(h, "cuDeviceGetAttribute");
    *(void **)&cu.cuDeviceTotalMem = dlsym(h, "cuDeviceTotalMem_v2");
    if (!cu.cuDeviceTotalMem) *(void **)&cu.cuDeviceTotalMem = dlsym(h, "cuDeviceTotalMem");
    if (!cu.cuInit || !cu.cuDriverGetVersion || !cu.cuDeviceGetCount || !cu.cuDeviceGet ||
        !cu.cuDeviceGetName || !cu.cuDeviceGetAttribute || !cu.cuDeviceTotalMem) {
        snprintf(cu.reason, sizeof cu.reason, "libcuda lacks a driver API entry point");
        return 0;
    }
    CUresult rc = cu.cuInit(0);
    if (rc != 0) {
        snprintf(cu.reason, sizeof cu.reason, "cuInit failed with CUresult %d", rc);
        return 0;
    }
    cu.ok = 1;
    return 1;
}

int le_gpu_detect(le_gpu_driver_info *out) {
    memset(out, 0, sizeof *out);
    if (!load_driver()) {
        snprintf(out->reason, sizeof out->reason, "%s", cu.reason);
        return 0;
    }
    out->available = 1;
    cu.cuDriverGetVersion(&out->driver_version);
    int n = 0;
    if (cu.cuDeviceGetCount(&n) != 0) n = 0;
    out->device_count = n;
    return 0;
}

int le_gpu_device(int index, le_gpu_device_info *out) {
    memset(out, 0, sizeof *out);
    if (!load_driver()) return LE_FAIL(LE_ERR_UNAVAILABLE, "no CUDA driver: %s", cu.reason);
    CUdevice dev;
    CUresult rc = cu.cuDeviceGet(&dev, index);
    if (rc != 0) return LE_FAIL(LE_ERR_DEVICE, "cuDeviceGet(%d) failed with CUresult %d", index, rc);
    size_t mem = 0;
    if ((rc = cu.cuDeviceGetName(out->name, (int)sizeof out->name, dev)) != 0 ||
        (rc = cu.cuDeviceGetAttribute(&out->cc_major, CU_ATTR_CC_MAJOR, dev)) != 0 ||
        (rc = cu.cuDeviceGetAttribute(&out->cc_minor, CU_ATTR_CC_MINOR, dev)) != 0 ||
        (rc = cu.cuDeviceGetAttribute(&out->multiprocessors, CU_ATTR_MULTIPROCESSOR_COUNT, dev)) != 0 ||
        (rc = cu.cuDeviceTotalMem(&mem, dev)) != 0)
        return LE_FAIL(LE_ERR_DEVICE, "querying device %d failed with CUresult %d", index, rc);
    out->total_mem = (long long)mem;
    return 0;
}
