"""The sandbox's PID 1 (`asyncrl.rewards.sandbox`): a program of the standard library alone, run with
`python -I -S -c LAUNCHER <job>` inside the new namespaces."""

from asyncrl.rewards.sandbox_seccomp import INSTALL_FILTER

# Runs as the sandbox's PID 1 inside the new namespaces, with only the standard library: builds
# the new root, drops privilege, starts the program, reaps every orphan until the program ends.
# argv[1] is a JSON job description. Errors exit 125 with the reason on stderr. The program's
# process installs the seccomp filter (job["seccomp"], raw BPF in hex) last, just before its exec:
# PID 1 itself needs mount and chroot, and a filter that was asked for but cannot be installed
# stops the run rather than letting the program run without it.
LAUNCHER = INSTALL_FILTER + r"""
import ctypes, json, os, resource, shutil, sys
job = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
ST_TO_MS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}
def fail(why):
    os.write(2, ("sandbox setup failed: %s\n" % why).encode()); os._exit(125)
def mount(src, dst, fstype, flags, data=None):
    if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags, data and data.encode()):
        e = ctypes.get_errno(); fail("mount %s on %s: %s" % (src, dst, os.strerror(e)))
def locked_flags(path):  # flags a remount in a user namespace must keep
    f = os.statvfs(path).f_flag
    return sum(ms for st, ms in ST_TO_MS.items() if f & st and ms != MS_RDONLY)
def bind_ro(src, dst, nodev=MS_NODEV):
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True); open(dst, "a").close()
    mount(src, dst, None, MS_BIND)
    mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | nodev | locked_flags(src))
def tmpfs(dst, size, mode):
    os.makedirs(dst, exist_ok=True)
    mount("tmpfs", dst, "tmpfs", MS_NOSUID | MS_NODEV, "size=%s,mode=%s" % (size, mode))
try:
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = job["root"]
    tmpfs(root, "4m", "0755")
    for src in job["binds"]:
        bind_ro(src, root + src)
    for src in job["hidden"]:  # e.g. site-packages inside a bound stdlib: empty and read-only
        if os.path.isdir(root + src):
            mount("tmpfs", root + src, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k")
    for link, target in job["links"]:
        os.makedirs(os.path.dirname(root + link), exist_ok=True)
        if not os.path.lexists(root + link):
            os.symlink(target, root + link)
    for dev in ("null", "zero", "random", "urandom"):
        bind_ro("/dev/" + dev, root + "/dev/" + dev, nodev=0)  # device nodes: only these four
    os.makedirs(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    tmpfs(root + "/tmp", "%dm" % job["disk_mb"], "1777")
    tmpfs(root + "/dev/shm", "%dm" % job["disk_mb"], "1777")
    tmpfs(root + "/work", "%dm" % job["disk_mb"], "0700")
    for name in os.listdir(job["files"]):
        shutil.copyfile(os.path.join(job["files"], name), os.path.join(root, "work", name))
        if job["uid"] is not None:
            os.chown(os.path.join(root, "work", name), job["uid"], job["uid"])
    if job["uid"] is not None:
        os.chown(root + "/work", job["uid"], job["uid"])
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chroot(root)
    os.chdir("/work")
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    if libc.prctl(38, 1, 0, 0, 0):  # PR_SET_NO_NEW_PRIVS
        fail("no_new_privs")
    if job["uid"] is None:  # user namespace: stay uid 0 there, with no capability to keep or gain
        for cap in range(64):
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (EINVAL past the last capability)
except OSError as exc:
    fail(exc)
program = os.fork()
if program == 0:
    try:
        if job["uid"] is not None:
            os.setgroups([]); os.setgid(job["uid"]); os.setuid(job["uid"])
        refused = job["seccomp"] and install_filter(libc, bytes.fromhex(job["seccomp"]))
        if refused:
            fail("seccomp filter: %s" % os.strerror(refused))
        os.execve(job["argv"][0], job["argv"], job["env"])
    except OSError as exc:
        os.write(2, ("cannot start %s: %s\n" % (job["argv"][0], exc)).encode())
    os._exit(127)
while True:  # PID 1 reaps every orphan, so a fork bomb's zombies do not hold process slots
    pid, status = os.wait()
    if pid == program:
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)  # the kernel then kills what is left
"""
