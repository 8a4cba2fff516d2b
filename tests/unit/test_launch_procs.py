"""The launcher's supervision (``launch_procs.py``) with real processes: what a child started (its grandchild, in
the child's process group, as a vLLM worker's engine core is) does not outlive the child, whether the child crashed
while the mesh serves on, or the mesh was stopped; a grandchild that ignores SIGTERM is SIGKILLed after the grace."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from embedmesh import launch_procs
from embedmesh.launch_procs import MeshProcess
from tests.support.process_tree import alive, read_pid, wait_gone

ROOT = Path(__file__).resolve().parents[2]
GRACE = 0.5
"""The group grace of these tests: short, so a grandchild ignoring SIGTERM is SIGKILLed soon."""


class _Tree:
    """Children started as the launcher starts its services, each with a grandchild in its group."""

    def __init__(self, tmp_path: Path, on_term: str, names: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.procs: list[MeshProcess] = []
        self.grandchildren: dict[str, int] = {}
        for name in names:
            proc = launch_procs.spawn_process(name, "tests.support.process_tree",
                                              [str(tmp_path / f"{name}.pid"), on_term], env)
            self.procs.append(MeshProcess(name, "", proc))
        for name in names:
            self.grandchildren[name] = read_pid(tmp_path / f"{name}.pid")

    def child(self, name: str) -> int:
        return next(p.proc.pid for p in self.procs if p.name == name)

    def close(self) -> None:
        for pid in [*(p.proc.pid for p in self.procs), *self.grandchildren.values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs:
            p.proc.wait()


@pytest.mark.parametrize("on_term", ["term", "ignore"])
def test_a_crashed_childs_grandchild_is_stopped_while_the_mesh_serves_on(tmp_path: Path, on_term: str) -> None:
    tree = _Tree(tmp_path, on_term, ["worker-0", "worker-1"])
    try:
        # Each grandchild is in its child's group (the child's session): what the launcher signals.
        assert all(os.getpgid(tree.grandchildren[p.name]) == p.proc.pid for p in tree.procs)
        result: list[int] = []
        watcher = threading.Thread(target=lambda: result.append(launch_procs.watch(tree.procs, 10, GRACE)),
                                   daemon=True)
        watcher.start()
        os.kill(tree.child("worker-0"), signal.SIGKILL)  # the child alone, as an OOM kill or a crash ends it
        assert wait_gone([tree.grandchildren["worker-0"]]) == []
        # One worker of two gone: the mesh serves on, the other worker and its engine untouched.
        assert watcher.is_alive() and result == []
        assert alive(tree.child("worker-1")) and alive(tree.grandchildren["worker-1"])

        os.kill(tree.child("worker-1"), signal.SIGKILL)  # the last worker: the watch stops the mesh
        watcher.join(60)
        assert result == [1]
        assert wait_gone([tree.grandchildren["worker-1"]]) == []
    finally:
        tree.close()


@pytest.mark.parametrize("on_term", ["term", "ignore"])
def test_stopping_the_mesh_stops_what_every_child_started(tmp_path: Path, on_term: str) -> None:
    tree = _Tree(tmp_path, on_term, ["worker-0", "preprocessor", "gateway"])
    try:
        launch_procs.stop_all(tree.procs, grace=30, group_grace=GRACE)
        assert [p.name for p in tree.procs if p.proc.returncode != -signal.SIGTERM] == []  # each child: SIGTERM
        assert wait_gone(list(tree.grandchildren.values())) == []
    finally:
        tree.close()


def test_a_second_ctrl_c_kills_every_childs_whole_group(tmp_path: Path) -> None:
    tree = _Tree(tmp_path, "ignore", ["worker-0", "gateway"])
    try:
        launch_procs.force_stop(tree.procs)
        assert [p.proc.returncode for p in tree.procs] == [-signal.SIGKILL, -signal.SIGKILL]
        assert wait_gone(list(tree.grandchildren.values())) == []
    finally:
        tree.close()


def test_a_gone_childs_group_gets_sigterm_first_and_no_other_group_is_signalled(tmp_path: Path) -> None:
    """The group of a gone child gets SIGTERM at once (its SIGKILL is a minute away here); the launcher's own group
    (0) and init's (1) are never signalled."""
    tree = _Tree(tmp_path, "term", ["worker-0"])
    try:
        groups = launch_procs.ProcessGroups(grace=60)
        for pgid in (0, 1):
            groups.end(pgid)
        assert not groups.pending()  # and this test's process still runs
        os.kill(tree.child("worker-0"), signal.SIGKILL)
        tree.procs[0].proc.wait()
        groups.end(tree.child("worker-0"))
        assert groups.pending()
        assert wait_gone([tree.grandchildren["worker-0"]]) == []  # went on SIGTERM, long before its SIGKILL
    finally:
        tree.close()


def test_the_mesh_serves_on_without_its_image_encoders_but_not_without_its_preprocessor(tmp_path: Path) -> None:
    tree = _Tree(tmp_path, "term", ["image-encoder-0", "preprocessor"])
    try:
        result: list[int] = []
        watcher = threading.Thread(target=lambda: result.append(launch_procs.watch(tree.procs, 10, GRACE)),
                                   daemon=True)
        watcher.start()
        os.kill(tree.child("image-encoder-0"), signal.SIGKILL)  # the last image encoder: text is still served
        assert wait_gone([tree.grandchildren["image-encoder-0"]]) == []
        assert watcher.is_alive() and result == [] and alive(tree.child("preprocessor"))
        os.kill(tree.child("preprocessor"), signal.SIGKILL)
        watcher.join(60)
        assert result == [1]
    finally:
        tree.close()
