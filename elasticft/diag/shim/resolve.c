/*
 * Finding the real NCCL (docs/nccl-shim.md): dlsym(RTLD_NEXT) first, which finds a libnccl in
 * the global scope; then every object the process has loaded, in load order (dl_iterate_phdr,
 * dlopen(path, RTLD_NOLOAD), dlsym on that handle), skipping the shim's own image. The second
 * search finds the libnccl that torch loads as a DT_NEEDED of libtorch_cuda.so in a local
 * (RTLD_LOCAL) scope, an NCCL linked statically into another library that exports it, and an
 * NCCL loaded after the shim started. Each symbol is resolved once; a symbol that no loaded
 * object defines is searched again at the next call (NCCL may be loaded later).
 */
#include "shim.h"

#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *g_self_base;                /* load address of this shim */
static pthread_mutex_t g_resolve_lock = PTHREAD_MUTEX_INITIALIZER;
static void *g_hint;                     /* handle of the object that defined the last symbol */

static void *self_base(void) {
    if (!g_self_base) {
        Dl_info info;
        if (dladdr((void *)&self_base, &info)) g_self_base = info.dli_fbase;
    }
    return g_self_base;
}

static int in_self(void *addr) {
    Dl_info info;
    return dladdr(addr, &info) && info.dli_fbase == self_base();
}

typedef struct { char **paths; size_t n, cap; } object_list_t;

static int collect_object(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    object_list_t *list = data;
    /* The main program's own definitions would have bound before the shim's; the shim skips
     * itself. Everything else is a candidate, in load order. */
    if (!info->dlpi_name || !info->dlpi_name[0]) return 0;
    /* g_self_base, not self_base(): dladdr takes the loader's lock, and dl_iterate_phdr holds
     * another one while it calls back (the opposite order of dlopen's: a deadlock). */
    if ((void *)info->dlpi_addr == g_self_base) return 0;
    if (list->n == list->cap) {
        size_t cap = list->cap ? list->cap * 2 : 64;
        char **grown = realloc(list->paths, cap * sizeof *grown);
        if (!grown) return 1;
        list->paths = grown;
        list->cap = cap;
    }
    char *copy = strdup(info->dlpi_name);
    if (copy) list->paths[list->n++] = copy;
    return 0;
}

/* Looks the symbol up in every loaded object; dlopen runs outside dl_iterate_phdr's callback,
 * which holds the loader's lock. Called with g_resolve_lock held. */
static void *search_loaded(const char *name) {
    if (g_hint) {
        void *fn = dlsym(g_hint, name);
        if (fn && !in_self(fn)) return fn;
    }
    object_list_t list = {0};
    self_base();
    dl_iterate_phdr(collect_object, &list);
    void *found = NULL;
    for (size_t i = 0; i < list.n; i++) {
        if (!found) {
            void *handle = dlopen(list.paths[i], RTLD_LAZY | RTLD_NOLOAD);
            if (handle) {
                void *fn = dlsym(handle, name);
                if (fn && !in_self(fn)) {
                    found = fn;
                    if (g_hint) dlclose(g_hint);
                    g_hint = handle; /* kept open: NCCL is in use from now on */
                    handle = NULL;
                }
                if (handle) dlclose(handle);
            }
        }
        free(list.paths[i]);
    }
    free(list.paths);
    return found;
}

void *find_real(const char *name) {
    void *fn = dlsym(RTLD_NEXT, name);
    if (fn && !in_self(fn)) return fn;
    pthread_mutex_lock(&g_resolve_lock);
    fn = search_loaded(name);
    pthread_mutex_unlock(&g_resolve_lock);
    return fn;
}

void *resolve(real_t *real) {
    void *fn = __atomic_load_n(&real->fn, __ATOMIC_ACQUIRE);
    if (LIKELY(fn != NULL)) return fn;
    fn = find_real(real->name);
    if (fn) {
        __atomic_store_n(&real->fn, fn, __ATOMIC_RELEASE);
    } else if (!__atomic_exchange_n(&real->warned, 1, __ATOMIC_RELAXED)) {
        /* Nothing in the process defines it: without the shim the caller could not have bound
         * to it either (the loader's "undefined symbol"). */
        fprintf(stderr, "elasticft NCCL shim: %s is defined by no loaded library; "
                        "returning ncclInternalError\n", real->name);
    }
    return fn;
}

