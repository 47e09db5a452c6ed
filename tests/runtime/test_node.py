"""The node a process runs on: without Ray, this machine on loopback; gloo's interface is the one that holds the
node's address (the loopback range is lo's), unless the user chose one."""
import socket

from rlmegatron.runtime.node import gloo_interface, interface_of, node_address, node_id


def test_without_ray_a_run_is_one_machine_on_loopback():
    assert node_id() == socket.gethostname() and node_address() == "127.0.0.1"


def test_gloo_takes_the_interface_of_the_nodes_address_unless_set(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert interface_of("127.0.0.3") == "lo"  # only 127.0.0.1 is assigned to lo; the rest of 127/8 routes to it
    assert interface_of("192.0.2.1") is None  # TEST-NET-1: no interface of this machine holds it
    assert gloo_interface("127.0.0.4") == {"GLOO_SOCKET_IFNAME": "lo"}
    assert gloo_interface("192.0.2.1") == {}
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert gloo_interface("127.0.0.4") == {}
