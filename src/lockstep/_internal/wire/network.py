"""Which local address and interface a rank's process-group traffic should use.

gloo, left alone, advertises the address the machine's hostname resolves to; on many machines
(Debian's ``127.0.1.1`` entry in /etc/hosts, containers whose hostname maps to 127.0.0.1)
that is loopback, which no other host can reach, and the process group fails to connect. The
standard knobs name an interface instead (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``):
lockstep sets them to the interface that holds the address through which the rank's node
reaches the other ranks, unless the user has set them.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import socket
import struct
from collections.abc import Mapping

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
#: The variables that name the interface of each backend's sockets.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: An address no host has (TEST-NET-1): a UDP socket "connected" to it shows the address of
#: the default route, without sending anything.
_OUTSIDE_ADDRESS = "192.0.2.1"
_SIOCGIFADDR = 0x8915


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is, or resolves to, a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def address_reaching(host: str, port: int = 9) -> str | None:
    """The local address this machine's traffic to ``host`` leaves from (the routing table's
    choice; nothing is sent), or None when ``host`` can't be resolved or routed to."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, target in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(target)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


def own_address(master_addr: str, master_port: int, multi_node: bool) -> str | None:
    """The address at which the other ranks reach this process's node: the local address that
    reaches ``master_addr``; when that is loopback although the group spans several nodes (the
    master's name resolves to loopback here), the address of the default route."""
    address = address_reaching(master_addr, master_port)
    if address is not None and multi_node and ipaddress.ip_address(address).is_loopback:
        outside = address_reaching(_OUTSIDE_ADDRESS)
        logger.debug("MASTER_ADDR %s is loopback here but the group spans nodes; using %s", master_addr, outside)
        return outside
    return address


def interface_addresses() -> dict[str, list[str]]:
    """Each network interface of this machine with its addresses (IPv4 by ioctl, IPv6 from
    /proc/net/if_inet6 where Linux has it)."""
    found: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                found.setdefault(name, [])
                continue
            found.setdefault(name, []).append(socket.inet_ntoa(answer[20:24]))
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6:
                    packed = bytes.fromhex(fields[0])
                    found.setdefault(fields[5], []).append(str(ipaddress.IPv6Address(packed)))
    except OSError:
        pass
    return found


def interface_of(address: str) -> str | None:
    """The local interface holding ``address``, or None when no interface here holds it."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, addresses in interface_addresses().items():
        if any(ipaddress.ip_address(held.split("%")[0]) == wanted for held in addresses):
            return name
    if wanted.is_loopback:
        return next(
            (
                name
                for name, addresses in interface_addresses().items()
                if any(ipaddress.ip_address(held).is_loopback for held in addresses)
            ),
            None,
        )
    return None


def socket_variables(address: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` for the local interface holding
    ``address``, leaving out those ``environ`` already sets; empty when no interface here
    holds ``address`` (the backends then choose as they would without lockstep)."""
    interface = interface_of(address)
    if interface is None:
        logger.debug("no interface holds %s on this host; the process group chooses its own", address)
        return {}
    values = {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": f"={interface}"}
    return {name: value for name, value in values.items() if not environ.get(name)}
