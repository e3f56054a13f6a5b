"""Whether work on the driver's disk must stay on the driver's node: a question about Ray's node list, asked
without Ray."""

from __future__ import annotations

from pipeline.runtime.locality import must_pin_to_driver


def node(node_id: str, address: str, alive: bool = True) -> dict:
    return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive}


ONE_HOST = [node("a", "10.0.0.1"), node("b", "10.0.0.1"), node("c", "10.0.0.1")]  # a local multi-node cluster
TWO_HOSTS = [*ONE_HOST, node("d", "10.0.0.2")]


def test_a_local_path_pins_work_to_the_driver_only_when_a_live_node_is_on_another_host():
    assert must_pin_to_driver(True, TWO_HOSTS, "b")
    assert must_pin_to_driver(True, TWO_HOSTS, "d")  # the driver on the other host: the rest cannot reach it
    assert not must_pin_to_driver(True, ONE_HOST, "a")  # every node reads the driver's disk
    assert not must_pin_to_driver(True, [node("a", "10.0.0.1")], "a")
    gone = node("d", "10.0.0.2", alive=False)  # a node that left
    assert not must_pin_to_driver(True, [*ONE_HOST, gone], "b")


def test_nothing_on_the_drivers_disk_never_pins():
    assert not must_pin_to_driver(False, TWO_HOSTS, "a")
    assert not must_pin_to_driver(False, ONE_HOST, "a")


def test_a_node_entry_without_a_liveness_flag_counts_as_live():
    unflagged = {"NodeID": "a", "NodeManagerAddress": "10.0.0.1"}
    assert must_pin_to_driver(True, [unflagged, node("b", "10.0.0.2")], "a")
