#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <pthread.h>
#include <unistd.h>
#include <fcntl.h>

#define MIN_SIZE (64 * 1024)
static int fd = -1;
static volatile int on = 0;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned long seq = 0;
static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static int (*real_pm)(void **, size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static void *(*real_calloc)(size_t, size_t);
/* remember big live pointers so free() logs only those */
#define TAB (1 << 20)
static uintptr_t keys[TAB];
static size_t sizes[TAB];
static void put(void *p, size_t s) {
  uintptr_t h = ((uintptr_t)p >> 6) & (TAB - 1);
  while (keys[h] && keys[h] != (uintptr_t)-1) h = (h + 1) & (TAB - 1);
  keys[h] = (uintptr_t)p; sizes[h] = s;
}
static size_t take(void *p) {
  uintptr_t h = ((uintptr_t)p >> 6) & (TAB - 1);
  while (keys[h]) { if (keys[h] == (uintptr_t)p) { keys[h] = (uintptr_t)-1; return sizes[h]; } h = (h + 1) & (TAB - 1); }
  return 0;
}
static void emit(char c, void *p, size_t s) {
  char buf[96];
  int n = snprintf(buf, sizeof buf, "%c %lu %lx %zu %ld\n", c, seq++, (unsigned long)p, s, (long)gettid());
  write(fd, buf, n);
}
void trace_mark(int m) { if (fd < 0) return; pthread_mutex_lock(&mu); char buf[64]; int n = snprintf(buf, sizeof buf, "M %lu %d\n", seq++, m); write(fd, buf, n); pthread_mutex_unlock(&mu); }
void trace_on(int v) { if (fd < 0) { const char *f = getenv("MTRACE_FILE"); fd = open(f ? f : "/tmp/mtrace.txt", O_WRONLY | O_CREAT | O_TRUNC, 0644); } on = v; }
static void init(void) {
  if (real_malloc) return;
  real_malloc = dlsym(RTLD_NEXT, "malloc"); real_free = dlsym(RTLD_NEXT, "free");
  real_pm = dlsym(RTLD_NEXT, "posix_memalign"); real_realloc = dlsym(RTLD_NEXT, "realloc");
  real_calloc = dlsym(RTLD_NEXT, "calloc");
}
void *malloc(size_t s) { init(); void *p = real_malloc(s); if (on && s >= MIN_SIZE && p) { pthread_mutex_lock(&mu); put(p, s); emit('A', p, s); pthread_mutex_unlock(&mu); } return p; }
int posix_memalign(void **pp, size_t a, size_t s) { init(); int r = real_pm(pp, a, s); if (on && !r && s >= MIN_SIZE) { pthread_mutex_lock(&mu); put(*pp, s); emit('A', *pp, s); pthread_mutex_unlock(&mu); } return r; }
void free(void *p) { init(); if (on && p) { pthread_mutex_lock(&mu); size_t s = take(p); if (s) emit('F', p, s); pthread_mutex_unlock(&mu); } real_free(p); }
