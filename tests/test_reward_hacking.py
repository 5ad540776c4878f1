"""Rewards a policy cannot game and inputs that cannot stall the verifier: every hostile candidate
of `asyncrl.bench.hostile` earns nothing through the verifier endpoint's own entry point, the
sandbox shows an allow-list and leaves nothing behind, the math check is bounded where production
runs it (a worker thread), and the HTTP guards answer before reading a body."""

import json
import os
import shutil
import subprocess
import tempfile
import sys
import threading
import time
import uuid

import pytest
from fastapi.testclient import TestClient

from actors.assembler import Assembler
from asyncrl.bench.hostile import ADD_ASSERTS, HOSTILE_CODE
from asyncrl.config import RouteConfig
from asyncrl.config import OverlongShaping
from asyncrl.messages.structs import Reward, RewardRequest
from asyncrl.rewards.code import plan_assert
from asyncrl.rewards.hybrid import combine_rewards
from asyncrl.rewards.sandbox import SandboxLimits, probe_isolation, project_root, run_program
from asyncrl.rewards.verifier import Verifier
from asyncrl.rewards.verifiers import verify
from asyncrl.serve import guards, reward as reward_app, train as train_app

ISOLATION = probe_isolation()
needs_namespaces = pytest.mark.skipif(not ISOLATION["namespaces"], reason="no namespaces on this machine")
needs_cgroups = pytest.mark.skipif(not ISOLATION["cgroups"], reason="this process cannot create cgroups")
LIMITS = SandboxLimits(wall_s=3.0, cpu_s=4, memory_mb=256)


def run(code, stdin="", limits=LIMITS):
    return run_program({"main.py": code}, ["python", "main.py"], stdin=stdin, limits=limits)


# --- the harness: no forged verdict -----------------------------------------------------------------


@pytest.fixture(scope="module")
def verdicts():
    """Every hostile candidate scored once through the verifier endpoint's scorer."""
    requests = [RewardRequest(prompt_id=f"p{i}", sample_idx=0, response_text=c.response(), ground_truth=c.tests,
                              data_source="code") for i, c in enumerate(HOSTILE_CODE)]
    return dict(zip((c.name for c in HOSTILE_CODE), Verifier().score(requests)))


@pytest.mark.parametrize("candidate", HOSTILE_CODE, ids=[c.name for c in HOSTILE_CODE])
def test_hostile_candidates_earn_nothing_and_say_why(candidate, verdicts):
    reward = verdicts[candidate.name]
    assert not reward.failed, reward.details
    if candidate.honest:
        assert reward.correct and reward.score == 1.0 and reward.details["pass_fraction"] == 1.0
        assert reward.suspicious == []
    else:
        assert reward.score == 0.0 and not reward.correct and reward.details["passed"] == 0, reward.details
        assert reward.details["failures"] and all(reason for reason in reward.details["failures"])


def test_hacks_are_named_for_the_metrics(verdicts):
    assert "early_exit" in verdicts["os._exit(0)"].suspicious
    assert "early_exit" in verdicts["re-exec with python -O"].suspicious
    assert "exit_during_test" in verdicts["raise SystemExit inside the call"].suspicious
    assert "fake_value" in verdicts["__eq__ always True"].suspicious
    assert "fake_value" in verdicts["float subclass with fake arithmetic"].suspicious
    assert "forged_report" in verdicts["forged verdicts on every descriptor"].suspicious
    assert verdicts["wrong"].suspicious == []  # a plain wrong answer is not a hack


def test_expected_values_stay_outside_the_sandbox():
    plan = plan_assert("assert add(1, 2) == 3")
    assert (plan.kind, plan.source) == ("value", "add(1, 2)") and "3" not in plan.source
    assert plan_assert("assert 7 in primes(10)").source == "primes(10)"
    assert plan_assert("assert not is_prime(8)").check == ("falsy",)
    assert plan_assert("assert f(1) == g(1)").check == ("truthy",)  # no literal side: runs whole, truthy here
    # A partly right answer is graded per test; a value of the right type only counts as right.
    tests = json.dumps({"asserts": ["assert half(4) == 2", "assert half(3) == 1.5", "assert half(0) is None"]})
    v = verify("code", "def half(x):\n    return x / 2 if x else None\n", tests)
    assert v.details["passed"] == 3
    v = verify("code", "def half(x):\n    return str(x / 2)\n", tests)
    assert v.details["passed"] == 0 and "wrong value" in v.details["failures"][0]


def test_candidate_output_and_exceptions_do_not_confuse_the_harness():
    code = "def add(a, b):\n    print('PASS', a, b)\n    if a == 2:\n        raise ValueError('no')\n    return a + b\n"
    v = verify("code", code, ADD_ASSERTS)
    assert v.details["passed"] == 1 and v.details["failures"] == ["ValueError: no"]


# --- the sandbox ---------------------------------------------------------------------------------------


@needs_namespaces
@pytest.mark.parametrize("mode", ISOLATION["modes"])
def test_the_program_sees_only_the_allow_list(mode, tmp_path):
    # A world-readable sibling of the project (a second checkout, a dataset with answers).
    sibling = tempfile.mkdtemp(prefix="asyncrl-sibling-", dir=os.path.dirname(project_root()))
    os.chmod(sibling, 0o755)
    open(os.path.join(sibling, "answers.txt"), "w").write("42")
    try:
        _check_allow_list(mode, os.path.join(sibling, "answers.txt"))
    finally:
        shutil.rmtree(sibling)


def _check_allow_list(mode, sibling):
    code = ("import os\nprint(sorted(os.listdir('/')))\n"
            f"for p in [{sibling!r}, {project_root()!r}, '/etc/passwd', '/root', '/home', {sys.executable!r}]:\n"
            "    print(p, os.path.exists(p))\n"
            "try:\n    open('/usr/lib/escape', 'w')\nexcept OSError as e:\n    print('read-only', type(e).__name__)\n"
            "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 80), timeout=1)\n"
            "except OSError:\n    print('no network')\n")
    result = run(code, limits=SandboxLimits(wall_s=5.0, isolation=mode))
    lines = result.stdout.splitlines()
    assert result.ok, result.stderr
    assert set(eval(lines[0])) <= {"work", "tmp", "proc", "dev", "usr", "lib", "lib64", "bin", "lib32", "libx32"}
    assert all(line.endswith("False") for line in lines[1:7]), lines
    assert "read-only" in result.stdout and "no network" in result.stdout


# Unisolated (opted in, rlimits only): no PID namespace, so only the cgroup's kill reaches them.
SETSID_MODES = ISOLATION["modes"] + (["unisolated"] if ISOLATION["cgroups"] else [])


@pytest.mark.parametrize("mode", SETSID_MODES)
def test_setsid_children_die_with_the_sandbox(mode):
    marker = f"asyncrl-escape-{uuid.uuid4().hex}"
    code = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "time.sleep(0.5)\nprint('parent done')\n")
    result = run(code, limits=SandboxLimits(wall_s=3.0, isolation=mode, allow_unisolated=True))
    assert "parent done" in result.stdout
    time.sleep(0.2)
    survivors = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
                survivors.append(pid)
        except OSError:
            pass
    assert survivors == []


def test_stdin_larger_than_a_pipe_cannot_block_the_caller():
    start = time.monotonic()
    result = run("import time\ntime.sleep(60)", stdin="x" * (1 << 20), limits=SandboxLimits(wall_s=1.5))
    assert result.timed_out and time.monotonic() - start < 10


@needs_cgroups
def test_memory_and_disk_are_limited_per_sandbox():
    # Four children of 200 MB each under a 256 MB sandbox: the rlimit allows each alone, the cgroup
    # (256 MB + the tmpfs allowance) one at a time. Each holds its memory until a common moment and
    # then reports; an earlier holder may have been killed to make room for a later one, so only
    # the survivors at that moment tell what was held together.
    hog = ("import os, time\nend = time.time() + 2\nfor _ in range(4):\n    if os.fork() == 0:\n        try:\n"
           "            b = bytearray(200 << 20)\n            b[::4096] = b'x' * len(b[::4096])\n"
           "            time.sleep(max(0, end - time.time()))\n            os.write(1, b'survived\\n')\n"
           "        finally:\n            os._exit(0)\n"
           "time.sleep(max(0, end - time.time()) + 0.5)\n")
    result = run(hog, limits=SandboxLimits(wall_s=6.0, memory_mb=256))
    assert result.stdout.count("survived") <= 1, result.stdout
    filler = ("import os\nn = 0\ntry:\n    for i in range(64):\n        with open(f'f{i}', 'wb') as f:\n"
              "            f.write(os.urandom(4 << 20))\n        n += 4\nexcept OSError as e:\n    print('stopped', e.errno)\n"
              "print('wrote_mb', n)\n")
    result = run(filler, limits=SandboxLimits(wall_s=10.0, disk_mb=32))
    assert "stopped" in result.stdout and int(result.stdout.split("wrote_mb")[1]) <= 32


def test_without_isolation_code_rewards_are_refused_unless_opted_in(tmp_path):
    # A machine with no `unshare` at all (PATH without util-linux): nothing can be isolated.
    script = ("import json\nfrom asyncrl.config import VerifierEndpoint\nfrom asyncrl.rewards.verifier import Verifier\n"
              "from asyncrl.messages.structs import RewardRequest\n"
              f"req = RewardRequest(prompt_id='p', sample_idx=0, response_text='def add(a, b):\\n    return a + b\\n', "
              f"ground_truth={ADD_ASSERTS!r}, data_source='code')\n"
              "refused = Verifier().score([req])[0]\n"
              "opted = Verifier(VerifierEndpoint(code_allow_unisolated=True)).score([req])[0]\n"
              "print(json.dumps([refused.failed, refused.details.get('error', ''), opted.correct]))\n")
    env = {**os.environ, "PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120,
                         cwd=project_root())
    refused_failed, reason, opted_correct = json.loads(out.stdout.strip().splitlines()[-1])
    assert refused_failed and "cannot isolate" in reason and opted_correct
    assert "WITHOUT ISOLATION" in out.stderr  # said loudly


# --- math: bounded where production runs it -----------------------------------------------------------


def test_math_verifier_is_bounded_in_a_worker_thread():
    # (`asyncrl bench verifier` also runs \\boxed{(10^{8})!}; one runaway is enough here.)
    probes = [("\\boxed{9^{9^{9}}}", "3"), ("\\boxed{3}", "1" * 1_000_000)]
    results = []

    def score():
        for response, truth in probes + [("so \\boxed{\\frac{1}{2}}", "0.5")]:
            start = time.monotonic()
            results.append((verify("math", response, truth, math_timeout_s=4.0), time.monotonic() - start))

    worker = threading.Thread(target=score)  # the reward endpoint scores in worker threads
    worker.start()
    worker.join(timeout=90)
    assert not worker.is_alive()
    # Each runaway ends within the workers' limit (plus a worker restart), and the checker still works.
    assert all(not v.correct and seconds < 12 for v, seconds in results[:2]), results
    assert results[2][0].correct


# --- metrics --------------------------------------------------------------------------------------------


def test_suspicious_rewards_are_counted_into_the_batch_stats():
    req = RewardRequest(prompt_id="p", sample_idx=0, response_text="x", ground_truth="1", data_source="code")
    hacked = Reward(prompt_id="p", sample_idx=0, score=0.0, source="verifier", correct=False, suspicious=["early_exit"])
    judge = Reward(prompt_id="p", sample_idx=0, score=0.9, source="genrm", correct=True, suspicious=["addresses_judge"])
    combined = combine_rewards(req, RouteConfig(endpoints=["verifier", "genrm"]), {"verifier": hacked, "genrm": judge})
    assert combined.suspicious == ["addresses_judge", "early_exit"]
    assembler = Assembler(None, None, None, str, None, OverlongShaping(), 8)
    for reward in [hacked, combined, Reward(prompt_id="p", sample_idx=1, score=1.0, source="verifier", correct=True),
                   Reward(prompt_id="p", sample_idx=2, score=1.0, source="verifier", correct=True)]:
        assembler._note_scored(reward)
    assert assembler.rewards.generated_stats()["reward_suspicious_share_generated"] == 0.5
    assert assembler.rewards.counters["suspicious.early_exit"] == 2


# --- HTTP: who may ask for work, and how much -----------------------------------------------------------


def test_admin_and_score_routes_check_the_token_before_the_body(monkeypatch):
    monkeypatch.setitem(guards.ADMIN_TOKEN, "value", "")
    train = TestClient(train_app.train_api)
    malformed = {"content": b"{not json", "headers": {"content-type": "application/json"}}
    assert train.post("/admin/checkpoint", **malformed).status_code == 403  # no token configured: disabled
    monkeypatch.setitem(guards.ADMIN_TOKEN, "value", "s3cret")
    # A malformed body with no token is refused as unauthorised: the body was never parsed.
    assert train.post("/admin/reward_routes", **malformed).status_code == 401
    reward = TestClient(reward_app.reward_api)  # the test client is not on loopback
    monkeypatch.setitem(guards.REWARD_TOKEN, "value", "")
    refused = reward.post("/score", **malformed)
    assert refused.status_code == 403 and "token" in refused.json()["detail"]
    monkeypatch.setitem(guards.REWARD_TOKEN, "value", "tok")
    assert reward.post("/score", **malformed).status_code == 401
    huge = reward.post("/score", content=b"x" * (guards.MAX_SCORE_BODY_BYTES + 1),
                       headers={"authorization": "Bearer tok"})
    assert huge.status_code == 413


def test_policy_requests_are_bounded_by_their_kv_cache():
    """The policy endpoint refuses a request whose sequences could never fit one window's bounds:
    more sequences than a window holds, or a KV block over the bound at their longest."""
    from asyncrl.config import compose
    from asyncrl.engines.batch_jobs import TooLarge
    from asyncrl.engines.batching import WindowBatcher
    from asyncrl.engines.generation import build_generator_engine, sequence_input

    config = compose(["model=tiny"])
    batcher = WindowBatcher(build_generator_engine(config.model, config.engine)[0], max_rows=64, window_tokens=16,
                            max_positions=1 << 17)
    batcher.check([sequence_input([1] * 100, 0, 4096)] * 16)  # 16 x 4,211 positions: served
    with pytest.raises(TooLarge, match="KV cache") as refused:
        batcher.check([sequence_input([1] * 100, 0, 4096)] * 32)
    assert str(1 << 17) in str(refused.value)
    with pytest.raises(TooLarge, match="a window holds 64"):
        batcher.check([sequence_input([1], 0, 4)] * 65)
