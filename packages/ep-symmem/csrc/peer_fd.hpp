#pragma once
// Duplicating a file descriptor that lives in another process of this host: pidfd_open + pidfd_getfd
// (Linux >= 5.6). The caller needs ptrace-attach rights over the peer (same user and Yama ptrace_scope 0,
// CAP_SYS_PTRACE, or the peer called allow_ptrace_from_any_process()). Host only.

namespace ep_symmem {

// Returns a new fd (close-on-exec) of this process that refers to the same open file as `fd` of process `pid`.
// Own pid works too (pidfd_getfd on self; falls back to fcntl(F_DUPFD_CLOEXEC) where pidfds are missing).
// Throws Error(kPeerAccess) naming the failing call, errno and the likely fix.
int duplicate_peer_fd(int pid, int fd);

// prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY): lets any process of this user duplicate our fds under Yama
// ptrace_scope=1. Weakens isolation; called only when EPKIT_SYMMEM_ALLOW_PTRACE=1. Throws on failure.
void allow_ptrace_from_any_process();

}  // namespace ep_symmem
