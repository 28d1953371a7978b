/* status.c — status codes to text, and the thread-local last error (file:line: message). */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "le_internal.h"

static _Thread_local char last_error[512];

const char *le_strerror(int code) {
    switch (code) {
    case LE_OK: return "ok";
    case LE_ERR_INVALID_ARG: return "invalid argument";
    case LE_ERR_UNSUPPORTED: return "unsupported";
    case LE_ERR_NO_MEMORY: return "out of memory";
    case LE_ERR_UNAVAILABLE: return "unavailable";
    case LE_ERR_DEVICE: return "device error";
    case LE_ERR_FORMAT: return "format error";
    case LE_ERR_TIMEOUT: return "timed out";
    default: return "unknown status code";
    }
}

const char *le_last_error(void) { return last_error; }

void le_clear_error(void) { last_error[0] = 0; }

int le_set_error(int code, const char *file, int line, const char *fmt, ...) {
    const char *base = strrchr(file, '/');
    int n = snprintf(last_error, sizeof last_error, "%s:%d: ", base ? base + 1 : file, line);
    if (n < 0 || n >= (int)sizeof last_error) return code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
    va_end(ap);
    return code;
}
