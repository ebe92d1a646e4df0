"""The items of the sandbox checklist (1-46, numbered as CHECKLIST.md numbers them): each one's number, the
property it proves, and how to fix a failure.

The text follows the project's checklist (CHECKLIST.md), kept here as data because the product cannot read the
project's documents at run time. `DEFAULT_FIXES` is what a failure of an item says to do when the probe that
failed has nothing more specific (the in-sandbox tasks bring their own, `CHECKLIST_FIXES` of the security
corpus, which take precedence).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ITEMS", "Item", "item"]


@dataclass(frozen=True)
class Item:
    number: int
    title: str
    fix: str


_RUNTIME = "run sandboxes through Corral's local backend (runc with the generated OCI spec), not a hand-made config"

ITEMS: dict[int, Item] = {i.number: i for i in (
    Item(1, "No container-engine or host sockets reachable",
         "do not bind-mount /var/run/docker.sock, /run/containerd or any host socket into sandboxes; "
         "remove extra mounts from the template"),
    Item(2, "The agent channel needs the sandbox's own token and is not exposed on the network",
         "keep the agent on its Unix socket (mode 0600, per-sandbox token); never publish a port from inside "
         "a sandbox and do not run templates with services listening on 0.0.0.0"),
    Item(3, "Code runs as a non-root user", "build templates with the uid 1000 user and do not set `user` in "
                                            "the runtime spec; " + _RUNTIME),
    Item(4, "No capabilities, no_new_privs, seccomp filter active",
         "use Corral's generated OCI spec: empty capability sets, noNewPrivileges, and the seccomp profile"),
    Item(5, "setuid binaries give no root", "keep noNewPrivileges in the runtime spec; remove sudo and setuid "
                                            "binaries from custom templates"),
    Item(6, "Template layers read-only", "mount templates read-only below the sandbox's overlay; never give "
                                         "the sandbox user ownership of template files"),
    Item(7, "/tmp and /dev/shm are size-capped", "mount /tmp and /dev/shm as tmpfs with a size= option "
                                                 "(limits.tmp, limits.shm)"),
    Item(8, "Workspace disk quota", "give each sandbox its own fixed-size disk image (limits.disk); do not put "
                                    "workspaces on a shared host directory"),
    Item(9, "Process limit", "enable the pids cgroup controller (check `cat /sys/fs/cgroup/cgroup.controllers`) "
                             "and keep limits.pids set"),
    Item(10, "Memory limit, no swap", "enable the memory cgroup controller, keep limits.memory set, and set "
                                      "memory.swap.max to 0 (or disable swap) on the host"),
    Item(11, "CPU limit", "enable the cpu cgroup controller and keep limits.cpus set"),
    Item(12, "Timeout kills the whole tree, no zombies", "keep the agent as PID 1 of the sandbox's PID "
                                                         "namespace; it kills the process group and reaps"),
    Item(13, "Output cap", "keep the per-command output cap (max_output) in place; a reverse proxy in front of "
                           "Corral must stream responses rather than buffer them"),
    Item(14, "Invalid UTF-8 is safe", "output travels base64-encoded (stdout_b64): do not put a proxy or "
                                      "middleware in front of the API that re-encodes bodies"),
    Item(15, "Binary round trip", "file bodies must travel as application/octet-stream untouched: check proxies "
                                  "in front of the API for compression or charset rewriting"),
    Item(16, "Traversal rejected by the file API", "upgrade Corral; do not widen file_roots to / or system paths"),
    Item(17, "NUL bytes in paths rejected", "upgrade Corral; a 500 here is a bug to report"),
    Item(18, "Host never follows sandbox symlinks", "upgrade Corral: file operations must run inside the "
                                                    "sandbox (through its agent), never on host paths"),
    Item(19, "Symlink-swap race", "upgrade Corral: transfers must resolve paths inside the sandbox with "
                                  "O_NOFOLLOW/openat2, never on the host"),
    Item(20, "Archive upload safe", "upgrade Corral: archives must be extracted inside the sandbox by the agent"),
    Item(21, "PID namespace; /proc and /sys masked", "keep the PID namespace and the masked/read-only paths "
                                                     "of Corral's OCI spec"),
    Item(22, "Clean environment", "do not pass host environment variables to sandboxes; set only what the "
                                  "template documents"),
    Item(23, "No orchestrator credentials", "set automountServiceAccountToken: false and block the Kubernetes "
                                            "API with a NetworkPolicy"),
    Item(24, "Cloud metadata blocked", "keep sandboxes on a loopback-only network with egress through Corral's "
                                       "proxy; never give them a route to 169.254.169.254"),
    Item(25, "Private ranges, the host and other sandboxes unreachable",
         "keep the private-range ban of the egress proxy; grant private ip:port pairs per tenant only"),
    Item(26, "Egress allowlist enforced", "give sandboxes no network but loopback: every connection must go "
                                          "through Corral's egress proxy"),
    Item(27, "No direct DNS", "do not give sandboxes a resolver: names resolve through the egress proxy only"),
    Item(28, "Raw sockets and ptrace denied", "drop CAP_NET_RAW and CAP_SYS_PTRACE and keep the seccomp profile"),
    Item(29, "mount, unshare, io_uring, bpf, keyctl denied", "keep Corral's seccomp profile (it denies these "
                                                             "syscalls); do not run sandboxes unconfined"),
    Item(30, "TIOCSTI injection blocked", "keep Corral's seccomp profile, which denies ioctl(TIOCSTI)"),
    Item(31, "The configured runtime is the one running", "install the runtime the sandboxes ask for (runsc "
                                                          "for gVisor) and do not alias it to runc"),
    Item(32, "Tenants are isolated", "upgrade Corral: every sandbox route must look the sandbox up in the "
                                     "caller's tenant and answer 404 otherwise; report the route"),
    Item(33, "Roles hold", "upgrade Corral: routes must authorize against the role table; check that keys were "
                           "created with the intended role (`corral keys ls`)"),
    Item(34, "Audit log is tamper-evident and out of reach",
         "keep the state directory (corral.db) out of every sandbox mount and export `corral audit head` "
         "regularly to a place the database's owner cannot write"),
    Item(35, "Audit is complete", "upgrade Corral: every route must write its audit record, and the egress "
                                  "proxy's events must be wired to the audit log"),
    Item(36, "Fail closed", "upgrade Corral: creating a sandbox must fail when the runtime, a cgroup controller "
                            "or a namespace is unavailable, never start it without them"),
    Item(37, "Secrets never enter the sandbox",
         "upgrade Corral: a sandbox's secrets must be placeholders in its environment, their values only in the "
         "egress proxy's memory (docs/secrets.md); do not pass secret values in `env`"),
    Item(38, "Secrets reach only their hosts and are not reflected",
         "upgrade Corral: the egress proxy must put a secret's value only into requests to its bound hosts, and "
         "replace it by the placeholder in their answers (docs/secrets.md)"),
    Item(39, "The audit chain is keyed",
         "keep the audit key outside the database (CORRAL_AUDIT_KEY or <home>/audit.key, 0600) and out of "
         "backups of it; if verification fails, restore the audit table from a backup and rotate the key "
         "(`corral audit rotate-key`)"),
    Item(40, "A tenant's forced runtime holds",
         "upgrade Corral: every path that starts a sandbox (create, fork, the E2B API, MCP) must apply the tenant's "
         "required_runtime, and install runsc where the server runs; never fall back to runc"),
    Item(41, "A sandbox's ports are its tenant's",
         "upgrade Corral: a port host (`<port>-<sandbox id>.<domain>`) must need the owning tenant's key (401 "
         "without one, 404 for other tenants) unless the sandbox was created with public_ports; a proxy in front "
         "of Corral must pass the Host and Authorization headers through unchanged"),
    Item(42, "Volumes are the tenant's and bounded",
         "upgrade Corral: volumes must be looked up in the caller's tenant (404 otherwise) and each one must be a "
         "fixed-size filesystem image of its own, never a directory of the host's disk"),
    Item(43, "Every front end keeps tenancy and roles",
         "upgrade Corral: every front end (E2B's API, MCP, the dashboard) must call the service layer with the "
         "caller's own principal; report the route that answered"),
    Item(44, "Kubernetes sandbox Pods are locked down",
         "give sandbox Pods a RuntimeClass (CORRAL_K8S_RUNTIME_CLASS: gvisor, the default, never `none`), apply "
         "`corral k8s manifests` (Pod Security `restricted` on the sandbox namespace) and do not edit the sandbox "
         "Pods' securityContext, automountServiceAccountToken or NetworkPolicy"),
    Item(45, "A destructive command can be undone",
         "upgrade Corral on a backend with checkpoints (local, Docker): restoring a checkpoint must put back every "
         "file as it was in the same sandbox, and write a `checkpoint.restore` audit record with the caller's key"),
    Item(46, "A runaway tree does not lock its sandbox",
         "upgrade Corral: at the pids limit the sandbox's agent must stop what ended commands left running "
         "(never a live command's or a background process's tree) before it starts the next command, and say "
         "so in that command's result (`reclaimed`)"),
)}


def item(number: int) -> Item:
    return ITEMS[number]
