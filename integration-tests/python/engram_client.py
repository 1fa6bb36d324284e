#!/usr/bin/env python3
"""A minimal engram-rack data-plane client, written from PROTOCOL.md alone.

It proves the document is enough to talk to a donor from another language.
Standard library only, plus `xxhash` (pip install xxhash) for the checksum.

    engram_client.py HOST:PORT TABLE_ID DIGEST_HEX ROW[,ROW...] [--hexdump] [--version 2]

Prints each row as `ROW HEX`; with --hexdump, prints the Hello, Welcome,
Lookup and Rows frames as hexdumps instead (PROTOCOL.md's worked example).
With --version 2 it says protocol version 2 and reads tables of any row
encoding (PROTOCOL.md 3.2, 3.3, 3.5).
"""

import socket
import struct
import sys

import xxhash

HEADER = struct.Struct("<IBBHQ")  # payload_len, kind, flags, reserved, request_id
KIND = {"Hello": 1, "Welcome": 2, "Lookup": 3, "Rows": 4, "Error": 5, "Ping": 6, "Pong": 7, "Goodbye": 8}
ROW_BYTES = 264
# Row bytes of each encoding kind (PROTOCOL.md 3.3) by values per row (section 2).
KIND_ROW_BYTES = {1: lambda v: v + v // 32, 2: lambda v: v, 3: lambda v: 2 * v, 4: lambda v: v // 2 + v // 16}


def frame(kind, request_id, payload):
    return HEADER.pack(len(payload), KIND[kind], 0, 0, request_id) + payload


def read_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("donor closed the connection")
        buf += chunk
    return buf


def read_frame(sock, max_payload=1 << 24):
    head = read_exact(sock, HEADER.size)
    length, kind, flags, reserved, request_id = HEADER.unpack(head)
    if flags or reserved or length > max_payload:
        raise ValueError("bad frame header")
    return kind, request_id, read_exact(sock, length), head


def hexdump(title, data):
    print(title)
    for off in range(0, len(data), 16):
        chunk = data[off:off + 16]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        print(f"  {off:04x}  {hexes}")


def main():
    addr, table_id, digest_hex, rows = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dump = "--hexdump" in sys.argv
    version = int(sys.argv[sys.argv.index("--version") + 1]) if "--version" in sys.argv else 1
    rows = [int(r) for r in rows.split(",")]
    host, port = addr.rsplit(":", 1)
    digest = bytes.fromhex(digest_hex)
    sock = socket.create_connection((host, int(port)), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    # Hello: magic, version, reserved, name length, credential length, name, credential.
    name = b"py-client"
    hello = frame("Hello", 0, b"ENGR" + struct.pack("<HHHH", version, 0, len(name), 0) + name)
    sock.sendall(hello)
    kind, _, payload, head = read_frame(sock)
    if kind != KIND["Welcome"]:
        raise SystemExit(f"expected Welcome, got kind {kind}: {payload!r}")
    spoken, name_len, n_tables, max_rows, max_payload = struct.unpack_from("<HHIII", payload, 0)
    if spoken != version:
        raise SystemExit(f"the donor answered version {spoken} to version {version}")
    tables = {}
    row_bytes = {}
    at = 16 + name_len
    for _ in range(n_tables):
        tid, layer, nrows = struct.unpack_from("<IIQ", payload, at)
        tables[tid] = (layer, nrows, payload[at + 16:at + 48])
        row_bytes[tid] = ROW_BYTES
        if version >= 2:
            kind, values, size, _scale, reserved = struct.unpack_from("<HHIII", payload, at + 48)
            if kind not in KIND_ROW_BYTES or KIND_ROW_BYTES[kind](values) != size or reserved:
                raise SystemExit(f"table {tid}: a malformed entry")
            row_bytes[tid] = size
        at += 48 if version == 1 else 64
    if tables.get(table_id, (0, 0, b""))[2] != digest:
        raise SystemExit("the donor does not serve this table at the pinned digest")
    if dump:
        hexdump("Hello (client -> donor)", hello)
        hexdump("Welcome (donor -> client)", head + payload)

    # Lookup: section count, reserved, then per section: table id, row count, digest prefix, row ids.
    prefix = struct.unpack("<Q", digest[:8])[0]
    body = struct.pack("<II", 1, 0) + struct.pack("<IIQ", table_id, len(rows), prefix)
    body += b"".join(struct.pack("<Q", r) for r in rows)
    lookup = frame("Lookup", 7, body)
    sock.sendall(lookup)
    kind, request_id, payload, head = read_frame(sock)
    if kind != KIND["Rows"] or request_id != 7:
        raise SystemExit(f"expected Rows for request 7, got kind {kind} id {request_id}")
    checksum, count, _ = struct.unpack_from("<QII", payload, 0)
    if xxhash.xxh3_64_intdigest(payload[8:]) != checksum:
        raise SystemExit("checksum mismatch: answer discarded")
    at = 16
    data_at = 16 + 12 * count
    for _ in range(count):
        tid, status, size, n = struct.unpack_from("<IHHI", payload, at)
        at += 12
        if status != 0:
            raise SystemExit(f"table {tid}: status {status}")
        size = size or ROW_BYTES
        if size != row_bytes[tid]:
            raise SystemExit(f"table {tid}: rows of {size} bytes, announced {row_bytes[tid]}")
        for r in rows[:n]:
            if not dump:
                print(r, payload[data_at:data_at + size].hex())
            data_at += size
    if dump:
        hexdump("Lookup (client -> donor)", lookup)
        hexdump("Rows (donor -> client)", head + payload)
    sock.close()


if __name__ == "__main__":
    main()
