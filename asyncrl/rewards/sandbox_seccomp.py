"""The sandbox's seccomp filter (`asyncrl.rewards.sandbox`): every system call allowed but those a
test program never needs and an escape would (tracing other processes, mounting, new namespaces,
kernel modules, eBPF, keyrings, sockets other than AF_UNIX, ...), which fail with EPERM.

Built here, in the caller, with libseccomp through ctypes (no Python dependency), exported as
raw BPF and installed by the sandbox's PID 1 (`sandbox_init`) in the program's process just before
its `execve`: the sandbox's root needs no libseccomp. Without libseccomp, with a kernel that
refuses the filter, or with ASYNCRL_SANDBOX_SECCOMP=0, the state says `off (why)` and the sandbox
runs on its namespaces alone, saying so (`probe_isolation()`, each `SandboxResult.isolation`).

A system call of another ABI (i386 `int 0x80`, x32) kills the caller: libseccomp's filter checks
the architecture first, so a 32-bit call number cannot slip past the list."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

log = logging.getLogger(__name__)

DENIED = (
    # Reading or steering another process.
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    # The file system tree: the sandbox built it; the program must not rebuild it.
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount",
    "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    # New namespaces (a user namespace gives back every capability inside it) or others' namespaces.
    "unshare", "setns",
    # The kernel itself, and its larger attack surfaces.
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "bpf",
    "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "reboot", "swapon", "swapoff",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)
# clone's flags that make a namespace (CLONE_NEWTIME is 0x80, inside clone's exit-signal byte: unshare only).
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
AF_UNIX = 1
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_MASKED_EQ = 1, 7
ENV = "ASYNCRL_SANDBOX_SECCOMP"

# Installs a filter in the calling process; standard library only, so that the sandbox's PID 1
# (`sandbox_init.LAUNCHER`) runs this very text.
INSTALL_FILTER = r'''
def install_filter(libc, program):
    """no_new_privs, then prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &sock_fprog): 0, or the errno."""
    import ctypes
    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
    fprog = SockFprog(len(program) // 8, program)
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0):
        return ctypes.get_errno() or 1
    return 0
'''
_installer: dict = {}
exec(INSTALL_FILTER, _installer)  # the same text PID 1 runs, for the unisolated mode's child
install_filter = _installer["install_filter"]

# Run in a fresh interpreter: the filter installs, and a socket(AF_INET) is then refused.
_KERNEL_CHECK = INSTALL_FILTER + r'''
import ctypes, socket, sys
code = install_filter(ctypes.CDLL(None, use_errno=True), bytes.fromhex(sys.stdin.read()))
if code:
    sys.exit("prctl(PR_SET_SECCOMP): errno %d" % code)
try:
    socket.socket(socket.AF_INET, socket.SOCK_STREAM)
except PermissionError:
    sys.exit(0)
sys.exit("filter installed but socket(AF_INET) still allowed")
'''


@dataclass(frozen=True)
class SeccompFilter:
    program: bytes | None  # struct sock_filter[], None when off
    state: str  # "on", or "off (why)"

    @property
    def on(self) -> bool:
        return self.program is not None


def seccomp_filter() -> SeccompFilter:
    """The filter for this machine (built once), or why there is none."""
    return _filter(os.environ.get(ENV, "1"))


@functools.lru_cache(maxsize=4)
def _filter(setting: str) -> SeccompFilter:
    if setting.strip().lower() in ("0", "off", "false", "no"):
        return _off(f"{ENV}={setting}")
    try:
        program = _build(_libseccomp())
    except OSError as exc:
        return _off(str(exc))
    refused = _kernel_refuses(program)
    if refused:
        return _off(f"the kernel refused the filter: {refused}")
    return SeccompFilter(program, "on")


def _off(why: str) -> SeccompFilter:
    log.warning("sandbox seccomp filter off (%s): untrusted programs run in their namespaces alone", why)
    return SeccompFilter(None, f"off ({why})")


class _ArgCmp(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp."""
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def _libseccomp() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        found = ctypes.util.find_library("seccomp")
        if not found:
            raise OSError("libseccomp not found (install libseccomp2)") from None
        lib = ctypes.CDLL(found)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


def _rules() -> list[tuple[str, int, list[_ArgCmp]]]:
    """(system call, errno, argument comparisons): each rule refuses the call where all its comparisons hold."""
    rules = [(name, errno.EPERM, []) for name in DENIED]
    rules.append(("socket", errno.EPERM, [_ArgCmp(0, SCMP_CMP_NE, AF_UNIX, 0)]))
    rules += [("clone", errno.EPERM, [_ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag)]) for flag in CLONE_NAMESPACE_FLAGS]
    # clone3's flags sit in memory a filter cannot read: ENOSYS makes the C library fall back to clone.
    rules.append(("clone3", errno.ENOSYS, []))
    return rules


def _build(lib: ctypes.CDLL) -> bytes:
    """The filter as raw BPF, from libseccomp (which also checks the architecture)."""
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        for name, code, comparisons in _rules():
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue  # not a system call of this architecture (or a libseccomp too old to know it)
            array = (_ArgCmp * len(comparisons))(*comparisons) if comparisons else None
            failed = lib.seccomp_rule_add_array(ctx, _errno_action(code), number, len(comparisons), array)
            if failed:
                raise OSError(f"seccomp_rule_add({name}): {os.strerror(-failed)}")
        with tempfile.TemporaryFile() as exported:
            failed = lib.seccomp_export_bpf(ctx, exported.fileno())
            exported.seek(0)
            program = exported.read()
        if failed or not program or len(program) % 8:
            raise OSError(f"seccomp_export_bpf failed ({os.strerror(-failed) if failed else 'empty program'})")
        return program
    finally:
        lib.seccomp_release(ctx)


def _kernel_refuses(program: bytes) -> str:
    """Why this kernel will not run the filter, or "" (tried once, in a throwaway interpreter)."""
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _KERNEL_CHECK], input=program.hex(),
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot check: {exc}"
    return "" if done.returncode == 0 else (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
