// A malloc interposer for bench/fsdp_compare.sh (LD_PRELOAD): counts the bytes the process holds
// through malloc and friends (malloc_usable_size of each block) and their peak, so that Tandem
// (C++) and PyTorch (Python) are measured by one meter. Tensor memory on both sides comes from
// posix_memalign; shared-memory segments and file mappings are not counted.
// The program reads it through the symbols below (dlsym / ctypes):
//   heap_peak_reset()  peak := live; returns live
//   heap_peak_bytes()  the peak since the last reset
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stddef.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

static long long g_live, g_peak;

static void* counted(void* p) {
  if (p) {
    long long now = __atomic_add_fetch(&g_live, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
    long long peak = __atomic_load_n(&g_peak, __ATOMIC_RELAXED);
    while (now > peak && !__atomic_compare_exchange_n(&g_peak, &peak, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
  }
  return p;
}
static void uncount(void* p) {
  if (p) __atomic_sub_fetch(&g_live, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
}

long long heap_peak_reset(void) {
  long long live = __atomic_load_n(&g_live, __ATOMIC_RELAXED);
  __atomic_store_n(&g_peak, live, __ATOMIC_RELAXED);
  return live;
}
long long heap_peak_bytes(void) { return __atomic_load_n(&g_peak, __ATOMIC_RELAXED); }

void* malloc(size_t n) { return counted(__libc_malloc(n)); }
void* calloc(size_t k, size_t n) { return counted(__libc_calloc(k, n)); }
void free(void* p) {
  uncount(p);
  __libc_free(p);
}
void* realloc(void* p, size_t n) {
  uncount(p);
  return counted(__libc_realloc(p, n));
}
void* memalign(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void* aligned_alloc(size_t a, size_t n) { return counted(__libc_memalign(a, n)); }
void* valloc(size_t n) { return counted(__libc_memalign(4096, n)); }
int posix_memalign(void** out, size_t a, size_t n) {
  void* p = counted(__libc_memalign(a, n));
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
