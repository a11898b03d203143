/*
 * powercut.c - LD_PRELOAD shim that records what would survive a power cut.
 *
 *   cc -shared -fPIC -O2 -o powercut.so powercut.c -ldl -lpthread
 *   LD_PRELOAD=/abs/powercut.so POWERCUT_FILE=/abs/path/f.redb:/abs/path/f.redb.wal ./fencegate ...
 *
 * Model: a disk that loses every unsynced write wholesale.  POWERCUT_FILE
 * names one file, or up to MAX_WATCHED separated by ':'.  Whenever fsync()
 * or fdatasync() succeeds on an fd whose inode is a watched file's, that
 * file's whole content is copied to FILE.synced (via .synced.tmp + fsync +
 * rename, so the snapshot itself is never half-written).  The test then
 * "cuts the power": SIGKILL the process, then put each FILE.synced in
 * place of its FILE, or delete FILE if there is no snapshot.  Each file is
 * as of its own last sync, as on a disk.
 * Restore by *copying* the snapshot, not renaming it: a later run that dies
 * before its first fsync must still find it.  Start each scenario with no
 * stale .synced file.  Without POWERCUT_FILE set the shim only passes through.
 *
 * Limits - this is one pessimistic-but-plausible outcome, not all of them:
 *  - no torn pages and no reordering/partial persistence of the writes made
 *    between two syncs: either all of them survive (sync) or none do;
 *  - a write racing with the copy (another thread, after the sync returned)
 *    may land in the snapshot; callers that sync under their own write lock,
 *    as redb commits do, are unaffected;
 *  - directory entries are not modelled (create/rename/unlink are durable at
 *    once), nor are O_SYNC/O_DSYNC writes, msync(), sync_file_range(),
 *    syncfs() or sync(): those are not interposed, they reach libc untouched
 *    and never update the snapshot;
 *  - only syncs made through the dynamic libc symbols are seen (not raw
 *    syscall(2), io_uring, or a statically linked/musl binary).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
#define MAX_WATCHED 4
static char watched[MAX_WATCHED][PATH_MAX];
static int n_watched;                   /* 0: pass-through only */
/* POWERCUT_DELAY_MS: a slow disk. A sync of the watched file takes this
 * much longer before its snapshot is taken and it returns, so a caller that
 * acts before its sync returned (a proxy forwarding before its commit is
 * durable) deterministically sees the old snapshot. */
static useconds_t delay_us;
static char tmp_path[MAX_WATCHED][PATH_MAX], snap_path[MAX_WATCHED][PATH_MAX];
static pthread_once_t once = PTHREAD_ONCE_INIT;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void die(const char *what, const char *path)
{
    /* A silently wrong snapshot would make a crash test lie, so stop hard. */
    fprintf(stderr, "powercut: %s (%s): %s\n", what, path, strerror(errno));
    abort();
}

static void init(void)
{
    /* Resolved lazily, not in a constructor: a sync may come from another
     * library's constructor before ours has run. */
    real_fsync = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    if (!real_fsync || !real_fdatasync) {
        fprintf(stderr, "powercut: dlsym: %s\n", dlerror());
        abort();
    }
    const char *d = getenv("POWERCUT_DELAY_MS");
    if (d && *d)
        delay_us = (useconds_t)strtoul(d, NULL, 10) * 1000;
    const char *p = getenv("POWERCUT_FILE");
    if (!p || !*p)
        return;
    for (const char *at = p; *at && n_watched < MAX_WATCHED;) {
        const char *end = strchrnul(at, ':');
        size_t len = (size_t)(end - at);
        char *w = watched[n_watched];
        if (len + sizeof ".synced.tmp" > PATH_MAX) {
            errno = ENAMETOOLONG;
            die("path too long", at);
        }
        memcpy(w, at, len);
        w[len] = 0;
        snprintf(snap_path[n_watched], PATH_MAX, "%s.synced", w);
        snprintf(tmp_path[n_watched], PATH_MAX, "%s.synced.tmp", w);
        if (len)
            n_watched++;
        at = *end ? end + 1 : end;
    }
}

static void snapshot_one(int i, const struct stat *fst)
{
    const char *path = watched[i];
    struct stat pst;
    int src = open(path, O_RDONLY | O_CLOEXEC);
    if (src < 0) {
        if (errno != ENOENT)
            die("open watched file", path);
        return;                 /* path unlinked/renamed away: not our file */
    }
    if (fstat(src, &pst) != 0)
        die("fstat watched file", path);
    if (pst.st_dev != fst->st_dev || pst.st_ino != fst->st_ino)
        goto close_src;         /* some other file, or a replaced inode */
    if (delay_us)
        usleep(delay_us);

    int dst = open(tmp_path[i], O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (dst < 0)
        die("open snapshot tmp", path);
    static char buf[1 << 16];   /* under the lock, so one buffer is enough */
    for (;;) {
        ssize_t n = read(src, buf, sizeof buf);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            die("read watched file", path);
        if (n == 0)
            break;
        for (ssize_t off = 0; off < n;) {
            ssize_t w = write(dst, buf + off, (size_t)(n - off));
            if (w < 0 && errno == EINTR)
                continue;
            if (w < 0)
                die("write snapshot tmp", path);
            off += w;
        }
    }
    /* Real fsync: the snapshot must not itself go through the shim. */
    if (real_fsync(dst) != 0)
        die("fsync snapshot tmp", path);
    if (close(dst) != 0)
        die("close snapshot tmp", path);
    if (rename(tmp_path[i], snap_path[i]) != 0)
        die("rename snapshot", path);
close_src:
    close(src);
}

static void snapshot_if_watched(int fd)
{
    struct stat fst;
    /* Identify the file by inode, not by name: the fd may have been opened
     * through a relative path, a symlink or a hard link. */
    if (fstat(fd, &fst) != 0 || !S_ISREG(fst.st_mode))
        return;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_watched; i++)
        snapshot_one(i, &fst);
    pthread_mutex_unlock(&lock);
}

static int wrap(int (**real)(int), int fd)
{
    pthread_once(&once, init);
    int rc = (*real)(fd);
    if (rc == 0 && n_watched) {
        int saved = errno;      /* leave errno as the real call did */
        snapshot_if_watched(fd);
        errno = saved;
    }
    return rc;
}

int fsync(int fd) { return wrap(&real_fsync, fd); }
int fdatasync(int fd) { return wrap(&real_fdatasync, fd); }
