/* le_status.h — status codes and the thread-local last-error message.
 * The C core never exits or prints: every entry point returns an le_status,
 * and le_last_error() says what went wrong and where (file:line).
 * This header is fed to cffi's cdef: declarations only, no macros. */
#ifndef LE_STATUS_H
#define LE_STATUS_H

typedef enum {
    LE_OK = 0,
    LE_ERR_INVALID_ARG = 1,   /* a NULL pointer, a negative size, a size not a multiple of the block */
    LE_ERR_UNSUPPORTED = 2,   /* a type or feature this build or machine does not have */
    LE_ERR_NO_MEMORY = 3,     /* an allocation failed */
    LE_ERR_UNAVAILABLE = 4,   /* an optional library (libnuma, libcuda) is absent */
    LE_ERR_DEVICE = 5,        /* a driver call failed; the message names the call */
    LE_ERR_FORMAT = 6,        /* malformed input data */
    LE_ERR_TIMEOUT = 7        /* a wait for the other side (the GPU) ran out of time */
} le_status;

const char *le_strerror(int code);
const char *le_last_error(void);
void le_clear_error(void);

#endif
