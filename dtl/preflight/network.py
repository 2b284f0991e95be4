"""What the network looks like from this node: interfaces, names, and what each backend binds.

gloo takes its address from the hostname (resolved by /etc/hosts or DNS), unless
GLOO_SOCKET_IFNAME names interfaces; a hostname that resolves to 127.0.1.1 (Debian's hosts
file) gives a loopback address, which the other nodes then dial and reach themselves. NCCL's
bootstrap picks an interface by itself (InfiniBand first, then any but lo and docker*), unless
NCCL_SOCKET_IFNAME says otherwise, in a syntax of its own: a prefix (eth), an exact name (=eth0),
or exclusions (^docker,lo). gloo takes names only: "^lo" is looked up as an interface named ^lo.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address


def interfaces() -> dict[str, str | None]:
    """Every interface of this node (this network namespace) and its IPv4 address, if any."""
    return {name: interface_address(name) for _, name in socket.if_nameindex()}


def interface_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def resolve(host: str) -> list[str]:
    """The IPv4 addresses `host` resolves to on this node (empty: it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def is_this_node(address: str) -> bool:
    """Is `address` one of this node's own (a loopback one, or an interface's)?"""
    return is_loopback(address) or address in interfaces().values()


def gloo_address(ifname: str | None) -> str | None:
    """The address gloo binds: the first GLOO_SOCKET_IFNAME interface's, else the hostname's
    first address that is this node's (gloo's own rule; None: it would fall back to loopback)."""
    if ifname:
        return interface_address(ifname.split(",")[0])
    for address in resolve(socket.gethostname()):
        if is_this_node(address):
            return address
    return None


def nccl_interface(ifname: str | None) -> str | None:
    """The interface NCCL's bootstrap would take: NCCL_SOCKET_IFNAME's rule, else its default
    order (ib*, then any interface but lo and docker*)."""
    names = [n for n, address in interfaces().items() if address]
    if ifname:
        return next((n for n in names if nccl_matches(ifname, n)), None)
    for wanted in (lambda n: n.startswith("ib"), lambda n: not n.startswith(("lo", "docker"))):
        found = next((n for n in names if wanted(n)), None)
        if found:
            return found
    return None


def nccl_matches(rule: str, name: str) -> bool:
    """NCCL_SOCKET_IFNAME's syntax: "^a,b" excludes, "=a,b" is exact, "a,b" are prefixes."""
    if rule.startswith("^"):
        return not any(name.startswith(p) for p in rule[1:].split(","))
    if rule.startswith("="):
        return name in rule[1:].split(",")
    return any(name.startswith(p) for p in rule.split(","))
