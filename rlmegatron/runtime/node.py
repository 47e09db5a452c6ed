"""The node this process runs on: its identity and the address other nodes reach it at.

Under Ray (a trainer rank, a rollout-pool host, the driver of a Ray run) a node is a Ray node: its id, and the IP it
was started with (`ray start --node-ip-address`, which the cluster's other nodes already reach it at). Without Ray a
run has one machine, so its hostname and loopback. Never `gethostbyname(gethostname())`: on Debian hosts that is
often 127.0.1.1 (/etc/hosts), which no other node reaches, and every Ray node of a cluster on one machine
(launch/local_cluster.sh) has the same hostname.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
from typing import Optional

_SIOCGIFADDR = 0x8915


def _ray():
    """Ray, where this process is connected to a Ray cluster (looked up, never imported: a process without Ray)."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def node_id() -> str:
    ray = _ray()
    return ray.get_runtime_context().get_node_id() if ray is not None else socket.gethostname()


def node_address() -> str:
    ray = _ray()
    if ray is None:
        return "127.0.0.1"
    import ray.util  # lazy: only where Ray is already imported

    return ray.util.get_node_ip_address()


def interface_of(address: str) -> Optional[str]:
    """The network interface that holds `address` (None: none of this machine's). The loopback range is `lo`'s
    whatever address of it is asked (only 127.0.0.1 is assigned to it, the rest is routed to it)."""
    if ipaddress.ip_address(address).is_loopback:
        return next((name for _, name in socket.if_nameindex() if name == "lo"), None)
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def gloo_interface(address: str) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for a rank on the node at `address`, unless the user set it: gloo otherwise binds the
    address its hostname resolves to (127.0.1.1 on Debian hosts), which ranks on other nodes cannot reach."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return {}
    name = interface_of(address)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}
