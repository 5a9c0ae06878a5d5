// A memory meter for bench/fsdp_compare.sh (LD_PRELOAD), one for Tandem (C++) and PyTorch (Python)
// alike. It counts the bytes the process holds through malloc and friends (malloc_usable_size of
// each block; tensor memory on both sides comes from posix_memalign) and their peak. Shared
// mappings (MPI's segments, Tandem's symmetric blocks), which malloc does not see, are sampled
// by a thread every HEAP_PEAK_SAMPLE_US microseconds (default 1000; 0: off): the resident pages of
// every shared mapping (mincore), divided by the ranks on the node (OMPI_COMM_WORLD_LOCAL_SIZE),
// since every local rank maps them all: a rank's proportional share, as /proc's Pss counts it.
// The combined peak of one sample is the most the heap held since the previous sample plus the
// larger of the two samples' shared bytes, so it never misses a peak of the heap between samples.
// The program reads it through the symbols below (dlsym / ctypes):
//   heap_peak_reset()  peaks := now; finds the shared mappings; returns the heap's live bytes
//   heap_peak_bytes()  the heap's peak since the last reset
//   heap_peak_total()  the combined peak (heap + shared share) since the last reset
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

extern void* __libc_malloc(size_t);
extern void* __libc_calloc(size_t, size_t);
extern void* __libc_realloc(void*, size_t);
extern void* __libc_memalign(size_t, size_t);
extern void __libc_free(void*);

static long long g_live, g_peak, g_interval, g_total;

static void raise_to(long long* v, long long now) {
  long long old = __atomic_load_n(v, __ATOMIC_RELAXED);
  while (now > old && !__atomic_compare_exchange_n(v, &old, now, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
}
static void* counted(void* p) {
  if (p) {
    long long now = __atomic_add_fetch(&g_live, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
    raise_to(&g_peak, now);
    raise_to(&g_interval, now);
  }
  return p;
}
static void uncount(void* p) {
  if (p) __atomic_sub_fetch(&g_live, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
}

// ---- shared mappings

#define MAX_MAPS 64
static struct {
  unsigned long lo, hi;
} g_maps[MAX_MAPS];
static int g_nmaps;
static unsigned char* g_vec;  // mincore's output, one byte per page of the largest mapping
static pthread_mutex_t g_maps_mu = PTHREAD_MUTEX_INITIALIZER;

static void find_shared_mappings(void) {
  FILE* f = fopen("/proc/self/maps", "r");
  if (!f) return;
  char line[512];
  unsigned long most = 0;
  pthread_mutex_lock(&g_maps_mu);
  g_nmaps = 0;
  while (fgets(line, sizeof line, f) && g_nmaps < MAX_MAPS) {
    unsigned long lo, hi;
    char perms[8];
    if (sscanf(line, "%lx-%lx %7s", &lo, &hi, perms) == 3 && perms[3] == 's') {
      g_maps[g_nmaps].lo = lo;
      g_maps[g_nmaps].hi = hi;
      ++g_nmaps;
      if (hi - lo > most) most = hi - lo;
    }
  }
  fclose(f);
  __libc_free(g_vec);
  g_vec = __libc_malloc(most / (unsigned long)sysconf(_SC_PAGESIZE) + 1);
  pthread_mutex_unlock(&g_maps_mu);
}

static long long shared_share(void) {
  const long page = sysconf(_SC_PAGESIZE);
  const char* local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const long ranks = local && atol(local) > 0 ? atol(local) : 1;
  long long pages = 0;
  pthread_mutex_lock(&g_maps_mu);
  for (int m = 0; m < g_nmaps && g_vec; ++m) {
    const unsigned long n = (g_maps[m].hi - g_maps[m].lo) / (unsigned long)page;
    if (mincore((void*)g_maps[m].lo, n * (unsigned long)page, g_vec) != 0) continue;  // unmapped since
    for (unsigned long i = 0; i < n; ++i) pages += g_vec[i] & 1;
  }
  pthread_mutex_unlock(&g_maps_mu);
  return pages * page / ranks;
}

static long long g_shared_last;

static void* sampler(void* arg) {
  const long us = (long)(size_t)arg;
  const struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  for (;;) {
    nanosleep(&ts, NULL);
    const long long shared = shared_share();
    const long long heap = __atomic_exchange_n(&g_interval, __atomic_load_n(&g_live, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    const long long before = __atomic_exchange_n(&g_shared_last, shared, __ATOMIC_RELAXED);
    raise_to(&g_total, heap + (shared > before ? shared : before));
  }
  return NULL;
}

long long heap_peak_reset(void) {
  static int started;
  find_shared_mappings();
  const long long live = __atomic_load_n(&g_live, __ATOMIC_RELAXED);
  const long long shared = shared_share();
  __atomic_store_n(&g_peak, live, __ATOMIC_RELAXED);
  __atomic_store_n(&g_interval, live, __ATOMIC_RELAXED);
  __atomic_store_n(&g_shared_last, shared, __ATOMIC_RELAXED);
  __atomic_store_n(&g_total, live + shared, __ATOMIC_RELAXED);
  const char* env = getenv("HEAP_PEAK_SAMPLE_US");
  const long us = env ? atol(env) : 1000;
  if (!started && us > 0) {
    started = 1;
    pthread_t t;
    if (pthread_create(&t, NULL, sampler, (void*)(size_t)us) == 0) pthread_detach(t);
  }
  return live;
}
long long heap_peak_bytes(void) { return __atomic_load_n(&g_peak, __ATOMIC_RELAXED); }
long long heap_peak_total(void) {
  // A last sample, so that a peak after the sampler's last wake-up counts too.
  const long long shared = shared_share();
  const long long before = __atomic_load_n(&g_shared_last, __ATOMIC_RELAXED);
  raise_to(&g_total, __atomic_load_n(&g_interval, __ATOMIC_RELAXED) + (shared > before ? shared : before));
  return __atomic_load_n(&g_total, __ATOMIC_RELAXED);
}

// ---- the interposed allocator

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
