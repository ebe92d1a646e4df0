/*
 * corral-spawn: the root of every command the agent runs.
 *
 * Why C and not Python: each command's root process must be a child subreaper (so setsid and double-forked
 * children stay in its tree until a timeout kills the tree) and the OOM killer's first choice over the agent.
 * Doing that from Python needs `preexec_fn`, which forces a full fork of the agent and costs ~2-3 ms per
 * command; with this program the agent uses posix_spawn (vfork) and the whole start costs ~0.3 ms. Without it
 * (no C compiler on the host) the agent falls back to `preexec_fn`.
 *
 * usage: corral-spawn [--tty] [--cwd DIR] PROGRAM [ARG...]
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (strcmp(argv[i], "--tty") == 0) {
            if (ioctl(0, TIOCSCTTY, 0) != 0) {
                perror("corral-spawn: TIOCSCTTY");
                return 126;
            }
        } else if (strcmp(argv[i], "--cwd") == 0 && i + 1 < argc) {
            if (chdir(argv[++i]) != 0) {
                fprintf(stderr, "corral-spawn: cd %s: %s\n", argv[i], strerror(errno));
                return 126;
            }
        } else if (strcmp(argv[i], "--") == 0) {
            i++;
            break;
        } else {
            fprintf(stderr, "corral-spawn: unknown option %s\n", argv[i]);
            return 126;
        }
    }
    if (i >= argc) {
        fputs("usage: corral-spawn [--tty] [--cwd DIR] [--] PROGRAM [ARG...]\n", stderr);
        return 126;
    }
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (write(fd, "500", 3) < 0) { /* best effort: the kernel may refuse */ }
        close(fd);
    }
    execvp(argv[i], argv + i);
    int err = errno;
    fprintf(stderr, "corral-spawn: %s: %s\n", argv[i], strerror(err));
    return err == ENOENT ? 127 : 126;
}
