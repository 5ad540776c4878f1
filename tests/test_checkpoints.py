"""Checkpoints a run of days can trust: durable before they are visible, the only copy never deleted
before its replacement is in place, a full disk stopping the run with one error (not a loop of
restarts), and checkpoints that reach the run directory from a learner whose node cannot see it."""

import errno
import os
import shutil
import subprocess
import sys
import time

import pytest
import ray

from asyncrl.config import compose
from asyncrl.run import Run
from asyncrl.storage import checkpoint, checkpoint_parts
from asyncrl.storage.checkpoint_transfer import WriterClient, local_copy, write_part

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs (root)")


def write_checkpoint(run_dir, step: int, payload: bytes = b"x" * 100, keep: int = 1) -> str:
    tmp = checkpoint.begin(str(run_dir), step)
    os.makedirs(os.path.join(tmp, "policy"))
    with open(os.path.join(tmp, "policy", "model.safetensors"), "wb") as f:
        f.write(payload)
    checkpoint_parts.save_json({"step": step}, os.path.join(tmp, "learner.json"))
    return checkpoint.commit(tmp, step, keep)


def test_every_file_and_directory_is_durable_before_the_rename(tmp_path, monkeypatch):
    # Watch the real calls (each still runs): which paths were fsynced before the commit's rename.
    synced, renamed_at = [], []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "rename", lambda a, b: (renamed_at.append(len(synced)), real_rename(a, b)))
    final = write_checkpoint(tmp_path, 3)
    tmp = final + ".tmp"
    before_rename = set(synced[: renamed_at[-1]])
    files = {os.path.join(tmp, rel) for rel in ("policy/model.safetensors", "learner.json", checkpoint.MANIFEST)}
    assert files <= before_rename, files - before_rename
    assert {tmp, os.path.join(tmp, "policy")} <= before_rename  # the directories' entries too
    assert os.path.dirname(final) in synced[renamed_at[-1]:]  # and the rename itself


def test_saving_a_step_again_keeps_the_only_copy_until_replaced(tmp_path, monkeypatch):
    first = write_checkpoint(tmp_path, 6, payload=b"first")
    # The process dies as it renames the new copy into place (a crash between the two renames).
    real_rename = os.rename

    def dies_at_the_commit(src, dst):
        if src.endswith(".tmp"):
            raise OSError(errno.EIO, "killed here")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", dies_at_the_commit)
    with pytest.raises(OSError, match="killed here"):
        write_checkpoint(tmp_path, 6, payload=b"second")
    monkeypatch.setattr(os, "rename", real_rename)
    path, rejected = checkpoint.latest_valid(str(tmp_path))
    assert path is not None and rejected == [], "the only checkpoint was deleted before its replacement"
    assert open(os.path.join(path, "policy", "model.safetensors"), "rb").read() == b"first"
    # The next commit of that step takes its place and leaves nothing set aside.
    again = write_checkpoint(tmp_path, 6, payload=b"third")
    assert again == first and checkpoint.latest_valid(str(tmp_path))[0] == first
    assert open(os.path.join(first, "policy", "model.safetensors"), "rb").read() == b"third"
    assert sorted(os.listdir(checkpoint.checkpoints_dir(str(tmp_path)))) == ["step_00000006"]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs at `<tmp_path>/run/checkpoints`: the run's checkpoints on a disk of their own."""
    target = tmp_path / "run" / "checkpoints"
    target.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(target)], check=True)
    yield tmp_path / "run"
    subprocess.run(["umount", "-l", str(target)], check=False)


def fill(directory) -> str:
    """Take every free byte of the filesystem of `directory`; the filler's path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (256 << 10))
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return path


@needs_root
def test_a_full_disk_gives_one_clear_error_and_keeps_the_last_checkpoint(small_disk):
    run_dir = str(small_disk)
    writer = WriterClient.local(run_dir)
    kept = write_checkpoint(run_dir, 3)
    filler = fill(checkpoint.checkpoints_dir(run_dir))
    tmp = writer.call("begin", 6)
    with pytest.raises(checkpoint.CheckpointWriteError) as refused:
        write_part(writer, tmp, lambda d: open(os.path.join(d, "part.bin"), "wb").write(b"y" * (1 << 20)))
    message = str(refused.value)
    assert "step 6" in message and "No space left on device" in message and "step_00000003" in message
    assert "resume=true" in message
    writer.call("discard", tmp)
    # The commit's own writes (the manifest) on a full disk: the same error, its partial directory gone.
    tmp = writer.call("begin", 6)
    os.remove(filler)
    with open(os.path.join(tmp, "data.bin"), "wb") as f:
        f.write(b"z" * 1000)
    fill(checkpoint.checkpoints_dir(run_dir))
    with pytest.raises(checkpoint.CheckpointWriteError, match="No space left"):
        writer.call("commit", tmp, 6, 1)
    assert not os.path.exists(tmp)
    assert checkpoint.latest_valid(run_dir) == (kept, [])


@pytest.mark.slow
@needs_root
def test_a_run_on_a_full_disk_stops_with_one_error_and_no_restarts(ray_session, small_disk):
    run_dir = str(small_disk)
    config = compose(["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2",
                      "trainer.checkpoint_every=1", "trainer.max_restarts=3", f"trainer.run_dir={run_dir}"])
    run = Run(config, run_dir).start()
    try:
        deadline = time.time() + 240
        while not checkpoint.committed(checkpoint.checkpoints_dir(run_dir)):
            assert time.time() < deadline
            run.poll()
            time.sleep(0.2)
        fill(checkpoint.checkpoints_dir(run_dir))  # the disk fills up after the first checkpoint
        with pytest.raises(checkpoint.DiskRefused) as stopped:
            while time.time() < deadline:
                run.poll()
                time.sleep(0.2)
        assert run.restarts == []  # one error, not a restart that meets the same disk
        assert "No space left on device" in str(stopped.value) and "step_00000001" in str(stopped.value)
        assert "Traceback" not in str(stopped.value)
        path, rejected = checkpoint.latest_valid(run_dir)
        assert path.endswith("step_00000001") and rejected == []
        assert not [n for n in os.listdir(checkpoint.checkpoints_dir(run_dir)) if n.endswith(".tmp")]
    finally:
        run.stop()


# --- a learner on a node that does not see the run directory --------------------------------------------


@pytest.fixture
def private_node(ray_session, tmp_path):
    """A second Ray node joined to this session, whose processes see a private, empty tmpfs where
    `<tmp_path>/run` is (a mount namespace of its own): a node without the run directory's disk.
    It offers the resource `private_disk` (2) and no CPU, so only what asks for it lands there."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "only-on-the-head").write_text("")
    gcs = ray.get_runtime_context().gcs_address
    alive = len([n for n in ray.nodes() if n["Alive"]])
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    node = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size=256m tmpfs {run_dir} && exec {ray_cli} start --address={gcs} --num-cpus=0 "
         f"--resources='{{\"private_disk\": 2}}' --block --disable-usage-stats"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while len([n for n in ray.nodes() if n["Alive"]]) <= alive:
        assert node.poll() is None and time.time() < deadline, "the second node did not join"
        time.sleep(1)
    yield str(run_dir)
    os.killpg(node.pid, 9)
    node.wait()
    # `ray start` left the session's address for a later `ray.init()` to join: it is gone with the test.
    current = "/tmp/ray/ray_current_cluster"
    if os.path.exists(current) and gcs in open(current).read():
        os.remove(current)


@ray.remote(num_cpus=0, resources={"private_disk": 0.01})
def listing_there(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


@pytest.mark.slow
@needs_root
def test_a_learner_whose_node_does_not_see_the_run_directory(private_node):
    run_dir = private_node
    assert ray.get(listing_there.remote(run_dir)) == []  # the node sees its own empty directory there
    # T-PPO: the policy learner and the value learner both on that node, each writing its part.
    overrides = ["model=tiny", "task=tiny_seq", "algorithm=tppo", "engine.window_tokens=2",
                 "trainer.prompts_per_step=2", "trainer.checkpoint_every=0", f"trainer.run_dir={run_dir}",
                 "policy.compute.resources={private_disk: 1}", "critic.compute.resources={private_disk: 0.5}"]
    first = Run(compose(overrides), run_dir, name_learner=False).start()
    try:
        nodes = {name: first.node_id(name) for name in ("learner", "value_learner")}
        head = ray.get_runtime_context().get_node_id()
        assert head not in nodes.values()
        deadline = time.time() + 240
        while first.role_stats("learner")["step"] < 2:
            assert time.time() < deadline
            first.check_alive()
            time.sleep(0.5)
        first.stop_learning()
        path = first.checkpoint()  # written on the head, where the driver reads it
        assert path.startswith(run_dir) and checkpoint.verify(path)["step"] >= 0
        files = set(checkpoint.verify(path)["files"])
        assert {"learner.json", "learner.pt", "prompt_source.msgpack", "value/model.safetensors",
                "value/state.json"} <= files and any(f.startswith("policy/") for f in files)
        assert "checkpoints" not in ray.get(listing_there.remote(run_dir))  # nothing landed on the node's disk
        step = checkpoint_parts.load_json(os.path.join(path, "learner.json"))["step"]
    finally:
        first.stop()
    # Resumed: the learners on that node read the checkpoint through the head's writer.
    second = Run(compose(overrides + ["resume=true"]), run_dir, name_learner=False).start()
    try:
        assert second.resumed["checkpoint"] == path and second.resumed["step"] == step
        learner = second.role_stats("learner")  # (it may have trained on meanwhile)
        assert learner["step"] >= step >= 2 and learner["incarnation"] == 1
        value = second.role_stats("value_learner")
        saved_value = checkpoint_parts.load_json(os.path.join(path, "value", "state.json"))["version"]
        assert value["value_version"] >= saved_value
    finally:
        second.stop()


def test_parts_are_shipped_where_the_directory_is_not_seen(tmp_path, monkeypatch):
    # A writer whose marker this process cannot read: it behaves as on another node (ship and fetch).
    writer = WriterClient.local(str(tmp_path / "run"))
    elsewhere = WriterClient(writer.target, writer.marker + ".not-here", writer.token)
    assert writer.sees_directory() and not elsewhere.sees_directory()
    tmp = writer.call("begin", 2)
    payload = os.urandom(3 * (1 << 20) + 5)

    def part(directory):
        os.makedirs(os.path.join(directory, "value"))
        open(os.path.join(directory, "value", "model.safetensors"), "wb").write(payload)
        open(os.path.join(directory, "empty"), "wb").close()

    import asyncrl.storage.checkpoint_transfer as transfer

    monkeypatch.setattr(transfer, "CHUNK_BYTES", 1 << 20)  # several chunks per file
    write_part(elsewhere, tmp, part)
    path = writer.call("commit", tmp, 2, 1)
    with local_copy(elsewhere, path, ["value"]) as local:
        assert local != path and open(os.path.join(local, "value", "model.safetensors"), "rb").read() == payload
    assert not os.path.exists(local)
    assert set(checkpoint.verify(path)["files"]) == {"value/model.safetensors", "empty"}
    with pytest.raises(ValueError, match="outside"):
        writer.call("write", tmp, "../../escape", 0, b"x")
    shutil.rmtree(tmp_path / "run")


@ray.remote(num_cpus=0)
class AsyncPartOwner:
    """A role as the learners are (an asyncio actor) shipping a checkpoint part to a writer actor
    whose directory it does not see, with Ray's warnings of this process collected."""

    def __init__(self):
        import logging

        self.warnings: list[str] = []
        collect = logging.Handler(logging.WARNING)
        collect.emit = lambda record: self.warnings.append(record.getMessage())
        logging.getLogger("ray").addHandler(collect)

    async def ship(self, writer: WriterClient, tmp: str, payload: bytes) -> tuple[list[str], str]:
        import asyncio

        def part(directory):
            open(os.path.join(directory, "part.bin"), "wb").write(payload)

        await asyncio.to_thread(write_part, writer, tmp, part)  # as the learners write theirs
        try:
            write_part(writer, tmp, part)  # on the event loop: refused, not a loop stopped for the upload
            on_the_loop = ""
        except RuntimeError as exc:
            on_the_loop = str(exc)
        return self.warnings, on_the_loop


def test_an_async_role_ships_its_part_off_its_event_loop_without_a_blocking_get(ray_session, tmp_path):
    run_dir = str(tmp_path / "run")
    writer = WriterClient.spawn(run_dir, lambda cls, **kwargs: ray.remote(num_cpus=0)(cls).remote(**kwargs))
    elsewhere = WriterClient(writer.target, writer.marker + ".not-here", writer.token)  # as on another node
    tmp = writer.call("begin", 4)
    payload = os.urandom(1 << 20)
    warnings, on_the_loop = ray.get(AsyncPartOwner.remote().ship.remote(elsewhere, tmp, payload))
    assert not [w for w in warnings if "blocking ray.get" in w], warnings
    assert "event loop" in on_the_loop and "asyncio.to_thread" in on_the_loop
    path = writer.call("commit", tmp, 4, 1)
    assert open(os.path.join(path, "part.bin"), "rb").read() == payload
