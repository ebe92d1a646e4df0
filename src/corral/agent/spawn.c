/*
 * corral-spawn: the root of every command the agent runs.
 *
 * Why C and not Python: the agent must make each command's root process a child subreaper (so setsid and
 * double-forked children stay in its tree until a timeout kills the tree) and the OOM killer's first choice
 * over the agent. Doing that in Python needs `preexec_fn`, which forces a full fork of the agent and costs
 * ~2-3 ms per command; this program lets the agent use vfork/posix_spawn and costs ~0.2 ms. Without it (no C
 * compiler on the host) the agent falls back to `preexec_fn`.
 *
 * usage: corral-spawn [--tty] PROGRAM [ARG...]
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int first = 1;
    if (argc > 1 && strcmp(argv[1], "--tty") == 0) {
        if (ioctl(0, TIOCSCTTY, 0) != 0) {
            perror("corral-spawn: TIOCSCTTY");
            return 126;
        }
        first = 2;
    }
    if (argc <= first) {
        fputs("usage: corral-spawn [--tty] PROGRAM [ARG...]\n", stderr);
        return 126;
    }
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (write(fd, "500", 3) < 0) { /* best effort: the kernel may refuse */ }
        close(fd);
    }
    execvp(argv[first], argv + first);
    int err = errno;
    fprintf(stderr, "corral-spawn: %s: %s\n", argv[first], strerror(err));
    return err == ENOENT ? 127 : 126;
}
