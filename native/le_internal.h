/* le_internal.h — helpers shared by the C core's own files (not part of the cffi API). */
#ifndef LE_INTERNAL_H
#define LE_INTERNAL_H

#include "le_status.h"

/* Records "file:line: message" as the thread's last error and returns code. */
int le_set_error(int code, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define LE_FAIL(code, ...) le_set_error((code), __FILE__, __LINE__, __VA_ARGS__)

#endif
