"""The sandbox's seccomp filter, on real sandboxed programs: the system calls an escape would use
fail with EPERM, ordinary programs (threads, subprocesses, AF_UNIX sockets, the code harness) still
run, and the sandbox says whether the filter ran."""

import errno
import json

import pytest

from asyncrl.rewards.sandbox import SandboxLimits, probe_isolation, run_program
from asyncrl.rewards.sandbox_seccomp import _libseccomp
from asyncrl.rewards.verifiers import verify

ISOLATION = probe_isolation()
LIMITS = SandboxLimits(wall_s=10.0, cpu_s=12, memory_mb=256)
needs_namespaces = pytest.mark.skipif(not ISOLATION["namespaces"],
                                      reason="this machine cannot create namespaces (unshare): network and "
                                             "file hiding are not available, only resource limits")
needs_seccomp = pytest.mark.skipif(ISOLATION["seccomp"] != "on", reason=f"seccomp {ISOLATION['seccomp']}")

# Each attempt prints the errno it got (0: the call succeeded). Raw calls through ctypes, as an
# escape would make them; a clone that succeeds exits in the child at once.
ESCAPES = r"""
import ctypes, json, socket
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(result):
    return ctypes.get_errno() if result == -1 else 0
def socket_errno(family):
    try:
        socket.socket(family, socket.SOCK_DGRAM if family == socket.AF_NETLINK else socket.SOCK_STREAM).close()
        return 0
    except OSError as exc:
        return exc.errno
got = {
    "ptrace": errno_of(libc.ptrace(0, 0, 0, 0)),  # PTRACE_TRACEME
    "mount": errno_of(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
    "unshare_newuser": errno_of(libc.unshare(0x10000000)),
    "setns": errno_of(libc.setns(0, 0)),
    "bpf": errno_of(libc.syscall(321, 0, 0, 0)),
    "socket_inet": socket_errno(socket.AF_INET),
    "socket_inet6": socket_errno(socket.AF_INET6),
    "socket_netlink": socket_errno(socket.AF_NETLINK),
}
child = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)  # clone(CLONE_NEWUSER | SIGCHLD)
if child == 0:
    libc._exit(0)
got["clone_newuser"] = errno_of(child)
got["clone3"] = errno_of(libc.syscall(435, 0, 0))
got["seccomp_status"] = open("/proc/self/status").read().split("Seccomp:")[1].split()[0]
print(json.dumps(got))
"""

ORDINARY = r"""
import concurrent.futures, hashlib, os, socket, subprocess, sys, threading
print(sum(i * i for i in range(10**5)))
with concurrent.futures.ThreadPoolExecutor(4) as pool:
    print(sorted(pool.map(lambda n: hashlib.sha256(str(n).encode()).hexdigest()[:4], range(8)))[0])
lock = threading.Lock()
with lock:
    pass
a, b = socket.socketpair()
a.sendall(b"pair"); print(b.recv(4).decode())
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); server.bind("/tmp/s"); server.listen(1)
client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); client.connect("/tmp/s")
connection, _ = server.accept(); client.sendall(b"unix"); print(connection.recv(4).decode())
print(subprocess.run([sys.executable, "-c", "print('child')"], capture_output=True, text=True).stdout.strip())
pid = os.fork()
if pid == 0:
    os._exit(7)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print("done")
"""


def run(code, limits=LIMITS):
    return run_program({"main.py": code}, ["python", "main.py"], limits=limits)


@needs_namespaces
@needs_seccomp
@pytest.mark.parametrize("mode", ISOLATION["modes"])
def test_escape_system_calls_are_refused(mode):
    result = run(ESCAPES, SandboxLimits(**{**LIMITS.__dict__, "isolation": mode}))
    assert result.ok, result.stderr
    got = json.loads(result.stdout)
    assert got.pop("seccomp_status") == "2"  # SECCOMP_MODE_FILTER on the program itself
    assert got.pop("clone3") == errno.ENOSYS  # so that the C library falls back to clone, whose flags it reads
    assert got == {name: errno.EPERM for name in got}, got
    assert result.isolation == {"mode": mode, "cgroup": result.isolation["cgroup"], "seccomp": "on"}


@needs_namespaces
def test_ordinary_programs_still_run():
    result = run(ORDINARY)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["333328333350000", "4b22", "pair", "unix", "child", "7", "done"]
    v = verify("code", "def add(a, b):\n    return a + b\n", json.dumps({"asserts": ["assert add(1, 2) == 3"]}))
    assert v.correct and v.details["passed"] == 1


@needs_seccomp
def test_unisolated_mode_gets_the_filter_too():
    result = run("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\nprint('opened')",
                 SandboxLimits(**{**LIMITS.__dict__, "isolation": "unisolated", "allow_unisolated": True,
                                  "allow_no_cgroup": True}))
    assert "opened" not in result.stdout and "PermissionError" in result.stderr
    assert result.isolation["seccomp"] == "on"


def test_the_report_says_whether_seccomp_ran(monkeypatch):
    try:
        _libseccomp()
        assert ISOLATION["seccomp"] == "on"
    except OSError:
        assert ISOLATION["seccomp"].startswith("off (libseccomp not found")
    if not ISOLATION["namespaces"]:
        return
    monkeypatch.setenv("ASYNCRL_SANDBOX_SECCOMP", "0")  # switched off: said, and the program is unfiltered
    assert probe_isolation()["seccomp"] == "off (ASYNCRL_SANDBOX_SECCOMP=0)"
    result = run("import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
                 "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])")
    assert result.ok and result.stdout.strip() == "0", result.stderr
    assert result.isolation["seccomp"] == "off (ASYNCRL_SANDBOX_SECCOMP=0)"
