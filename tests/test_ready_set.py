"""The driver's epoll loop (lockstep._internal.executors.ready_set.ReadySet)."""

from __future__ import annotations

import socket

import pytest

from lockstep._internal.executors.ready_set import ReadySet


def test_only_the_readable_handles_targets_come_back_and_a_closed_peer_counts() -> None:
    watched = ReadySet()
    first, first_peer = socket.socketpair()
    second, second_peer = socket.socketpair()
    try:
        watched.add(first, "first")
        watched.add(second.fileno(), "second")
        assert watched.ready(0) == []
        first_peer.send(b"x")
        assert watched.ready(1.0) == ["first"]
        second_peer.close()
        assert sorted(watched.ready(1.0)) == ["first", "second"], "a peer that hung up is readable (EOF)"
        with pytest.raises(KeyError):
            watched.add(first, "again")
    finally:
        for handle in (first, first_peer, second):
            handle.close()
        watched.close()


def test_a_socket_closed_before_it_is_removed_frees_its_descriptor_for_the_next() -> None:
    watched = ReadySet()
    sock, peer = socket.socketpair()
    try:
        watched.add(sock, "old")
        number = sock.fileno()
        sock.close()
        watched.remove(sock)  # fileno() is -1 now: found by the handle itself
        reused, reused_peer = socket.socketpair()
        try:
            assert reused.fileno() == number, "POSIX gives the lowest free descriptor"
            watched.add(reused, "new")  # would raise KeyError had the closed socket's entry stayed
            peer.close()
            reused_peer.send(b"y")
            assert watched.ready(1.0) == ["new"]
        finally:
            reused.close()
            reused_peer.close()
    finally:
        peer.close()
        watched.close()
