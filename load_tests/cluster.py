"""A two-node Ray cluster on one machine, from network namespaces, and `asyncrl train` on it.

    sudo python load_tests/cluster.py train            # up, train (generator on the worker node,
                                                       # learner on the head), report, down
    sudo python load_tests/cluster.py serve            # the same under `serve run configs/serve.yaml`
    sudo python load_tests/cluster.py scale            # 1, 2, 4, 8 generators spread over the nodes
    sudo python load_tests/cluster.py delta            # the demo's weight updates, full against delta
                                                       # (policy.weight_delta), same node and across
    sudo python load_tests/cluster.py vllm             # vLLM generators on the worker node: full and
                                                       # delta updates into them across the nodes
    sudo python load_tests/cluster.py up | down        # leave it running / take it down

Two namespaces joined by a veth pair, each with its own address (head 10.77.0.1, worker
10.77.0.2): `ray start --head` in one with the custom resources `node_learner` and `node_head`, `ray start
--address=...` in the other with `node_generator`. The driver runs in the head's namespace and
joins with `cluster.ray_address`; roles are pinned by those resources, so the generator lands on
the worker and the learner on the head, and the weights cross the namespaces in the learner's own
gloo group, met at the head's address. Traffic stays inside the namespaces; every run is bounded
by its steps and a timeout. Needs root (`ip netns`). The node-loss and partition scenarios are in
`load_tests/faults.py` (they use `up`, `kill_worker` and `partition` from here).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_BIN = os.path.join(ROOT, ".venv", "bin")
HEAD, WORKER = "asyncrl-head", "asyncrl-worker"
HEAD_IP, WORKER_IP, PREFIX = "10.77.0.1", "10.77.0.2", 24
HEAD_LINK, WORKER_LINK = "asyncrl-h0", "asyncrl-w0"
RAY_PORT = 6379
ADDRESS = f"{HEAD_IP}:{RAY_PORT}"


def sh(*args: str, check: bool = True, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def in_ns(ns: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", ns, *args, **kwargs)


def ray_env() -> dict:
    # Ray 2.60's CLIs and drivers authenticate with a token; both nodes and the driver read the same one.
    return {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": ROOT}


def network_up() -> None:
    network_down()
    for ns in (HEAD, WORKER):
        sh("ip", "netns", "add", ns)
        in_ns(ns, "ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", HEAD_LINK, "type", "veth", "peer", "name", WORKER_LINK)
    for link, ns, ip in ((HEAD_LINK, HEAD, HEAD_IP), (WORKER_LINK, WORKER, WORKER_IP)):
        sh("ip", "link", "set", link, "netns", ns)
        in_ns(ns, "ip", "addr", "add", f"{ip}/{PREFIX}", "dev", link)
        in_ns(ns, "ip", "link", "set", link, "up")


def network_down() -> None:
    for ns in (HEAD, WORKER):
        sh("ip", "netns", "del", ns, check=False)


def ray_processes(node_ip: str) -> list[psutil.Process]:
    """Ray's daemons of one node: their command lines carry its address (`--node-ip-address=...`)."""
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        # Raylet, GCS, agents, the autoscaler monitor and the client server all name the node's address.
        if "ray" in cmd and (f"={node_ip}" in cmd or f" {node_ip} " in cmd or f"={node_ip}:" in cmd):
            out.append(proc)
    return out


def up(worker_cpus: int = 8, head_cpus: int = 8, object_store_mb: int = 1024, private_dir: str = "") -> None:
    """Both namespaces and both Ray nodes, each with the custom resource naming its role.
    `private_dir`: the worker's processes see a private, empty tmpfs there (its own mount
    namespace, which `ip netns exec` gives it): a node without the head's disk at that path. It then
    also offers `node_private` (2), for the roles a scenario places there."""
    network_up()
    common = ["--disable-usage-stats", f"--object-store-memory={object_store_mb << 20}"]
    in_ns(HEAD, f"{VENV_BIN}/ray", "start", "--head", f"--node-ip-address={HEAD_IP}", f"--port={RAY_PORT}",
          f"--num-cpus={head_cpus}", "--resources", json.dumps({"node_learner": 1, "node_head": 1}),
          "--include-dashboard=false",
          *common, env=ray_env(), timeout=180)
    resources = {"node_generator": 1, **({"node_private": 2} if private_dir else {})}
    start = [f"{VENV_BIN}/ray", "start", f"--address={ADDRESS}", f"--node-ip-address={WORKER_IP}",
             f"--num-cpus={worker_cpus}", "--resources", json.dumps(resources), *common]
    if private_dir:
        os.makedirs(private_dir, exist_ok=True)
        quoted = " ".join(f"'{arg}'" for arg in start)
        in_ns(WORKER, "sh", "-c", f"mount -t tmpfs -o size=512m tmpfs '{private_dir}' && exec {quoted}",
              env=ray_env(), timeout=180)
    else:
        in_ns(WORKER, *start, env=ray_env(), timeout=180)
    wait_nodes(2)


def wait_nodes(count: int, timeout_s: float = 120) -> list[dict]:
    script = ("import ray, json; ray.init(address='%s', log_to_driver=False); "
              "print(json.dumps([{'ip': n['NodeManagerAddress'], 'alive': n['Alive'], 'resources': n['Resources']} "
              "for n in ray.nodes()]))" % ADDRESS)
    deadline = time.time() + timeout_s
    while True:
        out = in_ns(HEAD, f"{VENV_BIN}/python", "-c", script, env=ray_env(), check=False, timeout=120)
        nodes = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []
        if sum(n["alive"] for n in nodes) >= count:
            return nodes
        if time.time() > deadline:
            raise TimeoutError(f"{count} nodes not alive in {timeout_s}s: {nodes or out.stderr[-500:]}")
        time.sleep(2)


def kill_node(node_ip: str) -> int:
    """A node's Ray processes (its raylet, GCS, agents, workers) and everything they started, by
    SIGKILL. Only this cluster's: `ray stop` would end every Ray instance on the machine."""
    victims = []
    for proc in ray_processes(node_ip):
        try:
            victims += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for proc in victims:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return len(victims)


def down() -> None:
    kill_node(WORKER_IP)
    kill_node(HEAD_IP)
    network_down()
    # `ray start --head` left its address for `ray.init()` to join: a later local run would try
    # to join the cluster that is gone.
    current = "/tmp/ray/ray_current_cluster"
    if os.path.exists(current) and ADDRESS in open(current).read():
        os.remove(current)


def kill_worker() -> int:
    """The worker node dies: its raylet and every process it started (SIGKILL, as a host crash)."""
    return kill_node(WORKER_IP)


def partition(down_s: float) -> None:
    """The worker's link goes down for `down_s` seconds, then comes back."""
    in_ns(WORKER, "ip", "link", "set", WORKER_LINK, "down")
    time.sleep(down_s)
    in_ns(WORKER, "ip", "link", "set", WORKER_LINK, "up")


def run_in_head(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """A driver in the head's namespace (it reaches the cluster at the head's address)."""
    return in_ns(HEAD, *args, env={**ray_env(), "RAY_ADDRESS": ADDRESS, "WANDB_MODE": "disabled"},
                 timeout=timeout_s, check=False)


def train(steps: int, generators: int, placement: list[str], run_dir: str, timeout_s: float = 900) -> dict:
    """`asyncrl train` on the cluster; what the run reports, and where each role ran."""
    args = [f"{VENV_BIN}/asyncrl", "train", "model=tiny", "task=tiny", "algorithm=grpo",
            f"trainer.total_steps={steps}", f"cluster.num_generators={generators}", f"trainer.run_dir={run_dir}",
            f"cluster.ray_address={ADDRESS}", "trainer.checkpoint_every=0", *placement]
    start = time.time()
    out = run_in_head(args, timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"asyncrl train failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    status = summary["final_status"]
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    wall = records[-1]["wall_time_s"]
    return {"generators": generators, "steps": summary["steps"], "wall_s": round(time.time() - start, 1),
            "samples_per_s": status["samples_trained"] / wall, "learner_node": status["learner_node"],
            "weight_versions": {f"{g['generator_id']}@{g['node_ip']}": g["delivered_version"] for g in status["generators"]},
            "learner_version": status["weight_version"], "weight_paths": status["last_broadcast"].get("paths"),
            "broadcast_s": status["last_broadcast"].get("total_s"),
            "generator_busy": status["generator_busy_fraction"], "learner_busy": status["learner_busy_fraction"],
            "assembler_busy_events": status["assembler"].get("event_calls"),
            "ledger": {k: status["ledger"][k] for k in ("admitted", "trained", "dropped", "in_flight", "duplicates")}
                      | {"problems": status["ledger"]["problems"]},
            "eval_before": summary["eval_before"]["accuracy"], "eval_after": summary["eval_after"]["accuracy"]}


PINNED = ["engine.resources={node_generator: 1}", "policy.compute.resources={node_learner: 1}"]


def serve(steps: int, out_dir: str, timeout_s: float = 600) -> dict:
    """`serve run configs/serve.yaml` against the cluster (its train application pinned as `train`
    pins it): where each part landed, the weight versions per node, the ledger, once the learner
    has taken `steps` steps; then Ctrl-C, as from a terminal."""
    import yaml

    spec = yaml.safe_load(open(os.path.join(ROOT, "configs", "serve.yaml")))
    for app in spec["applications"]:
        if app["name"] == "train":  # no spaces inside an override: the string is split on them
            app["args"]["overrides"] += " " + " ".join(p.replace(" ", "") for p in PINNED)
    path = os.path.join(out_dir, "serve.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(spec, f)
    env = {**os.environ, **ray_env(), "RAY_ADDRESS": ADDRESS, "WANDB_MODE": "disabled"}
    proc = subprocess.Popen(["ip", "netns", "exec", HEAD, f"{VENV_BIN}/serve", "run", path], env=env, cwd=ROOT,
                            stdout=open(os.path.join(out_dir, "serve.log"), "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    probe = ("import httpx, json; print(json.dumps(httpx.get('http://127.0.0.1:8000/train/status', timeout=10).json()))")
    start, status = time.time(), {}
    try:
        while time.time() - start < timeout_s and proc.poll() is None:
            out = in_ns(HEAD, f"{VENV_BIN}/python", "-c", probe, check=False, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                status = json.loads(out.stdout.strip().splitlines()[-1])
                if status.get("step", 0) >= steps:
                    break
            time.sleep(3)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    if status.get("step", 0) < steps:
        raise RuntimeError(f"serve run reached step {status.get('step')} in {timeout_s}s; see {out_dir}/serve.log")
    return {"steps": status["step"], "seconds_to_step": round(time.time() - start, 1),
            "learner_node": status["learner_node"], "learner_version": status["weight_version"],
            "weight_versions": {f"{g['generator_id']}@{g['node_ip']}": g["delivered_version"] for g in status["generators"]},
            "weight_paths": status["last_broadcast"].get("paths"),
            "ledger": {k: status["ledger"][k] for k in ("admitted", "trained", "dropped", "in_flight", "duplicates")}
                      | {"problems": status["ledger"]["problems"]}}


# The demo (the embedded model on its arithmetic task) with the generator's engine in bfloat16: a
# delta is what changed in the engine's dtype, so it needs the dtype named (`auto` measures it per
# generator); one held-out prompt, no checkpoints: the run is there for its weight updates.
DELTA_RUN = ["engine.dtype=bfloat16", "trainer.eval_samples=1", "trainer.checkpoint_every=0",
             "policy.compute.resources={node_learner: 1}"]
DELTA_PLACEMENTS = {"same_node": "engine.resources={node_head: 1}", "across_nodes": "engine.resources={node_generator: 1}"}


def delta(steps: int, out_dir: str, timeout_s: float = 1800) -> dict:
    """Full against delta weight updates (`policy.weight_delta`) in the demo, its generator on the
    learner's node (path `shm`) and on the other node (path `group`): per step, the bytes and seconds
    of the update after it and the share of the engine's values that changed."""
    out = {}
    for placement, pin in DELTA_PLACEMENTS.items():
        for variant, extra in (("full", []), ("delta", ["policy.weight_delta=true"])):
            run_dir = tempfile.mkdtemp(prefix=f"cluster-delta-{placement}-{variant}-", dir=out_dir)
            args = [f"{VENV_BIN}/asyncrl", "train", f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}",
                    f"cluster.ray_address={ADDRESS}", *DELTA_RUN, pin, *extra]
            done = run_in_head(args, timeout_s)
            if done.returncode != 0:
                raise RuntimeError(f"asyncrl train failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            status = json.load(open(os.path.join(run_dir, "summary.json")))["final_status"]
            records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
            row = {"paths": status["last_broadcast"].get("paths"),
                   "generator_node": [g["node_ip"] for g in status["generators"]],
                   "bytes": [r["broadcast_bytes"] for r in records], "seconds": [r["broadcast_s"] for r in records],
                   "changed_fraction": [r.get("delta_changed_fraction") for r in records],
                   "ledger_problems": status["ledger"]["problems"]}
            out[f"{placement}_{variant}"] = row
            print(placement, variant, json.dumps(row), flush=True)
    return out


# The tiny task with a vLLM generator on the worker node (the whole cluster runs .venv-vllm's Ray:
# its nodes must match), its learner on the head; every version crosses the nodes in the learner's
# gloo group and is loaded into the running vLLM by tensors (`VLLMEngine.update_weights`).
# Synchronous (each batch generated under the version the learner trains next), so that every
# step's gap between vLLM's log-probs and the learner's says whether that version arrived whole.
VLLM_RUN = ["engine=vllm", "model=tiny", "model.num_heads=2", "task=tiny", "algorithm=grpo", "engine.vllm_kv_cache_mb=64",
            "trainer.synchronous=true", "algorithm.max_staleness_versions=0", "trainer.checkpoint_every=0", *PINNED]


def vllm(steps: int, out_dir: str, timeout_s: float = 900) -> dict:
    """Full and delta weight updates into a vLLM generator on the other node: per run the path, the
    versions each generator holds, bytes and seconds per update, and the gap between vLLM's log-probs
    and the learner's on the steps whose tokens were all of the version the engine held."""
    out = {}
    for variant, extra in (("full", []), ("delta", ["policy.weight_delta=true"])):
        run_dir = tempfile.mkdtemp(prefix=f"cluster-vllm-{variant}-", dir=out_dir)
        args = [f"{VENV_BIN}/asyncrl", "train", f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}",
                f"cluster.ray_address={ADDRESS}", *VLLM_RUN, *extra]
        start = time.time()
        done = run_in_head(args, timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"asyncrl train failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        summary = json.load(open(os.path.join(run_dir, "summary.json")))
        status = summary["final_status"]
        records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        fresh = [r["rollout_kl_k3"] for r in records if r["staleness_max"] == 0 and "rollout_kl_k3" in r]
        row = {"wall_s": round(time.time() - start, 1), "steps": summary["steps"],
               "paths": status["last_broadcast"].get("paths"), "learner_version": status["weight_version"],
               "weight_versions": {f"{g['generator_id']}@{g['node_ip']}": g["delivered_version"] for g in status["generators"]},
               "bytes": [r["broadcast_bytes"] for r in records], "seconds": [r["broadcast_s"] for r in records],
               "changed_fraction": [r.get("delta_changed_fraction") for r in records],
               "rollout_kl_k3_fresh_max": max(fresh) if fresh else None, "fresh_steps": len(fresh),
               "reward_first_last": [records[0].get("reward_mean_generated"), records[-1].get("reward_mean_generated")],
               "ledger_problems": status["ledger"]["problems"]}
        out[variant] = row
        print(variant, json.dumps(row), flush=True)
    return out


def delta_table(result: dict) -> str:
    """One line per run: the medians over its updates after the first (a step's record before any
    update has 0 bytes; a delta's first update is the whole version)."""
    lines = ["| placement | variant | path | bytes / update | s / update | changed values |", "|---|---|---|---|---|---|"]
    for key, row in result.items():
        placement, variant = key.rsplit("_", 1)
        updates = [i for i, sent in enumerate(row["bytes"]) if sent]
        later = updates[1:] or updates
        changed = [row["changed_fraction"][i] for i in later if row["changed_fraction"][i] is not None]
        lines.append(f"| {placement.replace('_', ' ')} | {variant} | {','.join(row['paths'] or [])} | "
                     f"{statistics.median(row['bytes'][i] for i in later) / 1e6:.1f} MB | "
                     f"{statistics.median(row['seconds'][i] for i in later):.2f} | "
                     + (f"{100 * statistics.median(changed):.1f}% |" if changed else " |"))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "down", "train", "serve", "scale", "delta", "vllm"])
    parser.add_argument("--steps", type=int, help="learner steps a run takes (default 40; delta: 4, the demo's steps are long)")
    parser.add_argument("--generators", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--out", default=os.path.join(ROOT, "outputs", "cluster"))
    args = parser.parse_args()
    args.steps = args.steps or {"delta": 4, "vllm": 10}.get(args.command, 40)
    if args.command == "vllm":  # every node and the driver from vLLM's venv (`make vllm`)
        global VENV_BIN
        VENV_BIN = os.path.join(ROOT, ".venv-vllm", "bin")
    if os.geteuid() != 0:
        print("needs root (ip netns)", file=sys.stderr)
        return 2
    if args.command == "down":
        down()
        return 0
    up()
    if args.command == "up":
        print(f"cluster up: head {HEAD_IP} (namespace {HEAD}), worker {WORKER_IP} (namespace {WORKER})")
        return 0
    os.makedirs(args.out, exist_ok=True)
    try:
        if args.command == "vllm":
            result = vllm(args.steps, tempfile.mkdtemp(prefix="cluster-vllm-", dir=args.out))
            ok = all(not r["ledger_problems"] and r["paths"] == ["group"] and r["rollout_kl_k3_fresh_max"] is not None
                     and r["rollout_kl_k3_fresh_max"] < 1e-3 and min(r["weight_versions"].values()) >= r["learner_version"] - 1
                     for r in result.values())
        elif args.command == "delta":
            result = delta(args.steps, tempfile.mkdtemp(prefix="cluster-delta-", dir=args.out))
            print(delta_table(result))
            ok = (not any(r["ledger_problems"] for r in result.values())
                  and result["across_nodes_delta"]["paths"] == ["group"] and result["same_node_delta"]["paths"] == ["shm"])
        elif args.command in ("train", "serve"):
            out_dir = tempfile.mkdtemp(prefix=f"cluster-{args.command}-", dir=args.out)
            result = (train(args.steps, 1, PINNED, out_dir) if args.command == "train"
                      else serve(min(args.steps, 10), out_dir))
            print(json.dumps(result, indent=1))
            # A finished run's generators hold the last version (or the one before); a live one's
            # may be a broadcast behind besides.
            lag = 1 if args.command == "train" else 2
            ok = (result["weight_paths"] == ["group"] and not result["ledger"]["problems"]
                  and all(v >= result["learner_version"] - lag for v in result["weight_versions"].values()))
        else:
            rows = []
            for n in args.generators:
                rows.append(train(args.steps, n, ["cluster.placement=spread", "cluster.segment_shards=2"],
                                  tempfile.mkdtemp(prefix=f"cluster-scale-{n}-", dir=args.out)))
                print(json.dumps(rows[-1]), flush=True)
            result, ok = {"scale": rows}, all(not r["ledger"]["problems"] for r in rows)
        with open(os.path.join(args.out, f"cluster_{args.command}.json"), "w") as f:
            json.dump(result, f, indent=1)
    finally:
        down()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
