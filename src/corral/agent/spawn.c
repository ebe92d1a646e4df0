/*
 * corral-spawn: the root of every command the agent runs.
 *
 * Why C and not Python: each command's root process must be a child subreaper (so setsid and double-forked
 * children stay in its tree until a timeout kills the tree) and the OOM killer's first choice over the agent.
 * Doing that from Python needs `preexec_fn`, which forces a full fork of the agent and costs ~2-3 ms per
 * command; with this program the agent uses posix_spawn (vfork) and the whole start costs ~0.3 ms. Without it
 * (no C compiler on the host) the agent falls back to `preexec_fn`.
 *
 * In a sandbox created with root, the agent runs as root and starts the user's commands with `--user UID:GID`:
 * the capability bounding set is emptied (while CAP_SETPCAP is still held), supplementary groups dropped, and
 * the gid then the uid set, which clears the permitted and effective sets. The working directory is entered
 * only then, as the user: a directory the user may not enter stays closed to its command.
 *
 * usage: corral-spawn [--tty] [--user UID:GID] [--cwd DIR] [--] PROGRAM [ARG...]
 */
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <unistd.h>

static int drop_privileges(const char *spec) {
    char *end;
    unsigned long uid = strtoul(spec, &end, 10);
    if (*end != ':') {
        fprintf(stderr, "corral-spawn: --user wants UID:GID, not %s\n", spec);
        return -1;
    }
    unsigned long gid = strtoul(end + 1, &end, 10);
    if (*end != '\0' || uid == 0) {
        fprintf(stderr, "corral-spawn: --user wants a non-root UID:GID, not %s\n", spec);
        return -1;
    }
    for (int cap = 0;; cap++) {
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) {
            if (errno == EINVAL) break; /* past the kernel's last capability: all dropped */
            perror("corral-spawn: PR_CAPBSET_DROP");
            return -1;
        }
    }
    if (setgroups(0, NULL) != 0 || setgid((gid_t)gid) != 0 || setuid((uid_t)uid) != 0) {
        perror("corral-spawn: dropping to the sandbox user");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    int i = 1, tty = 0;
    const char *cwd = NULL, *user = NULL;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (strcmp(argv[i], "--tty") == 0) {
            tty = 1;
        } else if (strcmp(argv[i], "--cwd") == 0 && i + 1 < argc) {
            cwd = argv[++i];
        } else if (strcmp(argv[i], "--user") == 0 && i + 1 < argc) {
            user = argv[++i];
        } else if (strcmp(argv[i], "--") == 0) {
            i++;
            break;
        } else {
            fprintf(stderr, "corral-spawn: unknown option %s\n", argv[i]);
            return 126;
        }
    }
    if (i >= argc) {
        fputs("usage: corral-spawn [--tty] [--user UID:GID] [--cwd DIR] [--] PROGRAM [ARG...]\n", stderr);
        return 126;
    }
    if (tty && ioctl(0, TIOCSCTTY, 0) != 0) {
        perror("corral-spawn: TIOCSCTTY");
        return 126;
    }
    prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (write(fd, "500", 3) < 0) { /* best effort: the kernel may refuse */ }
        close(fd);
    }
    if (user != NULL && drop_privileges(user) != 0) {
        return 126;
    }
    if (cwd != NULL && chdir(cwd) != 0) {
        fprintf(stderr, "corral-spawn: cd %s: %s\n", cwd, strerror(errno));
        return 126;
    }
    execvp(argv[i], argv + i);
    int err = errno;
    fprintf(stderr, "corral-spawn: %s: %s\n", argv[i], strerror(err));
    return err == ENOENT ? 127 : 126;
}
