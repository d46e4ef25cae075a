#include "peer_fd.hpp"

#include <errno.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "error.hpp"

// Syscall numbers are the same on x86_64 and aarch64 (the generic table); older libc headers may lack them.
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef PR_SET_PTRACER
#define PR_SET_PTRACER 0x59616d61
#endif
#ifndef PR_SET_PTRACER_ANY
#define PR_SET_PTRACER_ANY ((unsigned long)-1)
#endif

namespace ep_symmem {
namespace {

std::string errno_text(int err) { return std::string(strerror(err)) + " (errno " + std::to_string(err) + ")"; }

[[noreturn]] void fail(const char* call, int err, int pid, int fd) {
  std::string message = std::string(call) + "(pid=" + std::to_string(pid) +
                        (fd >= 0 ? ", fd=" + std::to_string(fd) : std::string()) + ") failed: " + errno_text(err);
  if (err == EPERM || err == EACCES) {
    message +=
        ". Duplicating a peer's file descriptor needs ptrace-attach permission over it: run every rank as the "
        "same user, and either set kernel.yama.ptrace_scope=0, grant CAP_SYS_PTRACE, or set "
        "EPKIT_SYMMEM_ALLOW_PTRACE=1 in every rank (each exporter then calls prctl(PR_SET_PTRACER_ANY))";
  } else if (err == ESRCH) {
    message += ". The peer process no longer exists (or lives in another pid namespace): keep every rank alive "
               "until exchange() has returned everywhere";
  } else if (err == EBADF) {
    message += ". The peer has already closed the exported fd: exchange() keeps it open until the final "
               "barrier; do not call release_exported_fds() before every peer has imported";
  } else if (err == ENOSYS) {
    message += ". The kernel lacks pidfd_open/pidfd_getfd (Linux >= 5.6 needed); use handle_type='fabric' where "
               "available";
  } else if (err == EMFILE || err == ENFILE) {
    message += ". Too many open files: raise the fd limit (ulimit -n)";
  }
  throw Error(ErrorKind::kPeerAccess, message, err, call);
}

}  // namespace

int duplicate_peer_fd(int pid, int fd) {
  if (fd < 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "peer descriptor of pid " + std::to_string(pid) + " has no POSIX fd (fd=" + std::to_string(fd) +
                    "); the peer exported no POSIX-fd handle");
  }
  const int own_pid = static_cast<int>(getpid());
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd < 0) {
    const int err = errno;
    if (pid == own_pid && err == ENOSYS) {
      const int local = fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (local < 0) fail("fcntl(F_DUPFD_CLOEXEC)", errno, pid, fd);
      return local;
    }
    fail("pidfd_open", err, pid, -1);
  }
  const int local = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  const int err = errno;
  close(pidfd);
  if (local < 0) fail("pidfd_getfd", err, pid, fd);
  return local;
}

void allow_ptrace_from_any_process() {
  if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0) {
    const int err = errno;
    // EINVAL: Yama is not enabled, so there is nothing to relax.
    if (err == EINVAL) return;
    throw Error(ErrorKind::kPeerAccess, "prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY) failed: " + errno_text(err), err,
                "prctl");
  }
}

}  // namespace ep_symmem
