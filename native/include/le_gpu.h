/* le_gpu.h — the CUDA driver API as the engine uses it (native/gpu.c; libcuda dlopened).
 *
 * One device per process: le_gpu_init(dev) retains that device's primary context and
 * every other call makes it current on the calling thread. Device memory is addressed
 * by uint64_t (CUdeviceptr). Streams and events are opaque handles; a NULL stream is the
 * default stream. Every call returns an le_status:
 *   LE_ERR_UNAVAILABLE  no driver / no device / an entry point the driver lacks,
 *   LE_ERR_DEVICE       a driver call failed: the message names the call, the CUresult
 *                       name (cuGetErrorName) and, for launches, the kernel,
 *   LE_ERR_NO_MEMORY    the VRAM budget would be exceeded (checked before the driver is
 *                       called) or the driver itself is out of memory,
 *   LE_ERR_INVALID_ARG  NULL/zero arguments, a call before le_gpu_init, an unknown pointer.
 * Kernels are PTX or cubin images (cuda8/, built by legacy_engine.gpu) loaded with
 * cuModuleLoadDataEx; a failed JIT puts the JIT's error log into the message.
 * This header is fed to cffi's cdef: declarations only, no macros. */
#ifndef LE_GPU_H
#define LE_GPU_H

#include <stddef.h>
#include <stdint.h>

typedef struct le_gpu_module le_gpu_module; /* a loaded image (CUmodule) and its JIT log */
typedef struct le_gpu_kernel le_gpu_kernel; /* a __global__ function of a module, with its name */
typedef struct le_gpu_stream le_gpu_stream; /* a CUstream; NULL = the default stream */
typedef struct le_gpu_graph le_gpu_graph;   /* an instantiated CUDA graph (CUgraphExec) */
typedef struct le_gpu_event le_gpu_event;   /* a CUevent (timing enabled) */

/* ---- context ---------------------------------------------------------------------- */

/* Retains the primary context of device `device` and makes it current. Calling it again
 * with the same device does nothing; another device while one is open is an error. */
int le_gpu_init(int device);
/* Releases the primary context (after every buffer and module was freed); resets the
 * allocation accounting. le_gpu_init may be called again afterwards. */
int le_gpu_shutdown(void);
/* The device le_gpu_init opened, -1 when none. */
int le_gpu_current_device(void);
/* Waits for all work on the device (cuCtxSynchronize); a failure names the last kernel launched. */
int le_gpu_synchronize(void);
/* cuDeviceGetAttribute of the open device (CUdevice_attribute ids, e.g. 36 memory clock
 * in kHz, 37 memory bus width in bits). */
int le_gpu_attribute(int attribute, int *out);

/* ---- device memory, with a VRAM budget ------------------------------------------------ */

typedef struct {
    int64_t budget;      /* bytes the engine may allocate; -1 = no budget */
    int64_t used;        /* bytes allocated now through le_gpu_alloc */
    int64_t peak;        /* the most `used` has been since le_gpu_init */
    int64_t n_allocs;    /* live allocations */
    int64_t pinned;      /* bytes of pinned host memory held now (le_gpu_host_alloc), not in used */
    int64_t free_bytes;  /* cuMemGetInfo: free on the device now (all processes) */
    int64_t total_bytes; /* cuMemGetInfo: the device's memory */
} le_gpu_mem_stats;

/* Sets the budget in bytes (< 0: none). Allocations beyond it fail with LE_ERR_NO_MEMORY
 * before the driver is asked; a budget below what is in use only stops new allocations. */
int le_gpu_set_budget(int64_t bytes);
int le_gpu_get_mem_stats(le_gpu_mem_stats *out);

/* *dptr = `bytes` of device memory (cuMemAlloc); `what` names the buffer in error messages
 * (may be NULL). */
int le_gpu_alloc(uint64_t *dptr, size_t bytes, const char *what);
/* Frees a pointer returned by le_gpu_alloc; 0 is a no-op; an unknown pointer is an error. */
int le_gpu_free(uint64_t dptr);
int le_gpu_memset8(uint64_t dptr, int value, size_t bytes);

int le_gpu_copy_htod(uint64_t dst, const void *src, size_t bytes);
int le_gpu_copy_dtoh(void *dst, uint64_t src, size_t bytes);
int le_gpu_copy_dtod(uint64_t dst, uint64_t src, size_t bytes);
/* Asynchronous on `stream`; the host buffer must stay alive (and should be pinned) until
 * the stream has passed the copy. */
int le_gpu_copy_htod_async(uint64_t dst, const void *src, size_t bytes, le_gpu_stream *stream);
int le_gpu_copy_dtod_async(uint64_t dst, uint64_t src, size_t bytes, le_gpu_stream *stream);
int le_gpu_copy_dtoh_async(void *dst, uint64_t src, size_t bytes, le_gpu_stream *stream);

/* Pinned (page-locked) host memory for fast and asynchronous copies (cuMemAllocHost). */
int le_gpu_host_alloc(void **out, size_t bytes);
int le_gpu_host_free(void *p);
/* Page-locks existing host memory [p, p+bytes) (widened to whole pages) so that async copies from it
 * run at full link speed, and maps it for the device (kernels may read it in place); read_only for a
 * read-only map (driver 11.1+). Unregister with the same p. */
int le_gpu_host_register(void *p, size_t bytes, int read_only);
int le_gpu_host_unregister(void *p);
/* The device address of host address p inside page-locked memory (le_gpu_host_alloc, or registered). */
int le_gpu_host_device_pointer(void *p, uint64_t *out);

/* ---- streams and events ------------------------------------------------------------- */

/* A stream that does not wait for, nor is waited for by, the default stream. */
int le_gpu_stream_create(le_gpu_stream **out);
/* A stream ordered with the legacy default stream both ways (cuStreamCreate flags 0): work on
 * it starts after earlier default-stream work and later default-stream work waits for it. */
int le_gpu_stream_create_ordered(le_gpu_stream **out);
int le_gpu_stream_destroy(le_gpu_stream *stream);
int le_gpu_stream_synchronize(le_gpu_stream *stream);
/* *done = 1 when every operation on the stream has completed, else 0 (never waits). */
int le_gpu_stream_query(le_gpu_stream *stream, int *done);
/* Work launched on `stream` after this waits for `event` (recorded on any stream). */
int le_gpu_stream_wait_event(le_gpu_stream *stream, le_gpu_event *event);
int le_gpu_event_create(le_gpu_event **out);
int le_gpu_event_destroy(le_gpu_event *event);
int le_gpu_event_record(le_gpu_event *event, le_gpu_stream *stream);
int le_gpu_event_synchronize(le_gpu_event *event);
/* *ms = time between two recorded, completed events. */
int le_gpu_event_elapsed(float *ms, le_gpu_event *start, le_gpu_event *end);

/* ---- modules and launches ------------------------------------------------------------ */

/* Loads a PTX text (need not end in a NUL) or a cubin / fatbin image. `name` labels the
 * module in messages. On a JIT failure the message carries the JIT's error log. */
int le_gpu_module_load(le_gpu_module **out, const void *image, size_t bytes, const char *name);
/* The JIT's info log of a loaded module (registers, spills ...); "" when none. */
const char *le_gpu_module_log(const le_gpu_module *module);
/* Unloads the module and frees its kernels. */
int le_gpu_module_unload(le_gpu_module *module);

/* *out = the kernel `name` of `module` (owned by the module). */
int le_gpu_kernel_get(le_gpu_kernel **out, le_gpu_module *module, const char *name);

typedef struct {
    int num_regs;        /* registers per thread */
    int shared_bytes;    /* static shared memory per block */
    int local_bytes;     /* local memory per thread (spills) */
    int max_threads;     /* the most threads per block this kernel can be launched with */
    int ptx_version;     /* major*10+minor of the PTX target it was compiled for (35, 61 ...) */
    int binary_version;  /* major*10+minor of the machine code (90 on a Hopper) */
} le_gpu_kernel_info;

int le_gpu_kernel_info_get(const le_gpu_kernel *kernel, le_gpu_kernel_info *out);

/* cuLaunchKernel: params[i] points at the i-th argument's value. */
int le_gpu_launch(const le_gpu_kernel *kernel, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                  unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                  le_gpu_stream *stream, void **params);

/* le_gpu_launch with the arguments packed in one buffer: kinds has one letter per argument (p: 8-byte pointer,
 * q: int64, i: int32, u: uint32, f: float; at most LE_GPU_MAX_ARGS) and blob holds their values in that order, each
 * at the next multiple of its size (C's natural alignment: Python's struct.pack with "@"). One call and one buffer
 * per launch instead of a pointer array and an allocation per argument. */
#define LE_GPU_MAX_ARGS 32
int le_gpu_launch_packed(const le_gpu_kernel *kernel, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                         unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                         le_gpu_stream *stream, const char *kinds, const void *blob, size_t blob_bytes);

/* ---- CUDA graphs (driver 11.4+) ------------------------------------------------------- */

/* 1 when the driver exports the graph entry points below, else 0 (they then fail with
 * LE_ERR_UNSUPPORTED). */
int le_gpu_graphs_available(void);
/* Launches on `stream` (not the default stream) between begin and end are recorded, not run;
 * end instantiates them as *out (out NULL: the capture is abandoned). */
int le_gpu_capture_begin(le_gpu_stream *stream);
int le_gpu_capture_end(le_gpu_stream *stream, le_gpu_graph **out);
/* Runs the whole graph on `stream` (asynchronous, like the launches it holds). */
int le_gpu_graph_launch(le_gpu_graph *graph, le_gpu_stream *stream);
int le_gpu_graph_destroy(le_gpu_graph *graph);

#endif
