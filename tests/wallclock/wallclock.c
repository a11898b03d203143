/* A wall clock that an operator's `date -s`, an NTP step or a VM resume
 * could have moved: preloaded (LD_PRELOAD), it adds the whole seconds
 * written in the file $WALLCLOCK_OFFSET_FILE (re-read every 20 ms) to
 * CLOCK_REALTIME, gettimeofday() and time(). The monotonic clocks are left
 * alone, as a step leaves them. A second number in the file is a rate:
 * from when it is first read, the wall clock runs that many times as fast
 * as the real one (a clock drifting; 1 when absent).
 *
 * libfaketime does this too, but cannot run under a program linked with
 * jemalloc (redis-server): jemalloc reads the clock while libfaketime is
 * still initialising. This shim allocates nothing and reads the clocks with
 * raw system calls, so it needs no initialisation. (tests/clocks.rs) */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static volatile long offset_s;
static volatile long long next_read_ns;
static volatile double rate = 1.0;
/* The monotonic time the current rate was first read, and what earlier
 * rates had added by then (a new rate bends the clock, never steps it). */
static volatile long long rate_since_ns;
static volatile long long drifted_ns;

static int raw(clockid_t id, struct timespec *ts) {
  return (int)syscall(SYS_clock_gettime, id, ts);
}

static void refresh(void) {
  struct timespec m;
  if (raw(CLOCK_MONOTONIC, &m) != 0) return;
  long long now = (long long)m.tv_sec * 1000000000LL + m.tv_nsec;
  if (now < next_read_ns) return;
  next_read_ns = now + 20000000LL;
  const char *path = getenv("WALLCLOCK_OFFSET_FILE");
  if (!path) return;
  int fd = (int)syscall(SYS_openat, AT_FDCWD, path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return;
  char buf[32];
  long n = syscall(SYS_read, fd, buf, sizeof buf - 1);
  syscall(SYS_close, fd);
  if (n <= 0) return;
  buf[n] = 0;
  char *end;
  offset_s = strtol(buf, &end, 10);
  double r = strtod(end, &end);
  if (r <= 0) r = 1.0;
  if (r != rate) {
    drifted_ns += (long long)((rate - 1.0) * (double)(now - rate_since_ns));
    rate = r;
    rate_since_ns = now;
  }
}

/* Nanoseconds the rates have added so far. */
static long long drift_ns(void) {
  if (rate == 1.0) return drifted_ns;
  struct timespec m;
  if (raw(CLOCK_MONOTONIC, &m) != 0) return 0;
  long long now = (long long)m.tv_sec * 1000000000LL + m.tv_nsec;
  return drifted_ns + (long long)((rate - 1.0) * (double)(now - rate_since_ns));
}

int clock_gettime(clockid_t id, struct timespec *ts) {
  int r = raw(id, ts);
  if (r == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE)) {
    refresh();
    long long ns = (long long)ts->tv_nsec + drift_ns();
    long long carry = ns >= 0 ? ns / 1000000000LL : (ns - 999999999LL) / 1000000000LL;
    ts->tv_sec += offset_s + carry;
    ts->tv_nsec = (long)(ns - carry * 1000000000LL);
  }
  return r;
}

/* glibc declares tv nonnull; a caller may still pass NULL. */
#pragma GCC diagnostic ignored "-Wnonnull-compare"
int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
  (void)tz;
  struct timespec ts;
  int r = clock_gettime(CLOCK_REALTIME, &ts);
  if (r == 0 && tv) {
    tv->tv_sec = ts.tv_sec;
    tv->tv_usec = ts.tv_nsec / 1000;
  }
  return r;
}

time_t time(time_t *t) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  if (t) *t = ts.tv_sec;
  return ts.tv_sec;
}
