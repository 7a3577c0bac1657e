"""``RayCluster``'s node monitors are used from two threads of the registry (its sampling loop
and ``POST /admin/registry/reset``), each through ``off_loop``. Ray's calls are faked here."""

from __future__ import annotations

import ray

from hive_apps.control.cluster import NodeInfo, RayCluster


class FakeActor:
    def __init__(self, node_id: str):
        self.node_id = node_id
        self.sample = self  # ``actor.sample.remote()``

    def remote(self) -> str:
        return self.node_id


class FakeRemote:
    def options(self, **_) -> FakeRemote:
        return self

    def remote(self, node_id: str, labels: dict) -> FakeActor:
        return FakeActor(node_id)


A, B, C = ("a" * 56, "b" * 56, "c" * 56)  # Ray node ids are hex


def nodes(*ids: str) -> list[NodeInfo]:
    return [NodeInfo(node_id=i, alive=True, labels={}) for i in ids]


def test_a_reset_while_the_registry_samples_neither_fails_nor_loses_a_monitor(monkeypatch):
    """The sampler running in the middle of a reset (here: from inside the reset's first kill)
    once made the reset fail with "dictionary changed size during iteration": a 500 on
    ``POST /admin/registry/reset``, found by the cluster tier's API fuzzing."""
    cluster = RayCluster()
    killed: list[str] = []

    def kill(actor: FakeActor) -> None:
        if not killed:  # the other thread samples now, and a node has joined
            assert set(cluster.sample_nodes(nodes(A, B, C))) == {A, B, C}
        killed.append(actor.node_id)

    monkeypatch.setattr(ray, "remote", lambda **_: lambda cls: FakeRemote())
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: f"sample of {ref}")
    monkeypatch.setattr(ray, "kill", kill)
    assert cluster.sample_nodes(nodes(A, B)) == {A: f"sample of {A}", B: f"sample of {B}"}
    cluster.reset_monitors()
    assert sorted(killed) == [A, B]  # the monitors there were when the reset began
    assert set(cluster._monitors) == {A, B, C}  # what the sampler made since stays


def test_a_monitor_that_fails_is_replaced_next_time(monkeypatch):
    cluster = RayCluster()
    made: list[str] = []

    def remote(**_):
        def wrap(cls):
            class Made(FakeRemote):
                def remote(self, node_id, labels):
                    made.append(node_id)
                    return FakeActor(node_id)
            return Made()
        return wrap

    def get(ref, timeout=None):
        if ref == B and made.count(B) == 1:
            raise TimeoutError("the monitor hangs")
        return f"sample of {ref}"

    monkeypatch.setattr(ray, "remote", remote)
    monkeypatch.setattr(ray, "get", get)
    first = cluster.sample_nodes(nodes(A, B))
    assert first[A] == f"sample of {A}" and isinstance(first[B], TimeoutError)
    assert cluster.sample_nodes(nodes(A, B)) == {A: f"sample of {A}", B: f"sample of {B}"}
    assert made == [A, B, B]
