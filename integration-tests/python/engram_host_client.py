#!/usr/bin/env python3
"""A minimal client of a donor's host socket, written from PROTOCOL.md
section 5 alone: it maps the donor's table memory and reads rows from the
mapping. Standard library only, plus `xxhash` for the record's checksum.

    engram_host_client.py SOCKET_PATH TABLE_ID DIGEST_HEX ROW[,ROW...]

Prints each row as `ROW HEX`, then `generation G`.
"""

import fcntl
import json
import mmap
import socket
import struct
import sys

import xxhash

ROW_BYTES = 264
F_GET_SEALS = 1034  # F_LINUX_SPECIFIC_BASE + 10
F_SEAL_SHRINK, F_SEAL_GROW, F_SEAL_WRITE = 0x2, 0x4, 0x8


def main():
    path, table_id, digest_hex, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    rows = [int(r) for r in rows.split(",")]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(path)
    first = True
    while True:
        data, fds, _flags, _addr = socket.recv_fds(sock, 4096, 1)
        if not data:
            sys.exit("the donor closed the socket")
        msg = json.loads(data)
        if first:
            if msg.get("engram_host") != 1 or "refused" in msg:
                sys.exit(f"not welcomed: {msg}")
            first = False
            continue
        if msg.get("synced"):
            sys.exit(f"table {table_id} was not sent")
        if msg.get("table") != table_id or "unshared" in msg or "gone" in msg:
            for fd in fds:
                socket.close(fd)
            continue
        if msg["digest"] != digest_hex or len(fds) != 1 or msg["layout"] != "packed":
            sys.exit(f"unexpected table message: {msg}")
        fd = fds[0]
        break
    seals = fcntl.fcntl(fd, F_GET_SEALS)
    need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE
    if seals & need != need:
        sys.exit(f"the memory is not sealed: {seals:#x}")
    size = msg["bytes"]
    mem = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    rec = mem[size - 4096:size - 4096 + 88]
    magic, version, tid, layer, flags, nrows = struct.unpack_from("<8sIIIIQ", rec, 0)
    digest = rec[32:64]
    (generation,) = struct.unpack_from("<Q", rec, 64)
    (checksum,) = struct.unpack_from("<Q", rec, 80)
    if magic != b"ENGRKEPT" or version != 1 or xxhash.xxh3_64_intdigest(rec[:80]) != checksum:
        sys.exit("bad record")
    if (tid, layer, nrows, digest.hex(), generation) != (
        table_id, msg["layer"], msg["rows"], digest_hex, msg["generation"]
    ):
        sys.exit(f"the record does not match the message: {msg}")
    for r in rows:
        if r >= nrows:
            sys.exit(f"row {r} is out of range")
        print(r, mem[r * ROW_BYTES:(r + 1) * ROW_BYTES].hex())
    print("generation", generation)


if __name__ == "__main__":
    main()
