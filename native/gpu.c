/* gpu.c — NVIDIA GPUs through the CUDA driver API, loaded with dlopen: the package
 * has no link-time CUDA dependency and needs no toolkit. Absent driver = no GPU,
 * with the reason recorded.
 *
 * Detection (le_caps.h) and the engine's use of the driver (le_gpu.h): the primary
 * context of one device, device memory accounted against a VRAM budget, pinned host
 * memory, copies, streams, events, PTX/cubin modules and kernel launches. Every
 * CUresult != 0 becomes an le_status whose message names the call, the CUresult's
 * name and, for launches, the kernel; nothing here aborts or prints.
 *
 * $LE_CUDA_LIB names the driver library to open instead of libcuda.so.1 (tests point
 * it at a missing file to exercise the no-driver path). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "le_caps.h"
#include "le_gpu.h"
#include "le_internal.h"

/* Driver API subset; signatures from cuda.h (stable since CUDA 3.2; the primary
 * context since 7.0). Handles are opaque pointers, CUdeviceptr is 64-bit. */
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef void *CUgraph;
typedef void *CUgraphExec;
typedef unsigned long long CUdeviceptr;
enum { CU_ATTR_MULTIPROCESSOR_COUNT = 16, CU_ATTR_CC_MAJOR = 75, CU_ATTR_CC_MINOR = 76 };
enum { CUDA_ERROR_OUT_OF_MEMORY = 2 };
enum { CU_JIT_INFO_LOG_BUFFER = 3, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES = 4, CU_JIT_ERROR_LOG_BUFFER = 5,
       CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6, CU_JIT_LOG_VERBOSE = 12 };
enum { CU_FUNC_MAX_THREADS = 0, CU_FUNC_SHARED = 1, CU_FUNC_LOCAL = 3, CU_FUNC_REGS = 4, CU_FUNC_PTX = 5,
       CU_FUNC_BINARY = 6 };
enum { CU_STREAM_DEFAULT = 0, CU_STREAM_NON_BLOCKING = 1, CU_EVENT_DEFAULT = 0 };
enum { CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1 };

#define JIT_LOG_BYTES 8192 /* per log; the JIT truncates beyond it */

static struct {
    int tried, ok;
    char reason[128];
    /* detection: required for cu.ok */
    CUresult (*cuInit)(unsigned);
    CUresult (*cuDriverGetVersion)(int *);
    CUresult (*cuDeviceGetCount)(int *);
    CUresult (*cuDeviceGet)(CUdevice *, int);
    CUresult (*cuDeviceGetName)(char *, int, CUdevice);
    CUresult (*cuDeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*cuDeviceTotalMem)(size_t *, CUdevice);
    /* compute: checked by le_gpu_init, so detection still works on a driver that lacks one */
    CUresult (*cuGetErrorName)(CUresult, const char **);
    CUresult (*cuGetErrorString)(CUresult, const char **);
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
    CUresult (*cuCtxSetCurrent)(CUcontext);
    CUresult (*cuCtxSynchronize)(void);
    CUresult (*cuMemGetInfo)(size_t *, size_t *);
    CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
    CUresult (*cuMemFree)(CUdeviceptr);
    CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
    CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*cuMemcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t);
    CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemAllocHost)(void **, size_t);
    CUresult (*cuMemFreeHost)(void *);
    CUresult (*cuStreamCreate)(CUstream *, unsigned);
    CUresult (*cuStreamDestroy)(CUstream);
    CUresult (*cuStreamSynchronize)(CUstream);
    CUresult (*cuStreamQuery)(CUstream);
    CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
    CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*cuMemHostRegister)(void *, size_t, unsigned);
    CUresult (*cuMemHostUnregister)(void *);
    CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr *, void *, unsigned);
    CUresult (*cuEventCreate)(CUevent *, unsigned);
    CUresult (*cuEventDestroy)(CUevent);
    CUresult (*cuEventRecord)(CUevent, CUstream);
    CUresult (*cuEventSynchronize)(CUevent);
    CUresult (*cuEventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*cuModuleLoadDataEx)(CUmodule *, const void *, unsigned, int *, void **);
    CUresult (*cuModuleUnload)(CUmodule);
    CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*cuFuncGetAttribute)(int *, int, CUfunction);
    CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               CUstream, void **, void **);
    /* CUDA graphs (driver >= 10.0; 11.4 for cuGraphInstantiateWithFlags): optional, NULL when absent */
    CUresult (*cuStreamBeginCapture)(CUstream, int);
    CUresult (*cuStreamEndCapture)(CUstream, CUgraph *);
    CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*cuGraphLaunch)(CUgraphExec, CUstream);
    CUresult (*cuGraphExecDestroy)(CUgraphExec);
    CUresult (*cuGraphDestroy)(CUgraph);
    const char *missing; /* the first compute entry point the driver lacks, NULL if none */
} cu;

/* The first of `names` (newest ABI first) that the library exports. */
static void *sym(void *h, const char *a, const char *b) {
    void *p = dlsym(h, a);
    if (!p && b) p = dlsym(h, b);
    return p;
}

#define LOAD(field, a, b)                                          \
    do {                                                           \
        *(void **)&cu.field = sym(h, a, b);                        \
        if (!cu.field && !cu.missing) cu.missing = a;              \
    } while (0)

static int load_driver(void) {
    if (cu.tried) return cu.ok;
    cu.tried = 1;
    const char *path = getenv("LE_CUDA_LIB");
    void *h = NULL;
    if (path && *path) {
        h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            snprintf(cu.reason, sizeof cu.reason, "LE_CUDA_LIB=%.80s cannot be opened", path);
            return 0;
        }
    } else {
        h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!h) h = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
        if (!h) {
            snprintf(cu.reason, sizeof cu.reason, "libcuda.so.1 not found (no NVIDIA driver)");
            return 0;
        }
    }
    /* Kept open for the process lifetime: kernels are launched through it. */
    *(void **)&cu.cuInit = dlsym(h, "cuInit");
    *(void **)&cu.cuDriverGetVersion = dlsym(h, "cuDriverGetVersion");
    *(void **)&cu.cuDeviceGetCount = dlsym(h, "cuDeviceGetCount");
    *(void **)&cu.cuDeviceGet = dlsym(h, "cuDeviceGet");
    *(void **)&cu.cuDeviceGetName = dlsym(h, "cuDeviceGetName");
    *(void **)&cu.cuDeviceGetAttribute = dlsym(h, "cuDeviceGetAttribute");
    *(void **)&cu.cuDeviceTotalMem = sym(h, "cuDeviceTotalMem_v2", "cuDeviceTotalMem");
    if (!cu.cuInit || !cu.cuDriverGetVersion || !cu.cuDeviceGetCount || !cu.cuDeviceGet ||
        !cu.cuDeviceGetName || !cu.cuDeviceGetAttribute || !cu.cuDeviceTotalMem) {
        snprintf(cu.reason, sizeof cu.reason, "libcuda lacks a driver API entry point");
        return 0;
    }
    /* why the _v2 names first: cuda.h maps the plain names to them since CUDA 4.0
     * (64-bit sizes); the plain ones remain for old drivers. */
    LOAD(cuGetErrorName, "cuGetErrorName", NULL);
    LOAD(cuGetErrorString, "cuGetErrorString", NULL);
    LOAD(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL);
    LOAD(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease");
    LOAD(cuCtxSetCurrent, "cuCtxSetCurrent", NULL);
    LOAD(cuCtxSynchronize, "cuCtxSynchronize", NULL);
    LOAD(cuMemGetInfo, "cuMemGetInfo_v2", "cuMemGetInfo");
    LOAD(cuMemAlloc, "cuMemAlloc_v2", "cuMemAlloc");
    LOAD(cuMemFree, "cuMemFree_v2", "cuMemFree");
    LOAD(cuMemsetD8, "cuMemsetD8_v2", "cuMemsetD8");
    LOAD(cuMemcpyHtoD, "cuMemcpyHtoD_v2", "cuMemcpyHtoD");
    LOAD(cuMemcpyDtoH, "cuMemcpyDtoH_v2", "cuMemcpyDtoH");
    LOAD(cuMemcpyDtoD, "cuMemcpyDtoD_v2", "cuMemcpyDtoD");
    LOAD(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync");
    LOAD(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync");
    LOAD(cuMemAllocHost, "cuMemAllocHost_v2", "cuMemAllocHost");
    LOAD(cuMemFreeHost, "cuMemFreeHost", NULL);
    LOAD(cuStreamCreate, "cuStreamCreate", NULL);
    LOAD(cuStreamDestroy, "cuStreamDestroy_v2", "cuStreamDestroy");
    LOAD(cuStreamSynchronize, "cuStreamSynchronize", NULL);
    LOAD(cuStreamQuery, "cuStreamQuery", NULL);
    LOAD(cuStreamWaitEvent, "cuStreamWaitEvent", NULL);
    LOAD(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync");
    LOAD(cuMemHostRegister, "cuMemHostRegister_v2", "cuMemHostRegister");
    LOAD(cuMemHostUnregister, "cuMemHostUnregister", NULL);
    LOAD(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer");
    LOAD(cuEventCreate, "cuEventCreate", NULL);
    LOAD(cuEventDestroy, "cuEventDestroy_v2", "cuEventDestroy");
    LOAD(cuEventRecord, "cuEventRecord", NULL);
    LOAD(cuEventSynchronize, "cuEventSynchronize", NULL);
    LOAD(cuEventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime");
    LOAD(cuModuleLoadDataEx, "cuModuleLoadDataEx", NULL);
    LOAD(cuModuleUnload, "cuModuleUnload", NULL);
    LOAD(cuModuleGetFunction, "cuModuleGetFunction", NULL);
    LOAD(cuFuncGetAttribute, "cuFuncGetAttribute", NULL);
    LOAD(cuLaunchKernel, "cuLaunchKernel", NULL);
    /* optional: graphs. cuda.h maps cuStreamBeginCapture to _v2 since 10.1 (the capture mode argument). */
    *(void **)&cu.cuStreamBeginCapture = sym(h, "cuStreamBeginCapture_v2", NULL);
    *(void **)&cu.cuStreamEndCapture = sym(h, "cuStreamEndCapture", NULL);
    *(void **)&cu.cuGraphInstantiateWithFlags = sym(h, "cuGraphInstantiateWithFlags", NULL);
    *(void **)&cu.cuGraphLaunch = sym(h, "cuGraphLaunch", NULL);
    *(void **)&cu.cuGraphExecDestroy = sym(h, "cuGraphExecDestroy", NULL);
    *(void **)&cu.cuGraphDestroy = sym(h, "cuGraphDestroy", NULL);
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

/* ================================================================================ compute */

/* "CUDA_ERROR_INVALID_VALUE (invalid argument)", or the number when the driver cannot name it. */
static const char *cu_err(CUresult rc, char *buf, size_t n) {
    const char *name = NULL, *text = NULL;
    if (cu.cuGetErrorName) cu.cuGetErrorName(rc, &name);
    if (cu.cuGetErrorString) cu.cuGetErrorString(rc, &text);
    if (name)
        snprintf(buf, n, "%s (%s)", name, text ? text : "no description");
    else
        snprintf(buf, n, "CUresult %d", rc);
    return buf;
}

/* Records a failed driver call; OUT_OF_MEMORY maps to LE_ERR_NO_MEMORY (the planner's
 * signal), every other CUresult to LE_ERR_DEVICE. */
#define CU_FAIL(rc, call_fmt, ...)                                                                   \
    do {                                                                                             \
        char cu_buf_[160];                                                                           \
        return LE_FAIL((rc) == CUDA_ERROR_OUT_OF_MEMORY ? LE_ERR_NO_MEMORY : LE_ERR_DEVICE,          \
                       call_fmt ": %s", __VA_ARGS__, cu_err((rc), cu_buf_, sizeof cu_buf_));         \
    } while (0)

/* Calls the driver and returns the failure, naming the call by its text. */
#define CU_CHECK(call)                                          \
    do {                                                        \
        CUresult rc_ = (call);                                  \
        if (rc_ != 0) CU_FAIL(rc_, "%s", #call);                \
    } while (0)

/* One bucket chain per hash of the pointer: the allocations and their sizes. */
typedef struct alloc_node {
    CUdeviceptr ptr;
    size_t bytes;
    struct alloc_node *next;
} alloc_node;
#define N_BUCKETS 1024

static struct {
    pthread_mutex_t lock;     /* guards everything below */
    int device;               /* -1 when not initialised */
    CUdevice dev;
    CUcontext ctx;
    unsigned generation;      /* bumped by every le_gpu_init: threads re-set the context */
    int64_t budget, used, peak, n_allocs, pinned;
    alloc_node *buckets[N_BUCKETS];        /* device allocations */
    alloc_node *pinned_buckets[N_BUCKETS]; /* pinned host allocations (ptr = the host address) */
} g = {PTHREAD_MUTEX_INITIALIZER, -1, 0, NULL, 0, -1, 0, 0, 0, 0, {NULL}, {NULL}};

static __thread unsigned tl_generation; /* the generation whose context this thread has current */
static __thread char tl_last_kernel[64]; /* this thread's last launch, named in asynchronous failures */
#define LAST_KERNEL (tl_last_kernel[0] ? tl_last_kernel : "none")

/* Makes the open context current on this thread (the driver's current context is per thread). */
static int ready(const char *what) {
    if (g.device < 0) return LE_FAIL(LE_ERR_INVALID_ARG, "%s: no GPU is open; call le_gpu_init first", what);
    if (tl_generation != g.generation) {
        CUresult rc = cu.cuCtxSetCurrent(g.ctx);
        if (rc != 0) CU_FAIL(rc, "cuCtxSetCurrent (for %s)", what);
        tl_generation = g.generation;
    }
    return LE_OK;
}

#define READY(what)                          \
    do {                                     \
        int st_ = ready(what);               \
        if (st_ != LE_OK) return st_;        \
    } while (0)

int le_gpu_init(int device) {
    if (!load_driver()) return LE_FAIL(LE_ERR_UNAVAILABLE, "no CUDA driver: %s", cu.reason);
    if (cu.missing)
        return LE_FAIL(LE_ERR_UNAVAILABLE, "the CUDA driver lacks %s (driver too old; CUDA 7.0+ needed)",
                       cu.missing);
    pthread_mutex_lock(&g.lock);
    int st = LE_OK;
    if (g.device == device) goto done;
    if (g.device >= 0) {
        st = LE_FAIL(LE_ERR_INVALID_ARG, "GPU %d is open; one device per process (le_gpu_shutdown first)",
                     g.device);
        goto done;
    }
    int count = 0;
    CUresult rc = cu.cuDeviceGetCount(&count);
    if (rc == 0 && (device < 0 || device >= count)) {
        st = LE_FAIL(LE_ERR_INVALID_ARG, "GPU %d does not exist (%d device(s))", device, count);
        goto done;
    }
    char buf[160];
    if (rc == 0) rc = cu.cuDeviceGet(&g.dev, device);
    if (rc == 0) {
        rc = cu.cuDevicePrimaryCtxRetain(&g.ctx, g.dev);
        if (rc != 0) {
            st = LE_FAIL(LE_ERR_DEVICE, "cuDevicePrimaryCtxRetain(device %d): %s", device, cu_err(rc, buf, sizeof buf));
            goto done;
        }
    }
    if (rc == 0) rc = cu.cuCtxSetCurrent(g.ctx);
    if (rc != 0) {
        st = LE_FAIL(LE_ERR_DEVICE, "opening GPU %d: %s", device, cu_err(rc, buf, sizeof buf));
        goto done;
    }
    g.device = device;
    g.generation++;
    tl_generation = g.generation;
    g.used = g.peak = g.n_allocs = g.pinned = 0;
done:
    pthread_mutex_unlock(&g.lock);
    return st;
}

int le_gpu_shutdown(void) {
    pthread_mutex_lock(&g.lock);
    if (g.device < 0) {
        pthread_mutex_unlock(&g.lock);
        return LE_OK;
    }
    for (int b = 0; b < N_BUCKETS; b++) {
        for (alloc_node *n = g.buckets[b], *next; n; n = next) {
            next = n->next;
            free(n);
        }
        g.buckets[b] = NULL;
        for (alloc_node *n = g.pinned_buckets[b], *next; n; n = next) {
            next = n->next;
            free(n);
        }
        g.pinned_buckets[b] = NULL;
    }
    g.used = g.n_allocs = g.pinned = 0;
    CUresult rc = cu.cuDevicePrimaryCtxRelease(g.dev);
    g.device = -1;
    g.ctx = NULL;
    pthread_mutex_unlock(&g.lock);
    if (rc != 0) CU_FAIL(rc, "%s", "cuDevicePrimaryCtxRelease");
    return LE_OK;
}

int le_gpu_current_device(void) { return g.device; }

int le_gpu_synchronize(void) {
    READY("le_gpu_synchronize");
    CUresult rc = cu.cuCtxSynchronize();
    if (rc != 0) CU_FAIL(rc, "cuCtxSynchronize (last kernel launched: %s)", LAST_KERNEL);
    return LE_OK;
}

int le_gpu_attribute(int attribute, int *out) {
    if (!out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_attribute: out is NULL");
    READY("le_gpu_attribute");
    CUresult rc = cu.cuDeviceGetAttribute(out, attribute, g.dev);
    if (rc != 0) CU_FAIL(rc, "cuDeviceGetAttribute(attribute %d)", attribute);
    return LE_OK;
}

/* ---- device memory ------------------------------------------------------------------ */

static unsigned bucket_of(CUdeviceptr p) { return (unsigned)((p >> 8) * 2654435761u) % N_BUCKETS; }

int le_gpu_set_budget(int64_t bytes) {
    pthread_mutex_lock(&g.lock);
    g.budget = bytes < 0 ? -1 : bytes;
    pthread_mutex_unlock(&g.lock);
    return LE_OK;
}

int le_gpu_get_mem_stats(le_gpu_mem_stats *out) {
    if (!out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_get_mem_stats: out is NULL");
    memset(out, 0, sizeof *out);
    READY("le_gpu_get_mem_stats");
    size_t free_b = 0, total_b = 0;
    CU_CHECK(cu.cuMemGetInfo(&free_b, &total_b));
    pthread_mutex_lock(&g.lock);
    out->budget = g.budget;
    out->used = g.used;
    out->peak = g.peak;
    out->n_allocs = g.n_allocs;
    out->pinned = g.pinned;
    pthread_mutex_unlock(&g.lock);
    out->free_bytes = (int64_t)free_b;
    out->total_bytes = (int64_t)total_b;
    return LE_OK;
}

int le_gpu_alloc(uint64_t *dptr, size_t bytes, const char *what) {
    if (!dptr) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_alloc: dptr is NULL");
    *dptr = 0;
    if (!what) what = "buffer";
    if (bytes == 0) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_alloc(%s): 0 bytes", what);
    READY("le_gpu_alloc");
    alloc_node *node = malloc(sizeof *node);
    if (!node) return LE_FAIL(LE_ERR_NO_MEMORY, "le_gpu_alloc(%s): host malloc failed", what);
    /* Reserve the bytes first, so that concurrent allocations cannot pass the budget together. */
    pthread_mutex_lock(&g.lock);
    if (g.budget >= 0 && g.used + (int64_t)bytes > g.budget) {
        const int64_t used = g.used, budget = g.budget;
        pthread_mutex_unlock(&g.lock);
        free(node);
        return LE_FAIL(LE_ERR_NO_MEMORY,
                       "GPU allocation of %zu bytes for %s exceeds the VRAM budget: %lld of %lld bytes in use, "
                       "%lld free under the budget; raise the budget or keep less on the GPU",
                       bytes, what, (long long)used, (long long)budget, (long long)(budget - used));
    }
    g.used += (int64_t)bytes;
    pthread_mutex_unlock(&g.lock);

    CUdeviceptr p = 0;
    CUresult rc = cu.cuMemAlloc(&p, bytes);
    pthread_mutex_lock(&g.lock);
    if (rc != 0) {
        g.used -= (int64_t)bytes;
        pthread_mutex_unlock(&g.lock);
        free(node);
        CU_FAIL(rc, "cuMemAlloc(%zu bytes for %s)", bytes, what);
    }
    node->ptr = p;
    node->bytes = bytes;
    const unsigned b = bucket_of(p);
    node->next = g.buckets[b];
    g.buckets[b] = node;
    g.n_allocs++;
    if (g.used > g.peak) g.peak = g.used;
    pthread_mutex_unlock(&g.lock);
    *dptr = (uint64_t)p;
    return LE_OK;
}

int le_gpu_free(uint64_t dptr) {
    if (dptr == 0) return LE_OK;
    READY("le_gpu_free");
    pthread_mutex_lock(&g.lock);
    alloc_node **link = &g.buckets[bucket_of(dptr)];
    while (*link && (*link)->ptr != dptr) link = &(*link)->next;
    alloc_node *node = *link;
    if (!node) {
        pthread_mutex_unlock(&g.lock);
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_free(0x%llx): not a pointer from le_gpu_alloc (freed twice?)",
                       (unsigned long long)dptr);
    }
    *link = node->next;
    g.used -= (int64_t)node->bytes;
    g.n_allocs--;
    pthread_mutex_unlock(&g.lock);
    free(node);
    CUresult rc = cu.cuMemFree((CUdeviceptr)dptr);
    if (rc != 0) CU_FAIL(rc, "cuMemFree(0x%llx)", (unsigned long long)dptr);
    return LE_OK;
}

int le_gpu_memset8(uint64_t dptr, int value, size_t bytes) {
    READY("le_gpu_memset8");
    CUresult rc = cu.cuMemsetD8((CUdeviceptr)dptr, (unsigned char)value, bytes);
    if (rc != 0) CU_FAIL(rc, "cuMemsetD8(0x%llx, %zu bytes)", (unsigned long long)dptr, bytes);
    return LE_OK;
}

int le_gpu_copy_htod(uint64_t dst, const void *src, size_t bytes) {
    READY("le_gpu_copy_htod");
    CUresult rc = cu.cuMemcpyHtoD((CUdeviceptr)dst, src, bytes);
    if (rc != 0) CU_FAIL(rc, "cuMemcpyHtoD(%zu bytes)", bytes);
    return LE_OK;
}

int le_gpu_copy_dtoh(void *dst, uint64_t src, size_t bytes) {
    READY("le_gpu_copy_dtoh");
    CUresult rc = cu.cuMemcpyDtoH(dst, (CUdeviceptr)src, bytes);
    if (rc != 0) CU_FAIL(rc, "cuMemcpyDtoH(%zu bytes; last kernel launched: %s)", bytes,
                         LAST_KERNEL);
    return LE_OK;
}

int le_gpu_copy_dtod(uint64_t dst, uint64_t src, size_t bytes) {
    READY("le_gpu_copy_dtod");
    CUresult rc = cu.cuMemcpyDtoD((CUdeviceptr)dst, (CUdeviceptr)src, bytes);
    if (rc != 0) CU_FAIL(rc, "cuMemcpyDtoD(%zu bytes)", bytes);
    return LE_OK;
}

int le_gpu_copy_dtod_async(uint64_t dst, uint64_t src, size_t bytes, le_gpu_stream *stream) {
    READY("le_gpu_copy_dtod_async");
    CUresult rc = cu.cuMemcpyDtoDAsync((CUdeviceptr)dst, (CUdeviceptr)src, bytes, (CUstream)stream);
    if (rc != 0) CU_FAIL(rc, "cuMemcpyDtoDAsync(%zu bytes)", bytes);
    return LE_OK;
}

int le_gpu_copy_htod_async(uint64_t dst, const void *src, size_t bytes, le_gpu_stream *stream) {
    READY("le_gpu_copy_htod_async");
    CUresult rc = cu.cuMemcpyHtoDAsync((CUdeviceptr)dst, src, bytes, (CUstream)stream);
    if (rc != 0) CU_FAIL(rc, "cuMemcpyHtoDAsync(%zu bytes)", bytes);
    return LE_OK;
}

int le_gpu_copy_dtoh_async(void *dst, uint64_t src, size_t bytes, le_gpu_stream *stream) {
    READY("le_gpu_copy_dtoh_async");
    CUresult rc = cu.cuMemcpyDtoHAsync(dst, (CUdeviceptr)src, bytes, (CUstream)stream);
    if (rc != 0) CU_FAIL(rc, "cuMemcpyDtoHAsync(%zu bytes)", bytes);
    return LE_OK;
}

int le_gpu_host_alloc(void **out, size_t bytes) {
    if (!out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_host_alloc: out is NULL");
    *out = NULL;
    if (bytes == 0) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_host_alloc: 0 bytes");
    READY("le_gpu_host_alloc");
    alloc_node *node = malloc(sizeof *node);
    if (!node) return LE_FAIL(LE_ERR_NO_MEMORY, "le_gpu_host_alloc: host malloc failed");
    CUresult rc = cu.cuMemAllocHost(out, bytes);
    if (rc != 0) {
        free(node);
        CU_FAIL(rc, "cuMemAllocHost(%zu bytes)", bytes);
    }
    node->ptr = (CUdeviceptr)(uintptr_t)*out;
    node->bytes = bytes;
    pthread_mutex_lock(&g.lock);
    const unsigned b = bucket_of(node->ptr);
    node->next = g.pinned_buckets[b];
    g.pinned_buckets[b] = node;
    g.pinned += (int64_t)bytes;
    pthread_mutex_unlock(&g.lock);
    return LE_OK;
}

int le_gpu_host_free(void *p) {
    if (!p) return LE_OK;
    READY("le_gpu_host_free");
    const CUdeviceptr key = (CUdeviceptr)(uintptr_t)p;
    pthread_mutex_lock(&g.lock);
    alloc_node **link = &g.pinned_buckets[bucket_of(key)];
    while (*link && (*link)->ptr != key) link = &(*link)->next;
    alloc_node *node = *link;
    if (!node) {
        pthread_mutex_unlock(&g.lock);
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_host_free(%p): not a pointer from le_gpu_host_alloc", p);
    }
    *link = node->next;
    g.pinned -= (int64_t)node->bytes;
    pthread_mutex_unlock(&g.lock);
    free(node);
    CU_CHECK(cu.cuMemFreeHost(p));
    return LE_OK;
}

/* Page-locks existing host memory (a weight map) for asynchronous copies, and maps it into the
 * device's address space (DEVICEMAP: kernels may read it in place, the hybrid decode's experts read
 * over the link). The range is widened to whole pages. read_only: the memory is mapped read-only
 * (a file map): the driver is told so (CU_MEMHOSTREGISTER_READ_ONLY, driver 11.1+). */
enum { CU_MEMHOSTREGISTER_DEVICEMAP = 0x02, CU_MEMHOSTREGISTER_READ_ONLY = 0x08 };

static void page_range(void *p, size_t bytes, void **base, size_t *len) {
    const uintptr_t a = (uintptr_t)p & ~(uintptr_t)4095, e = ((uintptr_t)p + bytes + 4095) & ~(uintptr_t)4095;
    *base = (void *)a;
    *len = e - a;
}

int le_gpu_host_register(void *p, size_t bytes, int read_only) {
    if (!p || !bytes) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_host_register: empty range");
    READY("le_gpu_host_register");
    void *base;
    size_t len;
    page_range(p, bytes, &base, &len);
    CUresult rc = cu.cuMemHostRegister(base, len,
                                       CU_MEMHOSTREGISTER_DEVICEMAP | (read_only ? CU_MEMHOSTREGISTER_READ_ONLY : 0));
    if (rc != 0) CU_FAIL(rc, "cuMemHostRegister(%zu bytes%s)", len, read_only ? ", read-only" : "");
    return LE_OK;
}

int le_gpu_host_device_pointer(void *p, uint64_t *out) {
    if (!p || !out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_host_device_pointer: a NULL argument");
    READY("le_gpu_host_device_pointer");
    CUdeviceptr d = 0;
    CU_CHECK(cu.cuMemHostGetDevicePointer(&d, p, 0));
    *out = (uint64_t)d;
    return LE_OK;
}

int le_gpu_host_unregister(void *p) {
    if (!p) return LE_OK;
    READY("le_gpu_host_unregister");
    void *base;
    size_t len;
    page_range(p, 1, &base, &len);
    CU_CHECK(cu.cuMemHostUnregister(base));
    return LE_OK;
}

/* ---- streams and events ---------------------------------------------------------------- */

int le_gpu_stream_create(le_gpu_stream **out) {
    if (!out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_stream_create: out is NULL");
    READY("le_gpu_stream_create");
    CUstream s = NULL;
    CU_CHECK(cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    *out = (le_gpu_stream *)s;
    return LE_OK;
}

int le_gpu_stream_create_ordered(le_gpu_stream **out) {
    if (!out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_stream_create_ordered: out is NULL");
    READY("le_gpu_stream_create_ordered");
    CUstream s = NULL;
    CU_CHECK(cu.cuStreamCreate(&s, CU_STREAM_DEFAULT));
    *out = (le_gpu_stream *)s;
    return LE_OK;
}

int le_gpu_stream_wait_event(le_gpu_stream *stream, le_gpu_event *event) {
    if (!event) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_stream_wait_event: event is NULL");
    READY("le_gpu_stream_wait_event");
    CU_CHECK(cu.cuStreamWaitEvent((CUstream)stream, (CUevent)event, 0));
    return LE_OK;
}

int le_gpu_stream_destroy(le_gpu_stream *stream) {
    if (!stream) return LE_OK;
    READY("le_gpu_stream_destroy");
    CU_CHECK(cu.cuStreamDestroy((CUstream)stream));
    return LE_OK;
}

int le_gpu_stream_query(le_gpu_stream *stream, int *done) {
    if (!done) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_stream_query: done is NULL");
    READY("le_gpu_stream_query");
    CUresult rc = cu.cuStreamQuery((CUstream)stream);
    if (rc != 0 && rc != 600) CU_FAIL(rc, "cuStreamQuery (last kernel launched: %s)", LAST_KERNEL); /* 600: not ready */
    *done = rc == 0;
    return LE_OK;
}

int le_gpu_stream_synchronize(le_gpu_stream *stream) {
    READY("le_gpu_stream_synchronize");
    CUresult rc = cu.cuStreamSynchronize((CUstream)stream);
    if (rc != 0) CU_FAIL(rc, "cuStreamSynchronize (last kernel launched: %s)", LAST_KERNEL);
    return LE_OK;
}

int le_gpu_event_create(le_gpu_event **out) {
    if (!out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_event_create: out is NULL");
    READY("le_gpu_event_create");
    CUevent e = NULL;
    CU_CHECK(cu.cuEventCreate(&e, CU_EVENT_DEFAULT));
    *out = (le_gpu_event *)e;
    return LE_OK;
}

int le_gpu_event_destroy(le_gpu_event *event) {
    if (!event) return LE_OK;
    READY("le_gpu_event_destroy");
    CU_CHECK(cu.cuEventDestroy((CUevent)event));
    return LE_OK;
}

int le_gpu_event_record(le_gpu_event *event, le_gpu_stream *stream) {
    if (!event) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_event_record: event is NULL");
    READY("le_gpu_event_record");
    CU_CHECK(cu.cuEventRecord((CUevent)event, (CUstream)stream));
    return LE_OK;
}

int le_gpu_event_synchronize(le_gpu_event *event) {
    if (!event) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_event_synchronize: event is NULL");
    READY("le_gpu_event_synchronize");
    CUresult rc = cu.cuEventSynchronize((CUevent)event);
    if (rc != 0) CU_FAIL(rc, "cuEventSynchronize (last kernel launched: %s)", LAST_KERNEL);
    return LE_OK;
}

int le_gpu_event_elapsed(float *ms, le_gpu_event *start, le_gpu_event *end) {
    if (!ms || !start || !end) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_event_elapsed: NULL argument");
    READY("le_gpu_event_elapsed");
    CU_CHECK(cu.cuEventElapsedTime(ms, (CUevent)start, (CUevent)end));
    return LE_OK;
}

/* ---- modules and launches --------------------------------------------------------------- */

struct le_gpu_kernel {
    CUfunction fn;
    char name[64];
    struct le_gpu_kernel *next;
};

struct le_gpu_module {
    CUmodule mod;
    char name[64];
    char info_log[JIT_LOG_BYTES];
    le_gpu_kernel *kernels;
};

/* PTX is text and must end in a NUL for the driver; cubins (ELF) and fatbins are binary. */
static int is_binary_image(const unsigned char *p, size_t n) {
    if (n >= 4 && p[0] == 0x7f && p[1] == 'E' && p[2] == 'L' && p[3] == 'F') return 1;
    if (n >= 4 && p[0] == 0x50 && p[1] == 0xed && p[2] == 0x55 && p[3] == 0xba) return 1; /* fatbin */
    return 0;
}

int le_gpu_module_load(le_gpu_module **out, const void *image, size_t bytes, const char *name) {
    if (!out || !image || bytes == 0) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_module_load: empty image");
    *out = NULL;
    if (!name) name = "module";
    READY("le_gpu_module_load");
    le_gpu_module *m = calloc(1, sizeof *m);
    char *err_log = calloc(1, JIT_LOG_BYTES);
    char *copy = NULL;
    const void *data = image;
    if (!m || !err_log) goto oom;
    if (!is_binary_image(image, bytes)) {
        copy = malloc(bytes + 1);
        if (!copy) goto oom;
        memcpy(copy, image, bytes);
        copy[bytes] = '\0';
        data = copy;
    }
    snprintf(m->name, sizeof m->name, "%s", name);
    int opts[5] = {CU_JIT_INFO_LOG_BUFFER, CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES, CU_JIT_ERROR_LOG_BUFFER,
                   CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, CU_JIT_LOG_VERBOSE};
    void *vals[5] = {m->info_log, (void *)(uintptr_t)JIT_LOG_BYTES, err_log, (void *)(uintptr_t)JIT_LOG_BYTES,
                     (void *)(uintptr_t)1};
    CUresult rc = cu.cuModuleLoadDataEx(&m->mod, data, 5, opts, vals);
    free(copy);
    if (rc != 0) {
        char buf[160];
        int st = LE_FAIL(LE_ERR_DEVICE, "cuModuleLoadDataEx(%s): %s; JIT log: %s", name, cu_err(rc, buf, sizeof buf),
                         err_log[0] ? err_log : "(empty)");
        free(err_log);
        free(m);
        return st;
    }
    free(err_log);
    *out = m;
    return LE_OK;
oom:
    free(m);
    free(err_log);
    free(copy);
    return LE_FAIL(LE_ERR_NO_MEMORY, "le_gpu_module_load(%s): host malloc failed", name);
}

const char *le_gpu_module_log(const le_gpu_module *module) { return module ? module->info_log : ""; }

int le_gpu_module_unload(le_gpu_module *module) {
    if (!module) return LE_OK;
    for (le_gpu_kernel *k = module->kernels, *next; k; k = next) {
        next = k->next;
        free(k);
    }
    CUmodule mod = module->mod;
    char name[64];
    snprintf(name, sizeof name, "%s", module->name);
    free(module);
    READY("le_gpu_module_unload");
    CUresult rc = cu.cuModuleUnload(mod);
    if (rc != 0) CU_FAIL(rc, "cuModuleUnload(%s)", name);
    return LE_OK;
}

int le_gpu_kernel_get(le_gpu_kernel **out, le_gpu_module *module, const char *name) {
    if (!out || !module || !name) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_kernel_get: NULL argument");
    *out = NULL;
    READY("le_gpu_kernel_get");
    for (le_gpu_kernel *k = module->kernels; k; k = k->next)
        if (strcmp(k->name, name) == 0) {
            *out = k;
            return LE_OK;
        }
    le_gpu_kernel *k = calloc(1, sizeof *k);
    if (!k) return LE_FAIL(LE_ERR_NO_MEMORY, "le_gpu_kernel_get(%s): host malloc failed", name);
    CUresult rc = cu.cuModuleGetFunction(&k->fn, module->mod, name);
    if (rc != 0) {
        free(k);
        CU_FAIL(rc, "cuModuleGetFunction(%s, \"%s\")", module->name, name);
    }
    snprintf(k->name, sizeof k->name, "%s", name);
    k->next = module->kernels;
    module->kernels = k;
    *out = k;
    return LE_OK;
}

int le_gpu_kernel_info_get(const le_gpu_kernel *kernel, le_gpu_kernel_info *out) {
    if (!kernel || !out) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_kernel_info_get: NULL argument");
    memset(out, 0, sizeof *out);
    READY("le_gpu_kernel_info_get");
    static const int attrs[6] = {CU_FUNC_REGS, CU_FUNC_SHARED, CU_FUNC_LOCAL, CU_FUNC_MAX_THREADS, CU_FUNC_PTX,
                                 CU_FUNC_BINARY};
    int *fields[6] = {&out->num_regs, &out->shared_bytes, &out->local_bytes, &out->max_threads, &out->ptx_version,
                      &out->binary_version};
    for (int i = 0; i < 6; i++) {
        CUresult rc = cu.cuFuncGetAttribute(fields[i], attrs[i], kernel->fn);
        if (rc != 0) CU_FAIL(rc, "cuFuncGetAttribute(%s, attribute %d)", kernel->name, attrs[i]);
    }
    return LE_OK;
}

int le_gpu_launch(const le_gpu_kernel *kernel, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                  unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                  le_gpu_stream *stream, void **params) {
    if (!kernel) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_launch: kernel is NULL");
    READY("le_gpu_launch");
    snprintf(tl_last_kernel, sizeof tl_last_kernel, "%s", kernel->name);
    CUresult rc = cu.cuLaunchKernel(kernel->fn, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes,
                                    (CUstream)stream, params, NULL);
    if (rc != 0)
        CU_FAIL(rc, "cuLaunchKernel(%s, grid %ux%ux%u, block %ux%ux%u, shared %u bytes)", kernel->name, grid_x,
                grid_y, grid_z, block_x, block_y, block_z, shared_bytes);
    return LE_OK;
}

int le_gpu_launch_packed(const le_gpu_kernel *kernel, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                         unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                         le_gpu_stream *stream, const char *kinds, const void *blob, size_t blob_bytes) {
    uint64_t vals[LE_GPU_MAX_ARGS]; /* the blob copied to 8-byte alignment: the caller's may have none */
    void *params[LE_GPU_MAX_ARGS];
    if (!kinds || (blob_bytes && !blob))
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_launch_packed: kinds or blob is NULL");
    if (blob_bytes > sizeof vals)
        return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_launch_packed: %zu bytes of arguments (at most %zu)", blob_bytes,
                       sizeof vals);
    if (blob_bytes) memcpy(vals, blob, blob_bytes);
    size_t off = 0;
    int n = 0;
    for (; kinds[n]; n++) {
        const size_t size = kinds[n] == 'p' || kinds[n] == 'q' ? 8 : 4;
        if (n == LE_GPU_MAX_ARGS || !strchr("pqiuf", kinds[n]))
            return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_launch_packed: bad kinds \"%s\"", kinds);
        off = (off + size - 1) / size * size;
        if (off + size > blob_bytes)
            return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_launch_packed: %zu bytes hold fewer arguments than \"%s\"",
                           blob_bytes, kinds);
        params[n] = (char *)vals + off;
        off += size;
    }
    return le_gpu_launch(kernel, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, stream,
                         n ? params : NULL);
}

/* ---- CUDA graphs ------------------------------------------------------------------------ */

int le_gpu_graphs_available(void) {
    return load_driver() && cu.cuStreamBeginCapture && cu.cuStreamEndCapture && cu.cuGraphInstantiateWithFlags &&
           cu.cuGraphLaunch && cu.cuGraphExecDestroy && cu.cuGraphDestroy;
}

#define GRAPHS(fn)                                                                                    \
    do {                                                                                              \
        READY(fn);                                                                                    \
        if (!le_gpu_graphs_available())                                                               \
            return LE_FAIL(LE_ERR_UNSUPPORTED, fn ": the driver has no CUDA graphs (needs CUDA 11.4+)"); \
    } while (0)

int le_gpu_capture_begin(le_gpu_stream *stream) {
    if (!stream) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_capture_begin: the default stream cannot be captured");
    GRAPHS("le_gpu_capture_begin");
    CU_CHECK(cu.cuStreamBeginCapture((CUstream)stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    return LE_OK;
}

int le_gpu_capture_end(le_gpu_stream *stream, le_gpu_graph **out) {
    if (!stream) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_capture_end: stream is NULL");
    GRAPHS("le_gpu_capture_end");
    CUgraph graph = NULL;
    CUgraphExec exec = NULL;
    CU_CHECK(cu.cuStreamEndCapture((CUstream)stream, &graph));  /* always ends the capture, even on error */
    if (!out) {                                                  /* abandon the capture */
        if (graph) cu.cuGraphDestroy(graph);
        return LE_OK;
    }
    CUresult rc = cu.cuGraphInstantiateWithFlags(&exec, graph, 0);
    cu.cuGraphDestroy(graph);
    if (rc != 0) CU_FAIL(rc, "%s", "cuGraphInstantiateWithFlags");
    *out = (le_gpu_graph *)exec;
    return LE_OK;
}

int le_gpu_graph_launch(le_gpu_graph *graph, le_gpu_stream *stream) {
    if (!graph) return LE_FAIL(LE_ERR_INVALID_ARG, "le_gpu_graph_launch: graph is NULL");
    GRAPHS("le_gpu_graph_launch");
    snprintf(tl_last_kernel, sizeof tl_last_kernel, "%s", "(a CUDA graph)");
    CU_CHECK(cu.cuGraphLaunch((CUgraphExec)graph, (CUstream)stream));
    return LE_OK;
}

int le_gpu_graph_destroy(le_gpu_graph *graph) {
    if (!graph) return LE_OK;
    GRAPHS("le_gpu_graph_destroy");
    CU_CHECK(cu.cuGraphExecDestroy((CUgraphExec)graph));
    return LE_OK;
}
