"""Hosts made of network namespaces, for tests of what only networks do.

:class:`Network` builds one namespace per host, each with loopback up and an
``eth0`` joined by a veth pair to a bridge that lives in a namespace of its
own (the switch), so nothing of the machine's own network is touched:

    trainer 10.213.0.1  ─┐
    redis   10.213.0.2  ─┤
    w1      10.213.0.11 ─┼─ bridge (switch namespace)
    w2      10.213.0.12 ─┘

Namespace names carry this process's pid (``rqh<pid>-<host>``), so concurrent
runs never collide, and a run killed too hard to clean up (SIGKILL) is swept
by the next one. :meth:`Network.cut` sets a host's switch port down (its cable
pulled: both ends see silence, no error), :meth:`Network.mend` sets it up.

Needs root (``ip netns``); :func:`unavailable` says why not when it cannot.
"""

from __future__ import annotations

import os
import subprocess

import psutil

from tests.procs import on_exit

PREFIX = "rqh"
SUBNET = "10.213.0"
BRIDGE = "br0"


def ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = ip("netns", "add", name, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed: {made.stderr.strip()}"
        ip("netns", "delete", name, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip` is not usable: {exc}"
    return None


def sweep_stale() -> None:
    """Delete namespaces left by runs whose process is gone."""
    listed = ip("netns", "list", check=False).stdout.split()
    for name in listed:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            ip("netns", "delete", name, check=False)


class Network:
    """A switch namespace and one namespace per host; ``hosts``: name → last octet."""

    def __init__(self, hosts: dict[str, int]) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.tag}-sw"
        self.addresses = {host: f"{SUBNET}.{octet}" for host, octet in hosts.items()}
        self.made: list[str] = []
        on_exit(self.teardown)
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.made.append(name)
        ip("-n", name, "link", "set", "lo", "up")  # vLLM and gloo use loopback inside a host

    def _build(self) -> None:
        sweep_stale()
        self._add_namespace(self.switch)
        ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge")
        ip("-n", self.switch, "link", "set", BRIDGE, "up")
        for host, address in self.addresses.items():
            ns = self.namespace(host)
            self._add_namespace(ns)
            ip("-n", self.switch, "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("-n", self.switch, "link", "set", host, "master", BRIDGE)
            ip("-n", self.switch, "link", "set", host, "up")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def cut(self, host: str) -> None:
        """Pull ``host``'s cable: its switch port goes down."""
        ip("-n", self.switch, "link", "set", host, "down")

    def mend(self, host: str) -> None:
        ip("-n", self.switch, "link", "set", host, "up")

    def teardown(self) -> None:
        """Delete every namespace made (their links and the bridge go with them)."""
        while self.made:
            ip("netns", "delete", self.made.pop(), check=False)
