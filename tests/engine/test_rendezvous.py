"""The process group's rendezvous: rank 0 serves the store on a socket it bound itself, at a port the
kernel picked, on the address asked for (loopback for a run on one machine) and on nothing else. A
port found free and bound later could be taken first by another run on the machine, and torch's own
store listens on every interface."""

from __future__ import annotations

import errno
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppoflow.engine.parallel import join_process_group, open_rendezvous

LISTEN = "0A"
"""The state of a listening socket in /proc/net/tcp."""


def _listening_addresses() -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of this process's listening sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == LISTEN and fields[9] in inodes:
                    found.add(fields[1].rsplit(":", 1)[0])
    return found


LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1, as IPv4 and IPv4-mapped IPv6


def _rank(rank: int, ports, results) -> None:
    torch.set_num_threads(1)
    listener = open_rendezvous("127.0.0.1") if rank == 0 else None
    if listener is not None:
        ports.put(listener.getsockname()[1])
    port = listener.getsockname()[1] if listener is not None else ports.get()
    join_process_group(rank, 2, "127.0.0.1", port, "cpu", listener)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    results.put((rank, port, float(total), sorted(_listening_addresses())))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_meet_at_rank_0s_socket_and_listen_on_loopback_only():
    context = mp.get_context("spawn")
    ports, results = context.SimpleQueue(), context.SimpleQueue()
    mp.start_processes(_rank, args=(ports, results), nprocs=2, start_method="spawn")
    reports = sorted(results.get() for _ in range(2))
    assert [report[2] for report in reports] == [3.0, 3.0]  # 1 + 2: the collective ran
    assert reports[0][1] == reports[1][1]
    for rank, _, _, addresses in reports:
        assert addresses, f"rank {rank} listens nowhere"
        assert set(addresses) <= LOOPBACK, f"rank {rank} listens on {addresses}"


def test_the_rendezvous_port_is_taken_from_the_start():
    listener = open_rendezvous("127.0.0.1")
    try:
        squatter = socket.socket()
        with squatter, pytest.raises(OSError) as info:
            squatter.bind(("127.0.0.1", listener.getsockname()[1]))
        assert info.value.errno == errno.EADDRINUSE
    finally:
        listener.close()


def test_rank_0_alone_serves_the_store():
    with pytest.raises(ValueError, match="rank 0, and it alone, serves the store"):
        join_process_group(0, 2, "127.0.0.1", 1, "cpu", None)
    listener = open_rendezvous("127.0.0.1")
    with listener, pytest.raises(ValueError, match="rank 1: rank 0, and it alone"):
        join_process_group(1, 2, "127.0.0.1", listener.getsockname()[1], "cpu", listener)
